"""The engine loop end to end on a tiny ZAYA1 checkpoint: batching, chunking, preemption, stops, aborts."""
from __future__ import annotations

import random

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(count: int, seed: int = 0, low: int = 1, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 128) for _ in range(rng.randint(low, high))] for _ in range(count)]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm(zaya_dir):
    return LLM(str(zaya_dir), device="cpu", dtype="float32", page_size=4)


@pytest.fixture(scope="module")
def alone(llm):
    """Greedy outputs of each prompt run by itself: the reference for every batching scenario."""
    return [_tokens(llm.generate([{"prompt_token_ids": p}], GREEDY))[0] for p in _prompts(10)]


def _assert_idle(engine: LLMEngine) -> None:
    """At idle every page and slot is free or evictable cache: nothing leaked, nothing still protected."""
    engine.cache_manager.check()
    counts = engine.cache_manager.counts()
    assert counts["pages_protected"] == 0 and counts["slots_protected"] == 0


def test_batched_and_chunked_runs_equal_single_runs(zaya_dir, alone):
    prompts = _prompts(10)
    for options in ({}, {"max_num_batched_tokens": 7}, {"max_running_requests": 3}):
        llm = LLM(str(zaya_dir), device="cpu", dtype="float32", page_size=4, **options)
        assert _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)) == alone, options
        _assert_idle(llm.engine)


def tiny_pool_options(llm: LLM, pages: int, slots: int) -> dict:
    """Engine options whose cache budget holds exactly `pages` KV pages (and as many window-group pages, when
    that is fewer than the running requests may need) and `slots` state slots."""
    plan = llm.engine.runner.memory_plan
    page_bytes = plan.page_bytes + plan.window_page_bytes
    return dict(kv_cache_memory_bytes=slots * plan.slot_bytes + pages * page_bytes, max_state_slots=slots)


def test_preemption_under_a_tiny_kv_pool_recomputes_exactly(zaya_dir, llm, alone):
    prompts = _prompts(10)
    llm = LLM(str(zaya_dir), device="cpu", dtype="float32", page_size=4, max_model_len=80,
              **tiny_pool_options(llm, pages=30, slots=6))
    assert llm.engine.runner.memory_plan.num_pages == 30
    assert _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)) == alone
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_idle(llm.engine)


def test_abort_frees_resources_and_others_finish(zaya_dir, alone):
    engine = LLMEngine(EngineConfig(model=str(zaya_dir), device="cpu", dtype="float32", page_size=4))
    prompts = _prompts(10)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    finished = {}
    for step in range(200):
        if step == 3:
            engine.abort_request("4")
            engine.abort_request("7")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert sorted(finished, key=int) == [str(i) for i in range(10) if i not in (4, 7)]
    assert all(finished[str(i)] == alone[i] for i in range(10) if i not in (4, 7))
    _assert_idle(engine)


def test_stop_strings_stop_tokens_and_max_tokens(llm):
    prompt = {"prompt_token_ids": _prompts(1, seed=3, low=8)[0]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    by_id = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))[0].outputs[0]
    assert by_id.token_ids == free.token_ids[: first + 1]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", stop_id)
    stop_text = free.text[len(free.text) // 2: len(free.text) // 2 + 3]
    cut = free.text.index(stop_text)
    by_text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop_text]))[0].outputs[0]
    assert (by_text.text, by_text.finish_reason, by_text.stop_reason) == (free.text[:cut], "stop", stop_text)
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop_text],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free.text[: cut + len(stop_text)]


def test_eos_stops_unless_ignored(zaya_dir):
    prompt = {"prompt_token_ids": _prompts(1, seed=4, low=6)[0]}
    probe = LLM(str(zaya_dir), device="cpu", dtype="float32")
    free = probe.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    eos = free.token_ids[2]
    llm = LLM(str(zaya_dir), device="cpu", dtype="float32", hf_overrides={"eos_token_id": eos})
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    ignored = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == free.token_ids
    delayed = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=8))[0].outputs[0]
    assert len(delayed.token_ids) >= 8 and eos not in delayed.token_ids[:8]


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm):
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, seed=5)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(4)]
    together = _tokens(llm.generate(prompts, params))
    alone = [_tokens(llm.generate(p, s))[0] for p, s in zip(prompts, params)]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1


def test_text_prompts_and_chat():
    llm = LLM(device="cpu")  # the built-in demo: a real tokenizer and a vocabulary to match
    out = llm.generate("Hello there", SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("Hello there")
    assert len(out.outputs[0].token_ids) == 4 and isinstance(out.outputs[0].text, str)
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, temperature=0))[0]
    assert llm.get_tokenizer().decode(chat.prompt_token_ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [5, 128]}, r"Token id 128 is out of vocabulary: token ids must be in \[0, 128\)"),
    ({"prompt_token_ids": [1] * 2000}, "context length"),
])
def test_bad_prompts_raise_clear_errors(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, GREEDY)
    assert not llm.engine.has_unfinished_requests()
