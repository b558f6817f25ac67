"""The prefill graphs without the capture: static input buffers, several rows (prompt chunks beside decode rows),
the padding row on the dummies (empty when the rows fill their size), unused row slots empty, page tables and
slots gathered from the persistent tables, chunked continuations and prefix-cache hits, steps with too many rows or
tokens or wanting prompt logprobs left to the eager path. On CPU the same static-buffer forward runs eagerly
(`PrefillGraphs(capture=False)`), so everything but the capture is checked against the engine's normal eager steps;
tests/gpu/test_prefill_graphs_gpu.py replays real graphs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.core.chunk import ScheduledChunk
from hybridserve.runtime.prefill_graphs import PrefillGraphs, prefill_sizes


def test_prefill_sizes() -> None:
    assert prefill_sizes(0) == [] and prefill_sizes(15) == []
    assert prefill_sizes(16) == [16]
    assert prefill_sizes(100) == [16, 32, 64, 100]
    assert prefill_sizes(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert prefill_sizes(5000) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 5000]
    assert prefill_sizes(8192)[6:] == [1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192]


def test_prefill_graph_option_is_checked() -> None:
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        EngineConfig(model="x", prefill_graph_max_tokens=-1)


def _llm(directory, **options) -> LLM:
    return LLM(str(directory), use_tqdm=False, device="cpu", dtype="float32", page_size=4, max_running_requests=8,
               chunked_prefill_size=20, **options)


def test_static_padded_prefill_matches_eager_steps(zaya_dir) -> None:
    eager, graphed = _llm(zaya_dir), _llm(zaya_dir)
    runner, engine = graphed.engine.runner, graphed.engine
    assert runner.prefill_graphs is None  # CPU: no graphs of any kind unless built by hand
    # zaya_dir's tiny config has a sliding layer (W = 6): its window group's table and slot mapping are inputs too.
    assert runner.tables.window is not None and runner.model.prefill_graphs
    graphs = runner.prefill_graphs = PrefillGraphs(runner.model, runner.tables, engine.config.page_size,
                                                   engine.max_model_len, [16, 32, 64], 3, runner.device, capture=False)
    assert not graphs.placeholders  # the torch references read the step's own host fields
    runs, steps = [], []
    run = graphs.run

    def counted(chunks, *rest):
        steps.append([(len(c.token_ids), c.prefix_len) for c in chunks])
        if len(chunks) == 1:
            runs.append((len(chunks[0].token_ids), chunks[0].prefix_len, graphs.size_for(len(chunks[0].token_ids))))
        return run(chunks, *rest)
    graphs.run = counted
    gen = torch.Generator().manual_seed(5)
    # 16 tokens: exactly a size (empty padding row); 45: chunks of 20, 20 (padded to 32) and 5 (to 16), the later
    # ones resuming the state; 9: padded to 16; 3: below the smallest size, padded too.
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (16, 45, 9, 3)]
    params = [SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=6, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, logprobs=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, logprobs=1, ignore_eos=True)]
    for round_ in range(2):  # the second round hits the prefix cache: rows that start after a cached prefix
        for prompt, sampling in zip(prompts, params):  # one at a time: every prefill step has one row
            inputs = [{"prompt_token_ids": prompt}]
            want, have = (llm.generate(inputs, sampling)[0].outputs[0] for llm in (eager, graphed))
            assert want.token_ids == have.token_ids, (round_, len(prompt))
            for x, y in zip(want.logprobs, have.logprobs):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= 1e-5 for t in x), (x, y)
    assert (16, 0, 16) in runs and (20, 20, 32) in runs and (5, 40, 16) in runs and (3, 0, 16) in runs
    assert any(prefix > 0 and (prefix, length) not in ((20, 20), (40, 5)) for length, prefix, _ in runs)  # hits
    # More rows than its slots (3), more tokens than the largest size (64), prompt logprobs (a logits row per
    # position) or drafts to verify: the eager path.
    row = ScheduledChunk([5] * 9, 0, [1, 2, 3], 1, False, [8])
    decode = dataclasses.replace(row, token_ids=[5], logits_offsets=[0])
    assert graphs.fits([row]) and graphs.fits([row, row, decode])
    assert not graphs.fits([row] * 4) and not graphs.fits([row] * 3 + [dataclasses.replace(row, token_ids=[5] * 6)])
    assert not graphs.fits([dataclasses.replace(row, token_ids=[5] * 65, page_ids=list(range(1, 18)))])
    assert not graphs.fits([dataclasses.replace(row, logits_offsets=list(range(9)))])
    assert not graphs.fits([dataclasses.replace(row, token_ids=[5, 6], logits_offsets=[0, 1], draft_slots=[2])])
    # Three requests at once, finishing one after another: steps of 3 rows (the prompts, then the 45-token one's
    # chunks beside decode rows), then decode rows alone, 3 and 2 of them, replay the graphs.
    steps.clear()
    batch = [{"prompt_token_ids": p} for p in prompts[:3]]
    for temperature in (0, 0.9):
        mixed = [SamplingParams(temperature=temperature, seed=11 + n, max_tokens=n, logprobs=2, ignore_eos=True,
                                presence_penalty=0.5) for n in (3, 9, 6)]
        want, have = (llm.generate(batch, mixed) for llm in (eager, graphed))
        for x, y in zip(want, have):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            for a, b in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a), (a, b)
    several = [step for step in steps if len(step) > 1]
    assert {len(step) for step in several} == {2, 3}
    assert any(all(n == 1 for n, _ in step) for step in several)  # decode rows alone
    assert any(1 in {n for n, _ in step} and max(n for n, _ in step) > 1 for step in several)  # mixed
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    want, have = (llm.generate([{"prompt_token_ids": prompts[2][::-1]}], scored)[0] for llm in (eager, graphed))
    assert want.outputs[0].token_ids == have.outputs[0].token_ids
    assert all(abs(x[t] - y[t]) <= 1e-5 for x, y in zip(want.prompt_logprobs[1:], have.prompt_logprobs[1:]) for t in x)
