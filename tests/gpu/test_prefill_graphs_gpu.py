"""Prefill and mixed steps replayed from CUDA graphs against eager steps on the H200: same tokens, same logprobs,
the graphs really replayed (one row: padded and exact sizes, fresh rows, chunked continuations, prefix-cache hits;
several rows: a batch's prompts together, then their chunks beside decode rows), and the graph pool within what
the memory plan reserved for it.

An fp32 checkpoint (ZAYA1-8B widths, two layers), so that padding a step to its graph size and planning the
attention's key splits for max_model_len move the logits only by fp32 rounding: greedy tokens must match exactly
and logprobs within 2e-5, as for the decode graphs (tests/gpu/test_cuda_graphs_gpu.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.runtime.memory_profile import graph_pool_bytes
from tests.gpu.models import largest_logprob_difference, write_two_layer_model

pytestmark = pytest.mark.gpu(engine=True)


def test_graph_prefill_matches_eager(tmp_path: Path) -> None:
    write_two_layer_model("zaya", tmp_path)
    options = dict(dtype="float32", device="cuda", max_num_batched_tokens=4096, chunked_prefill_size=1024,
                   max_running_requests=8, max_model_len=8192, gpu_memory_utilization=0.25, use_tqdm=False)
    gen = torch.Generator().manual_seed(1)
    # Lengths below, at and between sizes; 3000 runs as chunks of 1024, 1024 (exact sizes) and 952 (padded).
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()}
               for n in (5, 16, 40, 130, 512, 700, 1024, 3000)]
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True) for _ in prompts]
    params[3] = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, logprobs=1, ignore_eos=True)

    def one_at_a_time(llm: LLM) -> list:  # every prefill step has one row; twice: the second round hits the cache
        return [llm.generate([p], s)[0] for _ in range(2) for p, s in zip(prompts, params)]

    # All at once: the eight prompts in one step (3,000 tokens: its first chunk), then its two other chunks beside
    # the seven others' decode rows, then decode steps alone (the decode graphs; the requests finish one after
    # another). Reversed prompts: no prefix-cache hits.
    together = [{"prompt_token_ids": p["prompt_token_ids"][::-1]} for p in prompts]
    staggered = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, logprobs=1, ignore_eos=True)
                 for i in range(len(prompts))]

    eager = LLM(str(tmp_path), enforce_eager=True, disable_overlap_schedule=True, **options)
    assert eager.engine.runner.prefill_graphs is None and eager.engine.runner.graphs is None
    expected = one_at_a_time(eager)
    expected_together = eager.generate(together, staggered)
    del eager
    torch.cuda.empty_cache()

    llm = LLM(str(tmp_path), **options)
    runner = llm.engine.runner
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.sizes == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096]
    assert graphs.max_rows == 8  # the running cap
    replays, rows = [], []
    for size, graph in graphs._graphs.items():
        graph.replay = (lambda replay, size: lambda: (replays.append(size), replay())[1])(graph.replay, size)
    run = graphs.run
    graphs.run = lambda chunks, *rest: (rows.append(len(chunks)), run(chunks, *rest))[1]
    got = one_at_a_time(llm)
    assert {16, 64, 256, 512, 1024} <= set(replays)
    assert replays.count(1024) >= 3  # the 1024-token prompt and the 3000-token prompt's chunks
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in expected]
    worst = largest_logprob_difference(expected, got)
    print(f"\nlargest logprob difference prefill graphs vs eager {worst:.2e}; {len(replays)} replays over sizes "
          f"{sorted(set(replays))}")
    assert worst <= 2e-5
    pool = graphs.memory_bytes + runner.graphs.memory_bytes
    print(f"graph pool: prefill {graphs.memory_bytes / 2**20:.0f} MiB + decode "
          f"{runner.graphs.memory_bytes / 2**20:.0f} MiB, reserved {runner.graph_reserve / 2**20:.0f} MiB")
    assert 0 < pool <= runner.graph_reserve

    rows.clear()
    got_together = llm.generate(together, staggered)
    worst_together = largest_logprob_difference(expected_together, got_together)
    print(f"several rows: largest logprob difference {worst_together:.2e}; rows per replayed step {rows}")
    assert worst_together <= 2e-5
    assert rows == [8, 8, 8]  # the prompts together, then the chunks beside decode rows

    # Prompt logprobs (a logits row per prompt position) run eagerly, beside the graphs.
    before = len(replays)
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    llm.generate([prompts[2]], scored)
    assert len(replays) == before

    # The trial capture that sized the reserve gives back everything it took (here run again on the live engine,
    # whose caches are bound back after it).
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    taken = graph_pool_bytes(runner)
    runner.bind_pools(runner.kv_pool, runner.window_pool, runner.state_pool, runner.footer_pool)
    print(f"trial capture: {taken / 2**20:.0f} MiB; reserved before {held / 2**20:.0f} MiB, after "
          f"{torch.cuda.memory_reserved() / 2**20:.0f} MiB")
    assert pool <= taken and torch.cuda.memory_reserved() <= held + (16 << 20)
