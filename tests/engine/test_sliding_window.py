"""Sliding-window layers in their own KV group: window pages freed as they fall out of the window, generations much
longer than the window equal HF transformers (the oracle: HF masks sliding layers by window over the whole
sequence), prefix caching exact with and without the window pages cached, and both groups freed on abort, finish
and preemption (resources recounted after every step)."""
from __future__ import annotations

import math

import pytest
import torch

from hybridserve import SamplingParams
from hybridserve.cache.kv_pool import window_first_page
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine
from tests.helpers import add_tokenizer
from tests.models.zaya_fixtures import random_hf_zaya, save_hf, tiny_config

PAGE = 4
WINDOW = 9
LOGPROB_TOL = 1e-4  # fp32 CPU vs HF fp32: the parity tests see logits within 2e-5
SERIAL = {"disable_overlap_schedule": True}


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """(HF oracle, checkpoint dir) of a tiny ZAYA1 whose layers alternate full and sliding (W = 9)."""
    config = tiny_config("base", num_hidden_layers=4, sliding_window=WINDOW,
                         layer_types=["hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"])
    hf = random_hf_zaya(config, seed=31)
    directory = save_hf(hf, tmp_path_factory.mktemp("zaya-sliding"))
    add_tokenizer(directory)
    return hf, directory


def _engine(directory, **options) -> LLMEngine:
    options = {"device": "cpu", "dtype": "float32", "page_size": PAGE, "hf_overrides": {"mod_skip_mode": "zero"},
               **options}
    return LLMEngine(EngineConfig(model=str(directory), **options))


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, each_step=None) -> list:
    ids = [f"s{engine.num_prompt_tokens}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.cache_manager.check()
        if each_step is not None:
            each_step(engine)
    return [done[i] for i in ids]


def _window_bound(engine: LLMEngine) -> None:
    """Between steps a running request holds window pages only from its window's first page on: at most
    ceil((W - 1) / page) + 1 of them, while its full pages cover everything it computed. Checked on engines that
    process each step before scheduling the next (`SERIAL`): with overlapped scheduling a step in flight holds its
    pages until it is processed (tests/engine/test_overlap_schedule.py runs this model overlapped)."""
    for request in engine.scheduler.running:
        held = [p for p in request.window_page_ids if p]
        computed = request.num_computed_tokens
        assert len(held) <= math.ceil((WINDOW - 1) / PAGE) + 1, (computed, request.window_page_ids)
        assert request.window_start == window_first_page(computed, WINDOW, PAGE)
        assert len(request.page_ids) == -(-computed // PAGE) and all(request.page_ids)


def _assert_idle(engine: LLMEngine) -> None:
    engine.cache_manager.check()
    counts = engine.cache_manager.counts()
    assert counts["pages_protected"] == 0 and counts["slots_protected"] == 0
    cached = counts["window_pages_cached"]
    assert counts["window_pages_free"] + cached == counts["window_pages_total"]


@torch.no_grad()
def _hf_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF's log-probabilities of each generated token (one forward over prompt + output)."""
    ids = torch.tensor([prompt + output])
    logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(output)[:, None])[:, 0]


def _assert_matches_hf(hf, prompts: list[list[int]], outputs: list) -> None:
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        want = _hf_logprobs(hf, prompt, tokens)
        got = torch.tensor([entry[t] for entry, t in zip(out.outputs[0].logprobs, tokens)])
        torch.testing.assert_close(got, want, atol=LOGPROB_TOL, rtol=0)


def test_one_group_without_sliding_layers(ling_dir, tmp_path):
    """Ling and a ZAYA1 without sliding layers (ZAYA1-8B-like): the full group only, nothing else planned."""
    zaya = save_hf(random_hf_zaya(tiny_config("gqa4"), seed=3), tmp_path / "zaya-full")
    add_tokenizer(zaya)
    for directory in (ling_dir, zaya):
        engine = _engine(directory)
        plan = engine.runner.memory_plan
        assert engine.runner.window_pool is None and engine.runner.tables.window is None
        assert plan.num_window_pages == 0 and plan.window_page_bytes == 0
        assert plan.kv_bytes == plan.num_pages * plan.page_bytes
        assert engine.cache_manager.window_pages is None and "window" not in engine.cache_manager.counts()


@pytest.mark.parametrize("max_num_batched_tokens", [5, 16, 8192], ids=["chunk<W", "chunk>W", "one-shot"])
def test_long_generations_free_window_pages_and_match_hf(sliding, max_num_batched_tokens):
    """Four requests of 3..30 prompt tokens, 40 generated tokens each (>> W): greedy tokens and their logprobs
    equal HF's, window pages stay bounded after every step, and the window group is smaller than the full one."""
    hf, directory = sliding
    engine = _engine(directory, max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False, **SERIAL)
    plan = engine.runner.memory_plan
    assert engine.runner.window_pool is not None and 0 < plan.num_window_pages < plan.num_pages
    prompts = _prompts([3, 30, 11, 17], seed=4)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=1, ignore_eos=True)
    outputs = _run(engine, prompts, params, each_step=_window_bound)
    _assert_matches_hf(hf, prompts, outputs)
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                          eos_token_id=None)[0, len(prompt):]
        assert out.outputs[0].token_ids == ref.tolist()
    _assert_idle(engine)
    counts = engine.cache_manager.counts()
    assert counts["window_pages_free"] == counts["window_pages_total"]  # no prefix cache: everything returned


