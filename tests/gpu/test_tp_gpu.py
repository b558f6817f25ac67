"""Tensor parallelism on two GPUs (NCCL, CUDA graphs and overlapped scheduling on): TP=2 against TP=1 on ZAYA1-8B
and Ling-2.6-flash widths (two layers each, fp32 so that only the order of the shards' partial sums differs):
the same greedy tokens, logprobs within 1e-4. Needs `nvidia-h200-x2` (skipped with fewer than two GPUs)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.demo import write_random_checkpoint
from tests.gpu.test_ling_gpu import FLASH
from tests.gpu.test_zaya_gpu import ZAYA1_8B_SHAPED
from tests.helpers import add_tokenizer
from tests.reference.ling_naive import random_ling_checkpoint, write_checkpoint

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

LOGPROB_TOL = 1e-4  # fp32 on the GPU, reductions over hidden 2048-4096 split in two


@pytest.mark.parametrize("model", ["zaya", "ling"])
def test_tp2_equals_tp1(model: str, tmp_path: Path) -> None:
    if model == "zaya":
        write_random_checkpoint(tmp_path, ZAYA1_8B_SHAPED | {"num_hidden_layers": 2})
    else:
        write_checkpoint(tmp_path, FLASH, random_ling_checkpoint(FLASH, 0))
    add_tokenizer(tmp_path)
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
    worst = 0.0
    for want, have in zip(results[1], results[2]):
        a, b = want.outputs[0], have.outputs[0]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            worst = max([worst] + [abs(x[t] - y[t]) for t in x])
    print(f"\n{model}: TP=2 vs TP=1 largest logprob difference {worst:.2e}")
    assert worst <= LOGPROB_TOL
