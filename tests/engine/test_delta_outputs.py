"""Delta outputs: each engine step hands a request only what is new (tokens, logprobs, text), so building the
outputs of a generation costs O(its length); folding the deltas gives exactly the cumulative and final outputs."""
from __future__ import annotations

from dataclasses import replace

import pytest

from hybridserve import SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.outputs import RequestOutput, RequestOutputKind
from hybridserve.tokenizer import IncrementalDetokenizer

PROMPT = [5, 17, 3, 99, 42, 7, 61]
TOKENS = 96


@pytest.fixture(scope="module")
def engine(zaya_dir):
    return LLMEngine(EngineConfig(model=str(zaya_dir), device="cpu", dtype="float32", page_size=4, use_tqdm=False))


def _run(engine: LLMEngine, request_id: str, params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(request_id, PROMPT, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [output for output in engine.step() if output.request_id == request_id]
    return outputs


def _reference_text(engine: LLMEngine, token_ids: list[int], stop: str | None) -> str:
    """The text token by token (decoded whole, no hold-back), cut before the first stop string."""
    detokenizer = IncrementalDetokenizer(engine.tokenizer, PROMPT, skip_special_tokens=True)
    text = "".join(detokenizer.add(t) for t in token_ids)
    return text[: text.index(stop)] if stop and stop in text else text


def _fold(deltas: list[RequestOutput]) -> RequestOutput:
    total = deltas[0].copy()
    for delta in deltas[1:]:
        total.add(delta)
    return total


def _check_deltas(deltas: list[RequestOutput], final: RequestOutput) -> None:
    """Every delta carries at most one new token per sequence (one step), and the deltas' sizes add up to the
    final output's: the output-building work is linear in the generated tokens."""
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert all(len(c.token_ids) <= 1 for d in deltas for c in d.outputs)
    assert deltas[0].prompt_logprobs == final.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    for completion in final.outputs:
        mine = [c for d in deltas for c in d.outputs if c.index == completion.index]
        assert sum(len(c.token_ids) for c in mine) == len(completion.token_ids)
        assert sum(len(c.text) for c in mine) == len(completion.text)
        if completion.logprobs is not None:
            assert sum(len(c.logprobs) for c in mine) == len(completion.logprobs) == len(completion.token_ids)
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + [completion.finish_reason]


@pytest.mark.parametrize("stop", [False, True], ids=["no stop", "stop string"])
def test_deltas_are_linear_and_fold_to_the_cumulative_and_final_outputs(engine, stop):
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=TOKENS, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    free = _run(engine, "free", replace(params, n=1, output_kind=RequestOutputKind.FINAL_ONLY))[0].outputs[0]
    stop_text = free.text[len(free.text) * 2 // 3:][:4] if stop else None
    if stop:
        params = replace(params, stop=[stop_text])
    deltas = _run(engine, "delta", replace(params, output_kind=RequestOutputKind.DELTA))
    cumulative = _run(engine, "cumulative", params)
    (final,) = _run(engine, "final", replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(deltas) == len(cumulative) > TOKENS // 2
    folded = _fold(deltas)
    assert replace(folded, request_id="final") == final
    assert replace(cumulative[-1], request_id="final") == final
    for step, (delta, whole) in enumerate(zip(deltas, cumulative)):  # every cumulative output = the deltas so far
        assert replace(_fold(deltas[: step + 1]), request_id=whole.request_id) == whole
    _check_deltas(deltas, final)
    assert [c.index for c in final.outputs] == [0, 1]
    assert final.outputs[0].token_ids[: len(free.token_ids)] == free.token_ids[: len(final.outputs[0].token_ids)]
    for completion in final.outputs:
        assert completion.text == _reference_text(engine, completion.token_ids, stop_text)
        if stop and completion.finish_reason == "stop":
            assert completion.stop_reason == stop_text
    if stop:
        assert final.outputs[0].finish_reason == "stop"
        for delta in deltas:  # released text never ends in a partial stop string
            for c in delta.outputs:
                assert stop_text not in c.text
    engine.cache_manager.check()


def test_folding_is_linear_in_the_number_of_deltas():
    """A million characters in 4-character deltas: folding copies each once (appending to a string attribute
    would copy the whole text every time, ~10^11 bytes)."""
    from time import perf_counter

    from hybridserve.outputs import CompletionOutput

    total = RequestOutput("r", None, [1], [CompletionOutput(0, "", [])])
    start = perf_counter()
    for i in range(250_000):
        total.add(RequestOutput("r", None, [1], [CompletionOutput(0, "abcd", [i])]))
    elapsed = perf_counter() - start
    assert total.outputs[0].text == "abcd" * 250_000 and total.outputs[0].token_ids == list(range(250_000))
    assert elapsed < 10, elapsed