def test_prefix_hits_need_the_window_pages_and_stay_exact(sliding):
    """A second request sharing a 30-token prefix hits at the page-aligned maximum (28) and equals the cold run;
    once the cached window pages are evicted the hit is none (every usable point needs window pages) and the
    result is still the cold run's."""
    hf, directory = sliding
    shared = _prompts([30], seed=8)[0]
    first, second = shared + [5, 6], shared + [7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    cold = _run(_engine(directory, enable_prefix_caching=False), [second], params)[0]
    engine = _engine(directory, **SERIAL)
    _run(engine, [first], params)
    hit = _run(engine, [second], params, each_step=_window_bound)[0]
    assert hit.num_cached_tokens == 28
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    _assert_matches_hf(hf, [second], [hit])
    cache = engine.cache_manager.prefix_cache
    assert cache.num_window_pages > 0
    freed = cache.evict_window_pages(cache.num_window_pages)
    assert freed > 0 and cache.num_window_pages == 0 and cache.num_pages > 0  # the full pages stay cached
    engine.cache_manager.check()
    again = _run(engine, [second], params)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    _assert_matches_hf(hf, [second], [again])
    _assert_idle(engine)


def test_a_tiny_window_group_evicts_cached_window_pages_first(sliding):
    """With only the window pages the running requests need, cached window pages are evicted apart from the
    full pages as requests run; every result still equals the cache-off run."""
    _, directory = sliding
    prompts = _prompts([26, 26, 26], seed=9)
    prompts = [prompts[0], prompts[0][:20] + prompts[1][:6], prompts[0][:24] + prompts[2][:2]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    cold = [o.outputs[0].token_ids for o in _run(_engine(directory, enable_prefix_caching=False), prompts, params)]
    engine = _engine(directory, max_running_requests=1, max_num_batched_tokens=8, **SERIAL)
    plan = engine.runner.memory_plan
    assert plan.num_window_pages == plan.min_window_pages == 1 * (math.ceil((WINDOW - 1) / PAGE) + 1) + 2 + 1
    evicted = []
    evict = engine.cache_manager.prefix_cache.evict_window_pages
    engine.cache_manager.prefix_cache.evict_window_pages = lambda n: evicted.append(evict(n)) or evicted[-1]
    got = [_run(engine, [p], params, each_step=_window_bound)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == cold
    assert sum(evicted) > 0
    _assert_idle(engine)


def test_abort_finish_preemption_and_forks_free_both_groups(sliding):
    """Tight pools in both groups (preemption), n = 2 forks (window pages shared and the partly filled page copied)
    and an abort mid-run: results equal solo runs and both groups are whole after every step and at idle."""
    _, directory = sliding
    prompts = _prompts([13, 7, 22, 9, 18, 5], seed=12)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    solo = _engine(directory, enable_prefix_caching=False)
    alone = [_run(solo, [p], params)[0].outputs[0].token_ids for p in prompts]
    roomy = _engine(directory).runner.memory_plan
    engine = _engine(directory, max_model_len=48, max_state_slots=6,
                     kv_cache_memory_bytes=6 * roomy.slot_bytes + 24 * (roomy.page_bytes + roomy.window_page_bytes),
                     **SERIAL)
    assert engine.runner.memory_plan.num_pages == 24
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    engine.add_request("fork", prompts[0], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=20,
                                                          ignore_eos=True))
    done, step = {}, 0
    while engine.has_unfinished_requests():
        if step == 4:
            engine.abort_request("p3")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.cache_manager.check()
        _window_bound(engine)
        step += 1
    assert engine.scheduler.num_preemptions > 0
    for i, tokens in enumerate(alone):
        if i != 3:
            assert done[f"p{i}"].outputs[0].token_ids == tokens
    assert "p3" not in done and len(done["fork"].outputs) == 2
    _assert_idle(engine)
