"""Speculative decoding on both model families (n-gram drafts; Ling also with its MTP layer drafting): greedy
output with speculation on == off token for token (k = 1, 2, 4; 16 prompts in one batch with prefix caching and
chunked prefill on, cache hits on pages and checkpoints written while verifying, preemption in tiny pools, aborts
between a verify's launch and its results), resources back to idle; forced acceptance (all accepted / all
rejected, same output); sampling, penalties, min_tokens, logprobs, n > 1 and stops inside an accepted run equal
the plain run's; the distribution over seeds. Where a test replaces the drafts, the MTP layer still drafts beside
(its KV, pages and chain run every step)."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from hybridserve import SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.demo import ensure_demo_checkpoint
from hybridserve.engine.engine import LLMEngine
from hybridserve.spec.drafts import ReplayDrafts
from hybridserve.tokenizer import load_tokenizer
from tests.helpers import finish_all

PAGE = 4
INTERVAL = 8  # Ling: a checkpoint every 8 tokens, so decode-time snapshots meet the verify rows often
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
_IDS = itertools.count()
_REFERENCE: dict = {}


@pytest.fixture(scope="module", params=["zaya", "ling", "ling-mtp"])
def model(request, zaya_dir, ling_dir):
    """(kind, checkpoint directory, draft method)."""
    kind, _, method = request.param.partition("-")
    return kind, zaya_dir if kind == "zaya" else ling_dir, method or "ngram"


def _spec(method: str, k: int) -> dict:
    if method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": k}
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _engine(directory, spec=None, **options) -> LLMEngine:
    options = {"device": "cpu", "dtype": "float32", "page_size": PAGE, "state_checkpoint_interval": INTERVAL,
               "speculative_config": spec, **options}
    return LLMEngine(EngineConfig(model=str(directory), **options))


def _submit(engine: LLMEngine, prompts, params) -> list[str]:
    ids = [f"s{next(_IDS)}" for _ in prompts]
    for request_id, prompt, p in zip(ids, prompts, params if isinstance(params, list) else [params] * len(prompts)):
        engine.add_request(request_id, prompt, p)
    return ids


def _run(engine: LLMEngine, prompts, params=GREEDY) -> list:
    ids = _submit(engine, prompts, params)
    done = finish_all(engine, check_resources=True)
    return [done[i] for i in ids]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_idle(engine: LLMEngine) -> None:
    engine.scheduler.check_resources()
    counts = engine.scheduler.resource_counts()
    assert counts["pages_protected"] == 0 and counts["slots_protected"] == 0, counts


def _prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts built from repeated motifs over a small alphabet (so suffix n-grams recur), a third of them sharing
    a 9-token prefix (cache hits within the batch)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 12) for _ in range(9)]
    prompts = []
    for i in range(count):
        motif = [rng.randrange(1, 12) for _ in range(rng.randint(2, 5))]
        body = (motif * 8)[: rng.randint(3, 26)]
        prompts.append(shared + body if i % 3 == 0 else body)
    return prompts


def _reference(kind: str, directory, prompts) -> list[list[int]]:
    """Plain greedy tokens (no speculation, no prefix cache, serial), per prompt, computed once per model."""
    missing = [p for p in prompts if (kind, tuple(p)) not in _REFERENCE]
    if missing:
        outs = _run(_engine(directory, enable_prefix_caching=False, disable_overlap_schedule=True), missing)
        for p, tokens in zip(missing, _tokens(outs)):
            _REFERENCE[kind, tuple(p)] = tokens
    return [_REFERENCE[kind, tuple(p)] for p in prompts]


def _abort_mid_verify(engine: LLMEngine, victims: int) -> set[str]:
    """Make the runner abort the first `victims` requests it verifies drafts for, between launching the verify and
    collecting its results (what a client disconnect does while the device runs the step)."""
    aborted: set[str] = set()
    runner = engine.runner
    launch, collect = runner.launch, runner.collect
    launched = []

    def launch_and_remember(plan):
        launched.append(plan)
        return launch(plan)

    def abort_then_collect(handle):
        plan = launched.pop()
        rows = {r.table_row: r for r in engine.scheduler.running}
        for chunk in plan.chunks:
            request = rows.get(chunk.table_row)
            if chunk.num_drafts and len(aborted) < victims and request is not None:
                aborted.add(request.request_id)
                engine.abort_request(request.request_id)
        return collect(handle)

    runner.launch, runner.collect = launch_and_remember, abort_then_collect
    return aborted


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculation_equals_plain_with_cache_chunks_preemption_and_aborts(model, k):
    kind, directory, method = model
    prompts = _prompts(16, seed=k)
    roomy = _engine(directory, _spec(method, k)).runner.memory_plan
    # Tiny pools: 10 state slots, 4 running requests, and KV pages for about one and a half requests' full length.
    budget = (10 + k * 3) * roomy.slot_bytes + 20 * (roomy.page_bytes + roomy.window_page_bytes)
    engine = _engine(directory, _spec(method, k), chunked_prefill_size=6, max_num_batched_tokens=24, max_state_slots=10,
                     max_running_requests=3, kv_cache_memory_bytes=budget, max_model_len=64)
    assert engine.runner.memory_plan.num_pages <= 32
    aborted = _abort_mid_verify(engine, victims=2)
    ids = _submit(engine, prompts, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and not out.outputs[0].finish_reason == "abort":
                finished[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_resources()
    assert len(aborted) == 2 and set(finished) == set(ids) - aborted
    reference = _reference(kind, directory, prompts)
    assert [finished.get(i) for i in ids] == [None if i in aborted else t for i, t in zip(ids, reference)]
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]
    assert stats["spec_accepted_tokens"] > 0 or method == "mtp"  # random MTP weights: its drafts rarely hold
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    _assert_idle(engine)
    # Prompts that run into pages (ZAYA footers) and checkpoints (Ling) written while verifying, in a roomy pool.
    engine = _engine(directory, _spec(method, k), chunked_prefill_size=6)
    originals = prompts[:8]
    assert _tokens(_run(engine, originals)) == reference[:8]
    extended = [p + t[:12] for p, t in zip(originals, reference)]
    again = _run(engine, extended)
    assert _tokens(again) == _reference(kind, directory, extended)
    assert all(o.num_cached_tokens > len(p) for o, p in zip(again, originals))
    _assert_idle(engine)


def _forced(kind, directory, method, drafts_for) -> tuple[list[list[int]], dict]:
    prompts = _prompts(8, seed=11)
    reference = _reference(kind, directory, prompts)
    engine = _engine(directory, _spec(method, 3), state_checkpoint_interval=256)  # no snapshot cuts a run short
    outputs = _replay(engine, prompts, GREEDY, [[drafts_for(t)] for t in reference])
    _assert_idle(engine)
    assert _tokens(outputs) == reference
    return reference, engine.stats()


def test_forced_acceptance_accepts_every_draft_and_wrong_drafts_are_all_rejected(model):
    kind, directory, method = model
    reference, right = _forced(kind, directory, method, lambda tokens: tokens)
    # Every step verifies min(3, tokens left - 1) drafts and accepts them all: 20 tokens = 1 prefill draw + 5 steps
    # of 1 + 3 tokens, the last one with 2 drafts.
    assert right["spec_accepted_tokens"] == right["spec_draft_tokens"] == 8 * (3 * 4 + 2)
    assert right["spec_verify_rows"] == 8 * 5
    # Always wrong: one token per step; every step but the last (no room for a draft) verifies min(3, left - 1).
    _, wrong = _forced(kind, directory, method, lambda tokens: [(t + 1) % 128 for t in tokens])
    assert wrong["spec_accepted_tokens"] == 0 and wrong["spec_verify_rows"] == 8 * 18
    assert wrong["spec_draft_tokens"] == 8 * sum(min(3, 19 - done) for done in range(1, 19))


def test_forced_acceptance_yields_wrong_drafts_with_the_targets_logprobs(model):
    """The benchmarks' instrument (`force_acceptance`): always-wrong drafts are all accepted, so each step yields its
    drafts, then the target's own draw after them (the bonus); the logprob given for a forced token is the
    target's for that token, i.e. a plain engine's prompt logprob of it after the same tokens."""
    kind, directory, method = model
    prompts = _prompts(8, seed=11)
    wrong = [[(t + 1) % 128 for t in tokens] for tokens in _reference(kind, directory, prompts)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    engine = _engine(directory, _spec(method, 3), state_checkpoint_interval=256)
    outputs = _replay(engine, prompts, params, [[w] for w in wrong], force_acceptance=True)
    _assert_idle(engine)
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] == 8 * (3 * 4 + 2)  # as all-right drafts
    # Token 0 is the prefill's draw; then 4 steps of 3 drafts + the bonus, and a last step of 2 drafts + the bonus.
    forced = [i for i in range(1, 17) if (i - 1) % 4 < 3] + [17, 18]
    for tokens, drafts in zip(_tokens(outputs), wrong):
        assert [tokens[i] for i in forced] == [drafts[i] for i in forced]
    scored = _run(_engine(directory, enable_prefix_caching=False), [p + t for p, t in zip(prompts, _tokens(outputs))],
                  SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    for prompt, output, score in zip(prompts, outputs, scored):
        completion = output.outputs[0]
        assert [entry[t] for entry, t in zip(completion.logprobs, completion.token_ids)] == pytest.approx(
            [score.prompt_logprobs[len(prompt) + i][t] for i, t in enumerate(completion.token_ids)], abs=1e-5)


SAMPLING = [
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=3, logprobs=2),
    SamplingParams(temperature=1.0, top_k=5, min_p=0.05, max_tokens=16, ignore_eos=True, seed=4, logprobs=0),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                   max_tokens=16, seed=5, min_tokens=6),
    SamplingParams(temperature=0.7, n=3, max_tokens=12, ignore_eos=True, seed=6, logprobs=1),
]


def _completions(outputs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def _logprobs(outputs) -> list[float]:
    """Every sampled token's logprob and its top alternatives', flat."""
    return [value for o in outputs for c in o.outputs for entry in c.logprobs for value in entry.values()]


def _replay(engine: LLMEngine, prompts, params, continuations: list[list[list[int]]],
            force_acceptance: bool = False) -> list:
    """Run with drafts replayed from `continuations` (per prompt, per sequence of its n)."""
    ids = [f"replay-{next(_IDS)}" for _ in prompts]
    engine.set_draft_source(ReplayDrafts({f"{i}#{n}" if n else i: tokens for i, sequences in zip(ids, continuations)
                                          for n, tokens in enumerate(sequences)}), force_acceptance)
    for request_id, prompt, p in zip(ids, prompts, params if isinstance(params, list) else [params] * len(prompts)):
        engine.add_request(request_id, prompt, p)
    done = finish_all(engine)
    return [done[i] for i in ids]


@pytest.mark.parametrize("params", SAMPLING, ids=["top_p", "top_k_min_p", "penalties_min_tokens", "n3"])
def test_seeded_sampling_with_speculation_draws_the_plain_runs_tokens(model, params):
    """Verify positions draw what the plain run draws (same seeded uniform, same filtered p, drafts counted for
    penalties and min_tokens), so seeded outputs and logprobs equal the plain run's. Drafts: the plain run's tokens
    with every third one wrong, so that verify rows accept some drafts and reject others."""
    kind, directory, method = model
    prompts = _prompts(6, seed=21)
    plain = _run(_engine(directory, disable_overlap_schedule=True), prompts, params)
    engine = _engine(directory, _spec(method, 3))
    drafts = [[[(t + 1) % 128 if j % 3 == 2 else t for j, t in enumerate(c.token_ids)] for c in o.outputs]
              for o in plain]
    spec = _replay(engine, prompts, params, drafts)
    assert _completions(spec) == _completions(plain)
    if params.logprobs is not None:
        assert _logprobs(spec) == pytest.approx(_logprobs(plain), abs=1e-5)
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    _assert_idle(engine)


def test_stops_inside_an_accepted_run_truncate_it(model):
    """Forced acceptance makes long accepted runs; stop ids, stop strings, EOS and max_tokens landing inside one
    end the output exactly where the plain run ends."""
    kind, directory, method = model
    prompts = _prompts(4, seed=31)
    reference = _reference(kind, directory, prompts)
    tokenizer = load_tokenizer(str(directory))
    cases = []
    for prompt, tokens in zip(prompts, reference):
        cases.append((prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tokens[6]])))
        cases.append((prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)))
        text = tokenizer.decode(tokens[:9])
        cases.append((prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[text[-3:]])))
    prompts, params = [c[0] for c in cases], [c[1] for c in cases]
    plain = _run(_engine(directory, disable_overlap_schedule=True), prompts, params)
    engine = _engine(directory, _spec(method, 4))
    spec = _replay(engine, prompts, params, [[reference[n // 3]] for n in range(len(cases))])
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in spec for c in o.outputs] == \
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in plain for c in o.outputs]
    assert engine.stats()["spec_accepted_tokens"] > 0
    _assert_idle(engine)


def test_sampled_token_distribution_matches_the_plain_runs(model):
    """Two independent samples (different seeds) of one prompt's first four tokens at temperature 1, the plain run
    and a run whose drafts are the greedy continuation (accepted only as often as the target draws it): per
    position, every token's frequency agrees within 5 sigma of the two-sample spread."""
    kind, directory, method = model
    prompt = _prompts(1, seed=41)[0]
    count = 300
    greedy = _reference(kind, directory, [prompt])[0]

    def params(first_seed):
        return [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=first_seed + i)
                for i in range(count)]

    plain = torch.tensor(_tokens(_run(_engine(directory, disable_overlap_schedule=True), [prompt] * count,
                                      params(0))))
    engine = _engine(directory, _spec(method, 3))
    spec = torch.tensor(_tokens(_replay(engine, [prompt] * count, params(10_000), [[greedy]] * count)))
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    for position in range(4):
        f1, f2 = (torch.bincount(t[:, position], minlength=128).float() / count for t in (plain, spec))
        pooled = (f1 + f2) / 2
        assert ((f1 - f2).abs() <= 5 * (pooled * (1 - pooled) * 2 / count).sqrt() + 1e-9).all(), position


def test_grammar_requests_run_beside_speculative_ones_without_drafts():
    """Structured output under speculative decoding: requests with a grammar get no drafts (one token a step, masked
    as without speculation) and still match their grammars; the free requests beside them verify drafts and give
    the plain engine's tokens."""
    from tests.engine.test_structured_output import _check_grammars, _engine, _free, _mixed, _run

    demo = ensure_demo_checkpoint()
    engine = _engine(demo, speculative_config=_spec("ngram", 3))
    proposals = []
    propose = engine.scheduler.speculation.drafts.propose
    engine.scheduler.speculation.drafts.propose = lambda request, limit: proposals.append(request) or \
        propose(request, limit)
    outputs = _run(engine, _mixed())
    _check_grammars(outputs)
    assert proposals and all(r.params.structured_output is None for r in proposals)
    plain = _run(_engine(demo, disable_overlap_schedule=True), _free())
    assert {k: [c.token_ids for c in o.outputs] for k, o in outputs.items() if k in plain} == \
        {k: [c.token_ids for c in o.outputs] for k, o in plain.items()}
    _assert_idle(engine)
