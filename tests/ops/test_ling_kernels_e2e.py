"""A tiny Ling checkpoint end to end through `LLM.generate` (fp32 on CPU) with the Triton lightning and norm kernels
forced (through the interpreter), against the same engine on the torch references: 4 prompts of different lengths
decoded together (a 32-token budget, so prefill chunks and decode rows share steps) and one at a time."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.ops import backends
from tests.helpers import add_tokenizer
from tests.reference.ling_naive import (
    random_ling_checkpoint,
    tiny_ling_config,
    write_checkpoint,
)

STEPS = 16
PROMPT_LENGTHS = [5, 12, 33, 70]  # 70 crosses a 64-token chunk edge in the prefill kernel


@pytest.fixture(scope="module")
def ling_dir(tmp_path_factory) -> Path:
    config = tiny_ling_config()
    directory = tmp_path_factory.mktemp("ling-kernels")
    write_checkpoint(directory, config, random_ling_checkpoint(config, seed=11))
    add_tokenizer(directory)
    return directory


def _run(directory: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs: all prompts in one call, then each prompt alone."""
    llm = LLM(str(directory), device="cpu", dtype="float32", max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in prompts]
    results = []
    for output in together + alone:
        completion = output.outputs[0]
        results.append((completion.token_ids, [step[t] for step, t in zip(completion.logprobs, completion.token_ids)]))
    return results


def test_generate_with_triton_kernels_matches_torch_path(ling_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    expected = _run(ling_dir, prompts)
    with monkeypatch.context() as patch:
        forced = []
        patch.setattr(backends, "use_triton", lambda op, device: forced.append(op) or op in ("lightning", "norm"))
        got = _run(ling_dir, prompts)
    assert {"lightning", "norm"} <= set(forced)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert len(tokens) == STEPS and tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) <= 1e-4
    assert all(tokens == expected[i][0] for i, (tokens, _) in enumerate(got[len(prompts):]))  # alone == together
