"""Tensor parallelism on two GPUs (NCCL, CUDA graphs and overlapped scheduling on): TP=2 against TP=1 on ZAYA1-8B
and Ling-2.6-flash widths (two layers each, fp32 so that only the order of the shards' partial sums differs):
the same greedy tokens, logprobs within 1e-4. Needs `nvidia-h200-x2` (skipped with fewer than two GPUs)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from tests.gpu.models import largest_logprob_difference, write_two_layer_model

pytestmark = pytest.mark.gpu(engine=True, devices=2)

LOGPROB_TOL = 1e-4  # fp32 on the GPU, reductions over hidden 2048-4096 split in two


@pytest.mark.parametrize("model", ["zaya", "ling"])
def test_tp2_equals_tp1(model: str, tmp_path: Path) -> None:
    write_two_layer_model(model, tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()}
               for n in (5, 40, 130, 17, 300, 64, 9, 500)]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=1, ignore_eos=True)
    options = dict(dtype="float32", device="cuda", max_num_batched_tokens=1024, max_running_requests=16,
                   max_model_len=2048, gpu_memory_utilization=0.3, use_tqdm=False)
    results = {}
    for tp in (1, 2):
        llm = LLM(str(tmp_path), tensor_parallel_size=tp, **options)
        results[tp] = llm.generate(prompts, params)
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    worst = largest_logprob_difference(results[1], results[2])
    print(f"\n{model}: TP=2 vs TP=1 largest logprob difference {worst:.2e}")
    assert worst <= LOGPROB_TOL
