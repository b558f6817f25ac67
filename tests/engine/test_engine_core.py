"""Engine core on both model families: prefix caching (on == off, predicted hit lengths), adversarial lengths,
branch points, chunked prefill sizes, arrival order, and tiny pools with preemption, eviction and random aborts."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from hybridserve import SamplingParams
from hybridserve.config import NO_CHUNKING, EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.engine.scheduler import Scheduler

PAGE = 4
INTERVAL = 8  # Ling: a checkpoint every 8 tokens (2 pages), so intervals show up in short tests
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
_IDS = itertools.count()


@pytest.fixture(scope="module", params=["zaya", "ling"])
def model(request, zaya_dir, ling_dir):
    """(kind, checkpoint directory)."""
    return request.param, zaya_dir if request.param == "zaya" else ling_dir


def _engine(directory, **options) -> LLMEngine:
    options = {"device": "cpu", "dtype": "float32", "page_size": PAGE, "state_checkpoint_interval": INTERVAL,
               **options}
    return LLMEngine(EngineConfig(model=str(directory), **options))


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY, check_every_step=False):
    """Submit all prompts, run to completion; {index: RequestOutput}."""
    ids = [f"r{next(_IDS)}" for _ in prompts]
    for request_id, p in zip(ids, prompts):
        engine.add_request(request_id, p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check_every_step:
            engine.cache_manager.check()
    return [done[i] for i in ids]


def _sequential(engine: LLMEngine, prompts, params=GREEDY):
    return [_run(engine, [p], params)[0] for p in prompts]


def _assert_idle(engine: LLMEngine) -> None:
    engine.cache_manager.check()
    counts = engine.cache_manager.counts()
    assert counts["pages_protected"] == 0 and counts["slots_protected"] == 0


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _random_prompts(count, seed, low=1, high=30, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(1, 128) for _ in range(rng.randint(low, high))] for _ in range(count)]


def _rerun_hit(length: int) -> int:
    """Predicted hit for a prompt seen whole before: the last page boundary strictly before its end (both
    policies: every page for ZAYA; the prompt-end checkpoint for Ling)."""
    return (length - 1) // PAGE * PAGE


def test_prefix_cache_on_equals_off_and_rerun_hits_are_predicted(model):
    kind, directory = model
    shared = _random_prompts(1, seed=1, low=13, high=13)[0]
    prompts = _random_prompts(6, seed=2, prefix=shared) + _random_prompts(4, seed=3)
    reference = _tokens(_run(_engine(directory, enable_prefix_caching=False), prompts))
    engine = _engine(directory)
    first = _run(engine, prompts)
    second = _run(engine, prompts)
    assert _tokens(first) == reference and _tokens(second) == reference
    assert [o.num_cached_tokens for o in second] == [_rerun_hit(len(p)) for p in prompts]
    _assert_idle(engine)


def test_adversarial_lengths_hit_as_predicted(model):
    kind, directory = model
    lengths = [1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE, INTERVAL - 1, INTERVAL, INTERVAL + 1, 3 * PAGE + 2]
    prompts = _random_prompts(len(lengths), seed=4)
    prompts = [p[:n] + [7] * (n - len(p)) for p, n in zip(prompts, lengths)]
    reference = _tokens(_sequential(_engine(directory, enable_prefix_caching=False), prompts))
    engine = _engine(directory)
    assert _tokens(_sequential(engine, prompts)) == reference
    again = _sequential(engine, prompts)
    assert _tokens(again) == reference
    assert [o.num_cached_tokens for o in again] == [_rerun_hit(n) for n in lengths]
    _assert_idle(engine)


def test_branch_point_snapshot(model):
    """One shared prefix, three suffixes: the second request finds KV but (Ling) no checkpoint at the divergence;
    it snapshots there, so the third request hits at the branch point."""
    kind, directory = model
    prefix = _random_prompts(1, seed=5, low=10, high=10)[0]  # 10 tokens: the divergence rounds down to 8
    prompts = [prefix + s for s in _random_prompts(3, seed=6, low=5, high=5)]
    reference = _tokens(_sequential(_engine(directory, enable_prefix_caching=False), prompts))
    engine = _engine(directory, state_checkpoint_interval=64)  # no interval checkpoint below the branch point
    outputs = _sequential(engine, prompts)
    assert _tokens(outputs) == reference
    expected = [0, 8, 8] if kind == "zaya" else [0, 0, 8]
    assert [o.num_cached_tokens for o in outputs] == expected
    _assert_idle(engine)


def _final_states(engine: LLMEngine, monkeypatch) -> dict[str, list[torch.Tensor]]:
    """Record each request's working state as it finishes (before its slot is freed)."""
    states: dict[str, list[torch.Tensor]] = {}
    original = Scheduler.finish

    def finish(self, request, reason):
        slot = request.state_slot
        states[request.prompt_token_ids.__repr__()] = [buf[:, slot].clone()
                                                      for buf in engine.runner.state_pool.buffers.values()]
        original(self, request, reason)

    monkeypatch.setattr(Scheduler, "finish", finish)
    return states


