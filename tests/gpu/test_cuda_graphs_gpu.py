"""Decode from CUDA graphs against eager decode on the H200: same tokens, same logprobs, graphs really replayed, and
the graph pool within what the memory plan reserved for it.

fp32 checkpoints (ZAYA1-8B and Ling-2.6-flash widths, two layers), so that padding a step to its graph size and
planning the attention's key splits for max_model_len move the logits only by fp32 rounding: greedy tokens must
match exactly and logprobs within 2e-5. The eager run processes each step before scheduling the next, the graph run
overlaps them (the default), so the same check covers overlapped scheduling on CUDA (decode inputs read from the
previous step's draws on the device, inside the graph's static buffers).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from tests.gpu.models import largest_logprob_difference, write_two_layer_model

pytestmark = pytest.mark.gpu(engine=True)


@pytest.mark.parametrize("model", ["zaya", "ling"])
def test_graph_decode_matches_eager(model: str, tmp_path: Path) -> None:
    write_two_layer_model(model, tmp_path)
    options = dict(dtype="float32", device="cuda", max_num_batched_tokens=1024, max_running_requests=24,
                   max_model_len=2048, gpu_memory_utilization=0.2, use_tqdm=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()}
               for n in (5, 40, 130, 17, 300, 64, 9, 700, 33, 250, 80, 3, 500)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    params[3] = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, logprobs=1, ignore_eos=True)

    # Eager decode, each step processed before the next is scheduled; the graph run below is overlapped.
    eager = LLM(str(tmp_path), enforce_eager=True, disable_overlap_schedule=True, **options)
    assert eager.engine.runner.graphs is None
    expected = eager.generate(prompts, params)
    del eager
    torch.cuda.empty_cache()

    llm = LLM(str(tmp_path), **options)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 24]
    replays = []
    for size, graph in graphs._graphs.items():
        graph.replay = (lambda replay, size: lambda: (replays.append(size), replay())[1])(graph.replay, size)
    got = llm.generate(prompts, params)
    assert len(replays) > 20 and len(set(replays)) >= 4  # the batch shrinks through several sizes
    worst = largest_logprob_difference(expected, got)
    print(f"\n{model}: largest logprob difference graphs vs eager {worst:.2e}")
    assert worst <= 2e-5  # measured 5.7e-6 (ZAYA1) and 4.8e-6 (Ling) on the H200
    runner = llm.engine.runner
    # ZAYA1's prefill graphs are captured first into the same pool: the decode graphs may only reuse its blocks.
    pool = graphs.memory_bytes + (runner.prefill_graphs.memory_bytes if runner.prefill_graphs is not None else 0)
    print(f"\n{model}: graph pool {pool / 2**20:.0f} MiB (decode graphs {graphs.memory_bytes / 2**20:.0f}), reserved "
          f"{runner.graph_reserve / 2**20:.0f} MiB, {len(replays)} replays over sizes {sorted(set(replays))}")
    assert 0 < pool <= runner.graph_reserve


def test_graph_pool_within_its_reserve_at_256_rows(tmp_path: Path) -> None:
    """All 35 decode sizes up to 256 rows and the prefill graphs in one pool stay within what the memory plan
    reserved for it (each size's own fp32 logits over the 262k vocabulary, kept alive, once held 4.2 GiB)."""
    write_two_layer_model("zaya", tmp_path, bf16=True)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", max_running_requests=256, max_model_len=4096,
              gpu_memory_utilization=0.3, use_tqdm=False)
    runner = llm.engine.runner
    assert len(runner.graphs.sizes) == 35 and runner.prefill_graphs is not None
    pool = runner.graphs.memory_bytes + runner.prefill_graphs.memory_bytes
    print(f"\ngraph pool {pool / 2**20:.0f} MiB (decode {runner.graphs.memory_bytes / 2**20:.0f}, prefill "
          f"{runner.prefill_graphs.memory_bytes / 2**20:.0f}), reserved {runner.graph_reserve / 2**20:.0f} MiB")
    assert 0 < pool <= runner.graph_reserve
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 40, SamplingParams(temperature=0, max_tokens=4))
    assert len({tuple(r.outputs[0].token_ids) for r in out}) == 1  # 40 equal rows (a padded size) agree
