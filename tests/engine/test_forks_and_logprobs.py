"""n > 1 (the prompt computed once, then forked) and prompt logprobs, on both model families."""
from __future__ import annotations

import pytest
import torch

from hybridserve import SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.runtime.build_model import build_model
from tests.helpers import CacheHarness

PROMPT = [5, 17, 3, 99, 42, 8, 61, 7, 23, 11, 2]  # 11 tokens: the fork copies a partly filled page (page 4)


@pytest.fixture(scope="module", params=["zaya", "ling"])
def model_dir(request, zaya_dir, ling_dir):
    return zaya_dir if request.param == "zaya" else ling_dir


def _engine(directory, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", dtype="float32", page_size=4, **options))


def _finish(engine: LLMEngine, request_id: str, prompt, params):
    engine.add_request(request_id, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def _count_computed_tokens(engine: LLMEngine) -> list[int]:
    counter = [0]
    launch = engine.runner.launch

    def counting(plan):
        counter[0] += sum(len(c.token_ids) for c in plan.chunks)
        return launch(plan)

    engine.runner.launch = counting
    return counter


@pytest.mark.parametrize("options", [{}, {"enable_prefix_caching": False}])
def test_n_sequences_fork_from_one_prompt_computation(model_dir, options):
    params = SamplingParams(n=3, temperature=0.9, seed=1234, max_tokens=6, ignore_eos=True)
    engine = _engine(model_dir, **options)
    computed = _count_computed_tokens(engine)
    out = _finish(engine, "n3", PROMPT, params)
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 6 for c in out.outputs)
    assert computed[0] == len(PROMPT) + 3 * (6 - 1)  # the prompt once, then each sequence's own decode steps
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Each sequence equals a single request with seed + i: the forked state and KV are exact copies.
    for i, completion in enumerate(out.outputs):
        single = SamplingParams(temperature=0.9, seed=1234 + i, max_tokens=6, ignore_eos=True)
        assert _finish(_engine(model_dir, **options), f"s{i}", PROMPT, single).outputs[0].token_ids == \
            completion.token_ids
    assert _finish(engine, "again", PROMPT, params).outputs == out.outputs  # reproducible with the seed
    engine.cache_manager.check()


def test_children_that_cannot_run_yet_are_recomputed(model_dir):
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=5, ignore_eos=True)
    roomy = _finish(_engine(model_dir), "a", PROMPT, params)
    tight = _engine(model_dir, max_running_requests=1)
    assert _finish(tight, "b", PROMPT, params).outputs == roomy.outputs
    tight.cache_manager.check()


def test_abort_of_a_forked_request_frees_everything(model_dir):
    engine = _engine(model_dir)
    engine.add_request("x", PROMPT, SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 4
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    counts = engine.cache_manager.counts()
    engine.cache_manager.check()
    assert counts["pages_protected"] == 0 and counts["slots_protected"] == 0


@pytest.mark.parametrize("chunk", [3, None])
def test_prompt_logprobs_equal_a_full_forward(model_dir, chunk):
    engine = _engine(model_dir, chunked_prefill_size=chunk)
    _finish(engine, "warm", PROMPT, SamplingParams(max_tokens=2))  # the prompt is now cached: it must be rescored
    out = _finish(engine, "score", PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=3))
    assert out.num_cached_tokens == 0
    model, _ = build_model(model_dir, torch.float32, torch.device("cpu"))
    harness = CacheHarness(model)
    reference = torch.log_softmax(harness.run([harness.chunk(1, PROMPT, 0)]), dim=-1)
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for pos in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[pos]
        row = reference[pos - 1]
        assert abs(entry[PROMPT[pos]] - row[PROMPT[pos]].item()) <= 1e-5
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(entry) and len(set(entry) - set(top)) <= 1  # top-3 plus the actual token
