"""A tiny Ling checkpoint end to end through `LLM.generate` (fp32 on CPU) with the Triton lightning, norm,
activation, MoE and router kernels forced (through the interpreter), against the same engine on the torch
references: 4 prompts of different lengths decoded together (a 32-token budget, so prefill chunks and decode rows
share steps) and one at a time. Two layers (lightning + dense FFN, MLA + MoE) and two heads keep the interpreter's
launches and programs few."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.ops import backends
from tests.helpers import add_tokenizer
from tests.ops.conftest import ON_GPU
from tests.reference.ling_naive import (
    random_ling_checkpoint,
    tiny_ling_config,
    write_checkpoint,
)

# On CUDA the kernels run on the product path, and tests/gpu/test_decode_agreement_gpu.py drives them through the
# model there; this test is the interpreter's CPU counterpart.
pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU (interpreter) test; CUDA: tests/gpu/test_decode_agreement_gpu.py")
STEPS = 16
PROMPT_LENGTHS = [5, 12, 33, 70]  # 33 and 70 are prefilled in 32-token chunks that resume from the state
KERNELS = ("lightning", "ling_norm", "activation", "moe", "router")  # the attention kernel: tests/ops/attention*


@pytest.fixture(scope="module")
def ling_dir(tmp_path_factory) -> Path:
    config = tiny_ling_config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    directory = tmp_path_factory.mktemp("ling-kernels")
    write_checkpoint(directory, config, random_ling_checkpoint(config, seed=11))
    add_tokenizer(directory)
    return directory


def _generate(directory: Path, prompts: list[list[int]], together: bool) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs: all prompts in one call, or each prompt alone."""
    llm = LLM(str(directory), device="cpu", dtype="float32", max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(requests, params) if together else [llm.generate([r], params)[0] for r in requests]
    return [(o.outputs[0].token_ids, [step[t] for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]


def test_generate_with_triton_kernels_matches_torch_path(ling_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    expected = _generate(ling_dir, prompts, together=True)  # the torch path is batch-invariant (tests/engine)
    with monkeypatch.context() as patch:
        forced = []
        patch.setattr(backends, "use_triton", lambda op, device: forced.append(op) or op in KERNELS)
        runs = [_generate(ling_dir, prompts, together=True), _generate(ling_dir, prompts, together=False)]
    assert set(KERNELS) <= set(forced)
    for got in runs:
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
            assert len(tokens) == STEPS and tokens == ref_tokens
            assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) <= 1e-4
