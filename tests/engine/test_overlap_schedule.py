"""Overlapped scheduling (the default) against processing each step before scheduling the next
(`disable_overlap_schedule`): the same outputs on both model families and the sliding-window model, for greedy and
seeded sampling with penalties and logprobs, n > 1, stop tokens and stop strings that land while the next step is
already running, max_tokens, min_tokens, aborts mid-flight, preemption in tight pools, chunked prefill and prefix
hits after discarded work. Resources are recounted after every step, and idle engines hold nothing.

On CPU the device work is synchronous, so these tests check the bookkeeping (tokens counted before they reach the
host, inputs read from the previous step's draws, discarded work); the speed is measured on the GPU.
"""
from __future__ import annotations

import random

import pytest
import torch

from hybridserve import SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine

PAGE = 4
LOGPROB_TOL = 1e-5  # fp32 on CPU; overlapped steps batch rows differently (discarded rows, other preemptions)


@pytest.fixture(scope="module", params=["zaya", "ling", "sliding"])
def model(request, zaya_dir, ling_dir, tmp_path_factory):
    """(kind, checkpoint directory): both families and a ZAYA1 with sliding-window layers (W = 9)."""
    if request.param == "sliding":
        from tests.helpers import add_tokenizer
        from tests.models.zaya_fixtures import random_hf_zaya, save_hf, tiny_config

        config = tiny_config("base", num_hidden_layers=4, sliding_window=9,
                             layer_types=["hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"])
        directory = save_hf(random_hf_zaya(config, seed=31), tmp_path_factory.mktemp("zaya-sliding-overlap"))
        add_tokenizer(directory)
        return request.param, directory
    return request.param, zaya_dir if request.param == "zaya" else ling_dir


def _engine(directory, overlap: bool, **options) -> LLMEngine:
    options = {"device": "cpu", "dtype": "float32", "page_size": PAGE, "state_checkpoint_interval": 8,
               "disable_overlap_schedule": not overlap, **options}
    return LLMEngine(EngineConfig(model=str(directory), **options))


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120, (n,), generator=gen).tolist() for n in lengths]


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], abort_at: dict[int, str] = {}
         ) -> dict[str, object]:
    """Run to completion, recounting resources after every step; aborts `abort_at[step]` before that step.
    Returns each request's final output (None for aborted ones)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        if step in abort_at:
            engine.abort_request(abort_at[step])
            done[abort_at[step]] = None
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.cache_manager.check()
        step += 1
    counts = engine.cache_manager.counts()
    assert counts["pages_protected"] == counts["slots_protected"] == 0 and engine._in_flight is None
    return done


def _assert_same(serial: dict, overlapped: dict) -> None:
    assert serial.keys() == overlapped.keys()
    for request_id, want in serial.items():
        have = overlapped[request_id]
        if want is None:
            assert have is None, request_id
            continue
        assert len(want.outputs) == len(have.outputs), request_id
        for a, b in zip(want.outputs, have.outputs):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
                (b.token_ids, b.text, b.finish_reason, b.stop_reason), request_id
            assert (a.logprobs is None) == (b.logprobs is None)
            for x, y in zip(a.logprobs or [], b.logprobs or []):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= LOGPROB_TOL for t in x), request_id


def _both(directory, requests, abort_at: dict[int, str] = {}, **options) -> dict:
    serial = _run(_engine(directory, False, **options), requests, abort_at)
    overlapped = _run(_engine(directory, True, **options), requests, abort_at)
    _assert_same(serial, overlapped)
    return overlapped


def test_sampling_modes_match(model):
    """Greedy, seeded temperature with top-p / top-k, penalties (counted on the device before the host sees the
    token), logprobs and min_tokens, n = 3 forks, several lengths so the batch shrinks while steps are in flight."""
    _, directory = model
    prompts = _prompts([5, 17, 9, 30, 12, 3], seed=1)
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=11, top_p=0.9, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=12, top_k=7, max_tokens=6, repetition_penalty=1.3,
                             frequency_penalty=0.5, presence_penalty=0.3, logprobs=1, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=13, n=3, max_tokens=8, frequency_penalty=0.8, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=14, max_tokens=12, min_tokens=10, presence_penalty=1.5),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)]
    _both(directory, {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(prompts, params))})


def test_stops_landing_while_the_next_step_runs(model):
    """Stop tokens and stop strings found in a greedy run's own output: with overlap the request has already
    been scheduled again when its stop token is processed, and that work is discarded."""
    _, directory = model
    prompts = _prompts([7, 13, 4, 21], seed=2)
    free = _run(_engine(directory, False), {f"f{i}": (p, SamplingParams(temperature=0, max_tokens=12,
                                                                        ignore_eos=True))
                                            for i, p in enumerate(prompts)})
    engine = _engine(directory, False)
    requests = {}
    for i, p in enumerate(prompts):
        tokens = free[f"f{i}"].outputs[0].token_ids
        requests[f"tok{i}"] = (p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[3 + i]]))
        text = engine.tokenizer.decode(tokens[2 + i:4 + i])
        if text.strip():
            requests[f"str{i}"] = (p, SamplingParams(temperature=0, max_tokens=12, stop=[text.strip()]))
    done = _both(directory, requests)
    assert any(o.outputs[0].finish_reason == "stop" for o in done.values())


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_tight_pools_preemption_and_aborts(model, caching):
    """Pages and slots for a few requests only (preemption, with tokens in flight), aborts of running and
    waiting requests mid-flight, shared prefixes that hit after discarded work, chunked prefill."""
    kind, directory = model
    rng = random.Random(4)
    base = _prompts([14, 20, 9], seed=3)
    prompts = [base[rng.randrange(3)][: rng.randint(4, 14)] + p for p in _prompts(
        [rng.randint(1, 12) for _ in range(14)], seed=5)]
    params = SamplingParams(temperature=0.6, seed=9, max_tokens=10, ignore_eos=True)
    roomy = _engine(directory, False).runner.memory_plan
    options = dict(max_model_len=48, max_state_slots=8, enable_prefix_caching=caching, max_num_batched_tokens=24,
                   kv_cache_memory_bytes=8 * roomy.slot_bytes + 20 * (roomy.page_bytes + roomy.window_page_bytes))
    requests = {f"q{i}": (p, params) for i, p in enumerate(prompts)}
    done = _both(directory, requests, abort_at={3: "q2", 7: "q11", 12: "q5"}, **options)
    assert sum(o is None for o in done.values()) == 3


def test_overlap_hides_host_work_behind_the_step_in_flight(zaya_dir):
    """The overlapped engine launches step N + 1 before it processes step N: while N's tokens are appended, the
    runner has already been handed the next plan, whose decode rows read N's tokens on the device."""
    engine = _engine(zaya_dir, True)
    order = []
    launch, collect = engine.runner.launch, engine.runner.collect
    engine.runner.launch = lambda plan: (order.append(("launch", [c.future_token for c in plan.chunks])),
                                         launch(plan))[1]
    engine.runner.collect = lambda handle: (order.append(("collect", None)), collect(handle))[1]
    _run(engine, {"a": (_prompts([6], seed=7)[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))})
    kinds = [kind for kind, _ in order]
    assert kinds[:4] == ["launch", "launch", "collect", "launch"]  # prefill, decode 1 launched, prefill collected
    assert order[1][1] == [0]  # the first decode row reads draw 0 of the prefill step
