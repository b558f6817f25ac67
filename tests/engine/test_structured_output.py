"""Structured output in the engine, on the demo checkpoint (random weights, the real 151k vocabulary): outputs
match their grammars and end when the grammar does; masks reach exactly the draws of requests with a grammar (and
requests without one never wait for a mask); other requests' tokens are what they would be without grammar
neighbours; overlapped scheduling, preemption and forks keep every grammar in step with its tokens; a failing
grammar fails its request alone; an uncompilable spec is refused before anything is queued."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

from hybridserve.config import EngineConfig
from hybridserve.demo import ensure_demo_checkpoint
from hybridserve.engine.engine import LLMEngine
from hybridserve.layers.sampler import Sampler
from hybridserve.outputs import RequestOutput
from hybridserve.runtime.model_runner import ModelRunner
from hybridserve.sampling import SamplingParams
from hybridserve.structured import StructuredOutputError, StructuredOutputParams
from hybridserve.structured.matcher import GrammarState

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tag": {"enum": ["red", "green", "blue"]},
    "ok": {"type": "boolean"},
    "name": {"type": "string", "maxLength": 6},
    "xs": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 3},
}, "required": ["id", "tag", "ok", "xs"], "additionalProperties": False}
REGEX = r"[A-Z]{2}-\d{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [a-z] | [0-9]'


@pytest.fixture(scope="module")
def demo_dir():
    return ensure_demo_checkpoint()


@pytest.fixture(scope="module")
def mixed_outputs(demo_dir):
    """_mixed() on the default engine (overlapped)."""
    return _run(_engine(demo_dir), _mixed())


def _free() -> dict[str, tuple[str, SamplingParams]]:
    return {k: v for k, v in _mixed().items() if v[1].structured_output is None}


def _engine(directory, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", dtype="float32", use_tqdm=False,
                                  **{"kv_cache_memory_bytes": 32 << 20, **options}))


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, RequestOutput]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    engine.cache_manager.check()
    return done


def _spec(**fields) -> StructuredOutputParams:
    return StructuredOutputParams(**fields)


def _mixed() -> dict[str, tuple[str, SamplingParams]]:
    """Grammar requests of every kind (sampled, greedy, n = 3) beside free ones."""
    def grammar(seed: int, temperature: float = 1.0, **fields) -> SamplingParams:
        return SamplingParams(seed=seed, temperature=temperature, max_tokens=80, structured_output=_spec(**fields))

    return {
        "json": ("Describe a widget as JSON.", grammar(1, json=SCHEMA)),
        "json-n3": ("Another widget:", SamplingParams(n=3, seed=2, max_tokens=80, structured_output=_spec(
            json=SCHEMA))),
        "free-1": ("Once upon a time", SamplingParams(seed=3, max_tokens=24, logprobs=2)),
        "regex": ("A plate number:", grammar(4, temperature=0, regex=REGEX)),
        "choice": ("Pick one:", grammar(5, choice=CHOICES)),
        "free-2": ("The weather today", SamplingParams(temperature=0, max_tokens=30, stop=["e"])),
        "grammar": ("A tuple:", grammar(6, grammar=GRAMMAR)),
        "object": ("Any object:", SamplingParams(seed=7, max_tokens=30, structured_output=_spec(json_object=True))),
    }


def _check_grammars(outputs: dict[str, RequestOutput]) -> None:
    for request_id in ("json", "json-n3"):
        assert len(outputs[request_id].outputs) == (3 if request_id == "json-n3" else 1)
        for completion in outputs[request_id].outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert re.fullmatch(REGEX, outputs["regex"].outputs[0].text)
    assert outputs["choice"].outputs[0].text in CHOICES
    assert re.fullmatch(r"\([a-z0-9](,[a-z0-9]){0,2}\)", outputs["grammar"].outputs[0].text)
    obj = outputs["object"].outputs[0]
    if obj.finish_reason == "stop":  # any object may outgrow the budget; a finished one must parse
        assert isinstance(json.loads(obj.text), dict)


def test_outputs_match_their_grammars_and_end_with_them(mixed_outputs):
    outputs = mixed_outputs
    _check_grammars(outputs)
    for request_id in ("json", "regex", "choice", "grammar"):
        assert outputs[request_id].outputs[0].token_ids[-1] in (151643, 151645)  # the grammar ended: only EOS


def test_a_grammar_that_terminates_finishes_its_request_even_when_eos_is_ignored(demo_dir):
    params = SamplingParams(seed=9, max_tokens=40, ignore_eos=True, structured_output=_spec(choice=CHOICES))
    (output,) = _run(_engine(demo_dir), {"c": ("Pick:", params)}).values()
    completion = output.outputs[0]
    assert completion.finish_reason == "stop" and completion.text in CHOICES
    short = SamplingParams(max_tokens=2, structured_output=_spec(regex=r"\d{10}"))
    (output,) = _run(_engine(demo_dir), {"d": ("Digits:", short)}).values()
    assert output.outputs[0].finish_reason == "length" and re.fullmatch(r"\d+", output.outputs[0].text)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_masks_reach_exactly_the_draws_with_a_grammar(demo_dir, monkeypatch, overlap):
    """Serial steps mask every grammar draw; overlapped ones may also hold the draw of a request that the step
    before finished (discarded, so left unconstrained): there the masked draws are a subset."""
    calls, masked_launches = [], []
    draw, draw_masked = Sampler.draw, ModelRunner.draw_masked

    def spy_draw(self, logits, rows, mask=None):
        calls.append(([row.params.structured_output is not None for row in rows], mask))
        return draw(self, logits, rows, mask)

    def spy_draw_masked(self, mask):
        masked_launches.append(mask)
        return draw_masked(self, mask)

    monkeypatch.setattr(Sampler, "draw", spy_draw)
    monkeypatch.setattr(ModelRunner, "draw_masked", spy_draw_masked)
    _run(_engine(demo_dir, disable_overlap_schedule=not overlap), _mixed())
    assert masked_launches and any(not all(flags) and any(flags) for flags, _ in calls)  # mixed batches ran
    for flags, mask in calls:
        grammar_rows = [i for i, has in enumerate(flags) if has]
        masked = mask.rows if mask is not None else []
        assert masked == grammar_rows if not overlap else set(masked) <= set(grammar_rows)
        if mask is not None:
            assert mask.bits.shape[0] == len(masked)
    assert sum(len(mask.rows) for _, mask in calls if mask is not None) >= 0.9 * sum(map(sum, (f for f, _ in calls)))
    calls.clear(), masked_launches.clear()
    _run(_engine(demo_dir, disable_overlap_schedule=not overlap), _free())
    assert calls and all(mask is None for _, mask in calls) and not masked_launches  # no grammar: no mask work


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_requests_without_a_grammar_draw_what_they_draw_alone(demo_dir, mixed_outputs, overlap):
    """The same tokens beside grammar requests as without them (logprobs to fp32 rounding: batches differ)."""
    options = {"disable_overlap_schedule": not overlap}
    alone = _run(_engine(demo_dir, **options), _free())
    together = mixed_outputs if overlap else _run(_engine(demo_dir, **options), _mixed())
    for request_id in alone:
        want, have = alone[request_id].outputs[0], together[request_id].outputs[0]
        assert have.token_ids == want.token_ids and have.text == want.text
        assert (have.logprobs is None) == (want.logprobs is None)
        for a, b in zip(have.logprobs or [], want.logprobs or []):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)


def test_overlapped_and_serial_scheduling_agree_with_preemption(demo_dir):
    """A pool of a few pages: requests are preempted and recomputed while their grammars keep their place."""
    options = {"kv_cache_memory_bytes": 900_000, "page_size": 4, "max_model_len": 120}  # 128 KV tokens
    runs = [_run(engine := _engine(demo_dir, disable_overlap_schedule=not overlap, **options), _mixed())
            for overlap in (True, False)]
    assert engine.scheduler.num_preemptions > 0
    for request_id, output in runs[0].items():
        other = runs[1][request_id]
        assert [c.token_ids for c in output.outputs] == [c.token_ids for c in other.outputs], request_id
    _check_grammars(runs[0])


def test_an_uncompilable_spec_is_refused_before_anything_is_queued(demo_dir):
    engine = _engine(demo_dir)
    for fields in ({"regex": "(unclosed"}, {"json": {"type": "nope"}}, {"regex": r"[^\s\S]"}):
        with pytest.raises(StructuredOutputError, match=f"invalid structured output {next(iter(fields))}="):
            engine.add_request("bad", "x", SamplingParams(structured_output=_spec(**fields)))
        assert not engine.has_unfinished_requests() and "bad" not in engine.output_processor.groups
    _run(engine, {"bad": ("x", SamplingParams(max_tokens=2))})  # the id was never taken


@pytest.mark.parametrize("failure", ["dead_end", "exception"])
def test_a_grammar_failure_fails_its_request_alone(demo_dir, mixed_outputs, monkeypatch, failure):
    """From its third mask on, the regex request's grammar breaks: its row comes back empty from the batch fill (a
    dead end), or the batch fill raises (then rows are filled one by one, and only that state raises)."""
    import xgrammar

    baseline = mixed_outputs
    engine = _engine(demo_dir)
    regex = engine.grammars.compile(_mixed()["regex"][1].structured_output)
    init, fill = GrammarState.__init__, GrammarState.fill
    batch_fill = xgrammar.BatchGrammarMatcher.batch_fill_next_token_bitmask
    doomed: list[GrammarState] = []
    broken: list[GrammarState] = []

    def tracking_init(self, compiled):
        init(self, compiled)
        if compiled is regex:
            doomed.append(self)

    def failing_batch(self, matchers, bitmask, rows):
        batch_fill(self, matchers, bitmask, rows)
        for state in doomed:
            if any(m is state._matcher for m in matchers):
                state.fills = getattr(state, "fills", 0) + 1
                if state.fills >= 3 and state not in broken:
                    broken.append(state)
        for matcher, row in zip(matchers, rows):
            if any(matcher is state._matcher for state in broken):
                if failure == "exception":
                    raise RuntimeError("injected grammar failure")
                bitmask[row] = 0

    def failing_fill(self, bitmask, row):
        if self in broken:
            raise RuntimeError("injected grammar failure")
        return fill(self, bitmask, row)

    monkeypatch.setattr(GrammarState, "__init__", tracking_init)
    monkeypatch.setattr(GrammarState, "fill", failing_fill)
    monkeypatch.setattr(xgrammar.BatchGrammarMatcher, "batch_fill_next_token_bitmask", failing_batch)
    outputs = _run(engine, _mixed())
    expected = "injected grammar failure" if failure == "exception" else "dead end"
    assert broken and expected in (outputs["regex"].error or "")
    assert outputs["regex"].outputs[0].finish_reason == "abort"
    for request_id, output in outputs.items():
        if request_id != "regex":
            assert output.error is None
            assert [c.token_ids for c in output.outputs] == [c.token_ids for c in baseline[request_id].outputs]


def test_tensor_parallel_ranks_draw_with_the_same_masks(demo_dir, mixed_outputs):
    """TP=2 (gloo): rank 0 sends each step's masks to the other rank, which draws the same tokens."""
    engine = _engine(demo_dir, tensor_parallel_size=2)
    try:
        outputs = _run(engine, _mixed())
    finally:
        engine.shutdown()
    for request_id, output in mixed_outputs.items():
        assert [c.token_ids for c in outputs[request_id].outputs] == [c.token_ids for c in output.outputs]


def test_an_engine_without_grammars_never_loads_xgrammar(demo_dir):
    script = ("import sys; from hybridserve import LLM, SamplingParams; "
              f"llm = LLM({str(demo_dir)!r}, use_tqdm=False, device='cpu', dtype='float32', "
              "kv_cache_memory_bytes=8 << 20); llm.generate(['hi'], SamplingParams(max_tokens=3)); "
              "print('xgrammar' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
