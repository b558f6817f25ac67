"""One request's failure stays with it; one request's size stays bounded.

- A failure injected into one request's sampling aborts that request alone (with an error on its output); the
  others in the same steps finish exactly as they would alone, and every page and slot comes back.
- Forks of an n > 1 request draw their first tokens under max_running_requests and the token budget; the rest wait
  and draw after a (prefix-cached) recompute, with the same tokens.
- Prompt-logprob scoring is bounded per step across all requests, with the same logprobs.
"""
from __future__ import annotations

import pytest

from hybridserve import SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.layers.sampler import Sampler

PROMPT = [5, 17, 3, 99, 42, 8, 61, 7, 23, 11, 2]
BAD_SEED = 666


@pytest.fixture(scope="module", params=["zaya", "ling"])
def model_dir(request, zaya_dir, ling_dir):
    return zaya_dir if request.param == "zaya" else ling_dir


def _engine(directory, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", dtype="float32", page_size=4, use_tqdm=False,
                                  kv_cache_memory_bytes=16 << 20, **options))


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], on_step=None) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        if on_step is not None:
            on_step(engine)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def _assert_idle(engine: LLMEngine) -> None:
    engine.cache_manager.check()
    counts = engine.cache_manager.counts()
    assert not engine.has_unfinished_requests() and counts["pages_protected"] == counts["slots_protected"] == 0


@pytest.mark.parametrize("fail_at", [0, 3], ids=["first draw", "fourth draw"])
def test_a_sampling_failure_aborts_only_its_request(model_dir, monkeypatch, fail_at):
    draw_rows = Sampler._draw_rows

    def failing(self, logits, rows, mask):
        if any(row.seed == BAD_SEED and row.index == fail_at for row in rows):
            raise RuntimeError("injected sampling failure")
        return draw_rows(self, logits, rows, mask)

    monkeypatch.setattr(Sampler, "_draw_rows", failing)
    params = {seed: SamplingParams(temperature=0.8, seed=seed, max_tokens=8, ignore_eos=True)
              for seed in (1, 2, BAD_SEED)}
    requests = {"good-1": (PROMPT, params[1]), "bad": (PROMPT[:7], SamplingParams(
        n=2, temperature=0.8, seed=BAD_SEED, max_tokens=8, ignore_eos=True)), "good-2": (PROMPT[3:], params[2])}
    engine = _engine(model_dir)
    outputs = _run(engine, requests)
    bad = outputs["bad"]
    assert bad.finished and "injected sampling failure" in bad.error
    assert all(c.finish_reason == "abort" and len(c.token_ids) == fail_at for c in bad.outputs)
    solo = _engine(model_dir)
    for request_id in ("good-1", "good-2"):  # one after the other: each runs alone
        alone = _run(solo, {request_id: requests[request_id]})[request_id]
        assert outputs[request_id].error is None and outputs[request_id].outputs == alone.outputs
        assert len(alone.outputs[0].token_ids) == 8
    _assert_idle(engine)
    again = _run(engine, {"after": (PROMPT, params[1])})["after"]  # the engine keeps serving
    assert again.outputs[0].token_ids == outputs["good-1"].outputs[0].token_ids


def _record(engine: LLMEngine, record) -> None:
    launch = engine.runner.launch

    def recording(plan):
        record(engine, plan)
        return launch(plan)

    engine.runner.launch = recording


def test_forks_draw_under_the_running_cap_and_the_token_budget(model_dir):
    params = SamplingParams(n=6, temperature=0.9, seed=5, max_tokens=4, ignore_eos=True)
    roomy = _run(_engine(model_dir), {"r": (PROMPT, params)})["r"]
    for option, limit in (("max_running_requests", 3), ("max_num_batched_tokens", 5)):
        engine = _engine(model_dir, **{option: limit})
        steps = []  # (tokens computed, fork draws, running requests) per step

        def record(e: LLMEngine, plan) -> None:
            forks = sum(len(rows) - 1 for rows in plan.samples if rows)
            steps.append((sum(len(c.token_ids) for c in plan.chunks), forks, len(e.scheduler.running)))

        _record(engine, record)
        tight = _run(engine, {"r": (PROMPT, params)})["r"]
        assert tight.outputs == roomy.outputs, option  # each fork still equals a request with seed + i
        assert 0 < max(forks for _, forks, _ in steps) < 5, option  # some forks drew at once, the others later
        if option == "max_running_requests":
            assert all(running + forks <= limit for _, forks, running in steps)
        else:
            assert all(tokens + forks <= limit for tokens, forks, _ in steps)
        _assert_idle(engine)


def test_prompt_scoring_is_bounded_per_step_across_requests(model_dir):
    params = SamplingParams(prompt_logprobs=2, max_tokens=2, temperature=0)
    requests = {f"p{i}": (PROMPT[i:] + PROMPT[:i], params) for i in range(3)}
    roomy = _run(_engine(model_dir), requests)
    engine = _engine(model_dir)
    engine.scheduler.scoring_per_step = 8
    scored = []
    _record(engine, lambda e, plan: scored.append(sum(len(t.token_ids) for t in plan.prompt_logprobs if t)))
    bounded = _run(engine, requests)
    assert max(scored) <= 8 and sum(scored) == 3 * (len(PROMPT) - 1)
    for request_id, output in bounded.items():
        reference = roomy[request_id]
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids
        assert len(output.prompt_logprobs) == len(PROMPT)
        for mine, theirs in zip(output.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
    _assert_idle(engine)
