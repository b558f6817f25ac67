"""The engine with HYBRIDSERVE_ONE_LAUNCH_MOE=1 (ZAYA1's MoE half as one launch in decode steps, ops/zaya_moe.py)
decodes what it decodes without: the launch computes the separate kernels' bits (tests/ops/test_zaya_moe_kernel.py),
so greedy tokens and their logprobs must be equal, from CUDA graphs (two layers at ZAYA1-8B widths, bf16)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.ops import zaya_moe
from tests.gpu.models import write_two_layer_model

pytestmark = pytest.mark.gpu(engine=True)


def _decode(directory: Path, prompts: list, params: list, monkeypatch, one_launch: bool) -> list:
    monkeypatch.setenv("HYBRIDSERVE_ONE_LAUNCH_MOE", "1" if one_launch else "0")
    zaya_moe.enabled.cache_clear()
    llm = LLM(str(directory), dtype="bfloat16", device="cuda", max_model_len=2048, max_running_requests=8,
              gpu_memory_utilization=0.2, use_tqdm=False)
    calls = []
    launch = zaya_moe.routed_experts_residual_norm
    monkeypatch.setattr(zaya_moe, "routed_experts_residual_norm", lambda *a: (calls.append(1), launch(*a))[1])
    try:
        outputs = llm.generate(prompts, params)
    finally:
        monkeypatch.setattr(zaya_moe, "routed_experts_residual_norm", launch)
        zaya_moe.enabled.cache_clear()
    assert bool(calls) == one_launch  # (captured into the graphs: called at capture, replayed after)
    del llm
    torch.cuda.empty_cache()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def test_one_launch_decodes_what_the_separate_kernels_decode(tmp_path: Path, monkeypatch) -> None:
    write_two_layer_model("zaya", tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()} for n in (5, 130, 17, 64)]
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True) for _ in prompts]
    assert _decode(tmp_path, prompts, params, monkeypatch, True) == _decode(tmp_path, prompts, params, monkeypatch,
                                                                           False)
