"""The CUDA-graph decode path without the capture: static input buffers, padding rows on the dummies, the page table
gathered from the persistent tables, the fallback above the largest size. On CPU the same static-buffer forward
runs eagerly (`DecodeGraphs(capture=False)`), so everything but the capture itself is checked against the
engine's normal eager steps here; tests/gpu/test_cuda_graphs_gpu.py replays real graphs.
"""
from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.runtime.cuda_graphs import DecodeGraphs, capture_sizes


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert capture_sizes(256)[-3:] == [240, 248, 256] and len(capture_sizes(256)) == 35


def _llm(directory, **options) -> LLM:
    return LLM(str(directory), use_tqdm=False, device="cpu", dtype="float32", page_size=4, max_running_requests=8,
               **options)


@pytest.mark.parametrize("model", ["zaya", "ling"])
def test_static_padded_decode_matches_eager_steps(model: str, zaya_dir, ling_dir) -> None:
    directory = zaya_dir if model == "zaya" else ling_dir
    # ZAYA1's per-page state footers come from the conv kernel during graph steps (the reference writes them from
    # page_end_*, which a graph batch leaves empty), so on CPU its prefix caching stays off here.
    options = {"enable_prefix_caching": model == "ling"}
    eager, graphed = _llm(directory, **options), _llm(directory, **options)
    runner, engine = graphed.engine.runner, graphed.engine
    # zaya_dir's tiny config has a sliding layer (W = 6): its window group's table and slot mapping are graph inputs.
    assert (runner.tables.window is not None) == (model == "zaya")
    runner.graphs = DecodeGraphs(runner.model, runner.tables, engine.config.page_size, engine.max_model_len,
                                 capture_sizes(4), runner.device, capture=False)
    sizes = []
    run = runner.graphs.run
    runner.graphs.run = lambda chunks, *rest: (sizes.append((len(chunks), runner.graphs.size_for(len(chunks)))),
                                               run(chunks, *rest))[1]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (3, 9, 4, 17, 6, 12)]
    # Different lengths: the batch shrinks from 6 rows (above the largest size, eager) through 5 .. 1 (graphs,
    # padded up to 4 or 2, or exactly 4, 2, 1); one request samples with a seed, one forks n=2.
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, logprobs=2, ignore_eos=True) for i in range(6)]
    params[2] = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=11, logprobs=2, ignore_eos=True)
    params[4] = SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=9, logprobs=1, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    expected, got = eager.generate(inputs, params), graphed.generate(inputs, params)
    for want, have in zip(expected, got):
        for a, b in zip(want.outputs, have.outputs):
            assert a.token_ids == b.token_ids
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                assert all(abs(x[t] - y[t]) <= 1e-5 for t in x), (x, y)
    assert {rows for rows, size in sizes if size != rows} and any(size == rows for rows, size in sizes)
    assert all(size >= rows for rows, size in sizes)
    # A second run reuses the same buffers and the prefix cache (Ling): still the eager steps' tokens.
    again = graphed.generate(inputs, params)
    assert [[o.token_ids for o in r.outputs] for r in again] == [[o.token_ids for o in r.outputs] for r in expected]
