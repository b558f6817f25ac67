"""Speculative decoding on the recurrent kernels (through the interpreter): the ZAYA1 conv kernel with n-gram drafts
and the Ling lightning kernels with MTP drafts, verify rows beside prefill chunks, greedy tokens equal to the torch
path without speculation. Replayed drafts (the plain continuation with every third token wrong) make verify rows
accept none, some and all of their drafts, so the kernels' per-token states are committed at every position."""
from __future__ import annotations

import pytest
import torch

from hybridserve import SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine.drafts import ReplayDrafts
from hybridserve.engine.engine import LLMEngine
from hybridserve.ops import backends
from tests.helpers import add_tokenizer, finish_all
from tests.models.zaya_fixtures import random_hf_zaya, save_hf, tiny_config
from tests.ops.conftest import ON_GPU
from tests.reference.ling_naive import random_ling_checkpoint, tiny_ling_config, write_checkpoint

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU (interpreter) test; CUDA: tests/gpu/test_speculative_gpu.py")
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT_LENGTHS = [5, 11, 20]


@pytest.fixture(scope="module", params=["zaya", "ling"])
def case(request, tmp_path_factory):
    """(checkpoint directory, kernels forced, speculative config)."""
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "zaya":
        save_hf(random_hf_zaya(tiny_config("gqa1"), seed=3), directory)
        spec = {"method": "ngram", "num_speculative_tokens": 3}
        kernels = ("conv",)
    else:
        config = tiny_ling_config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
        write_checkpoint(directory, config, random_ling_checkpoint(config, seed=4))
        spec = {"method": "mtp", "num_speculative_tokens": 3}
        kernels = ("lightning",)
    add_tokenizer(directory)
    return directory, kernels, spec


def _run(directory, prompts, spec=None, drafts=None) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(directory), device="cpu", dtype="float32", page_size=4,
                                    max_num_batched_tokens=16, speculative_config=spec))
    ids = [f"k{i}" for i in range(len(prompts))]
    if drafts is not None:
        engine.set_draft_source(ReplayDrafts(dict(zip(ids, drafts))))
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, PARAMS)
    done = finish_all(engine)
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"] or spec is None
    return [done[i].outputs[0].token_ids for i in ids]


def test_speculation_on_the_recurrent_kernels_equals_the_plain_torch_path(case, monkeypatch):
    directory, kernels, spec = case
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    expected = _run(directory, prompts)
    drafts = [[(t + 1) % 128 if j % 3 == 2 else t for j, t in enumerate(tokens)] for tokens in expected]
    forced = []
    monkeypatch.setattr(backends, "use_triton", lambda op, device: forced.append(op) or op in kernels)
    # The conv kernel's columns form tiled for 8 programs, not an H200's 128: far fewer for the interpreter (the
    # tiling changes no result beyond fp32 summation order; tests/ops/test_conv_kernel.py does the same).
    from hybridserve.ops.triton import conv

    monkeypatch.setattr(conv, "PROGRAMS", 8)
    assert _run(directory, prompts, spec, drafts) == expected
    assert set(kernels) <= set(forced)