@pytest.mark.parametrize("chunk", [PAGE, 3 * PAGE, 1000, NO_CHUNKING])
def test_chunked_prefill_sizes_give_identical_outputs_and_states(model, chunk, monkeypatch):
    kind, directory = model
    prompts = _random_prompts(5, seed=7, low=9, high=33)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # the state right after the prompt
    baseline = _engine(directory, enable_prefix_caching=False)
    want_states = _final_states(baseline, monkeypatch)
    want = _tokens(_run(baseline, prompts, params))
    monkeypatch.undo()
    # No chunking on a budget of 40 tokens: prompts wait for a step with room for all of their 9..33 tokens
    budget = {"max_num_batched_tokens": 40} if chunk == NO_CHUNKING else {}
    engine = _engine(directory, enable_prefix_caching=False, chunked_prefill_size=chunk, **budget)
    got_states = _final_states(engine, monkeypatch)
    assert _tokens(_run(engine, prompts, params)) == want
    assert got_states.keys() == want_states.keys()
    for key in want_states:
        for got, expected in zip(got_states[key], want_states[key]):
            # fp32 sums in a different chunking order: equal to rounding (Ling states reach ~10 in magnitude)
            assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() <= 1e-6


def test_alone_together_and_shuffled_arrival_are_identical(model):
    kind, directory = model
    prompts = _random_prompts(16, seed=8)
    engine = _engine(directory, enable_prefix_caching=False)
    alone = _tokens(_sequential(engine, prompts))
    assert _tokens(_run(_engine(directory), prompts)) == alone
    order = list(range(16))
    random.Random(9).shuffle(order)
    shuffled = _tokens(_run(_engine(directory, max_num_batched_tokens=24), [prompts[i] for i in order]))
    assert [shuffled[order.index(i)] for i in range(16)] == alone


def test_tiny_pools_with_preemption_eviction_and_random_aborts(model):
    kind, directory = model
    rng = random.Random(10)
    prompts = _random_prompts(200, seed=11, low=1, high=24, prefix=())
    prompts = [p if rng.random() < 0.6 else prompts[rng.randrange(i + 1)][: rng.randint(1, 30)] + p[:6]
               for i, p in enumerate(prompts)]  # some shared prefixes so the cache has something to hit
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = {tuple(p): t for p, t in zip(map(tuple, prompts),
                                              _tokens(_run(_engine(directory, enable_prefix_caching=False), prompts,
                                                           params)))}
    roomy = _engine(directory)
    plan = roomy.runner.memory_plan
    engine = _engine(directory, max_model_len=64, max_state_slots=12,
                     kv_cache_memory_bytes=12 * plan.slot_bytes + 24 * (plan.page_bytes + plan.window_page_bytes))
    assert engine.runner.memory_plan.num_pages == 24
    ids = []
    for i, p in enumerate(prompts):
        ids.append(f"q{i}")
        engine.add_request(ids[-1], p, params)
    finished, aborted = {}, set()
    while engine.has_unfinished_requests():
        if rng.random() < 0.1:
            live = [i for i in ids if i not in finished and i not in aborted]
            victim = rng.choice(live)
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        engine.cache_manager.check()
    assert set(finished) | aborted == set(ids) and not set(finished) & aborted
    assert len(aborted) > 5
    for i, p in enumerate(prompts):
        if f"q{i}" in finished:
            assert finished[f"q{i}"] == reference[tuple(p)], i
    assert engine.scheduler.num_preemptions > 0
    _assert_idle(engine)
