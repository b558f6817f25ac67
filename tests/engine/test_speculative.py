"""Speculative decoding on both model families (n-gram drafts; Ling also with its MTP layer drafting): greedy
output with speculation on == off token for token (k = 1, 2, 4; 16 prompts running together in one batch with
prefix caching and chunked prefill on, over a KV pool small enough to preempt, with cache hits, aborts between a
verify's launch and its results, and for Ling MTP also with mostly-accepted drafts; pages and checkpoints written
while verifying), resources back to idle; forced acceptance (all accepted / all rejected, same output); sampling,
penalties, min_tokens, logprobs, n > 1 and stops inside an accepted run equal the plain run's, and the drafts
accepted before a stop stay counted; the distribution over seeds; the start-up line on the intermediate states.
Where a test replaces the drafts, the MTP layer still drafts beside (its KV, pages and chain run every step)."""
from __future__ import annotations

import itertools
import logging
import random
import re

import pytest
import torch

from hybridserve import SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.demo import ensure_demo_checkpoint
from hybridserve.engine.drafts import ReplayDrafts
from hybridserve.engine.engine import LLMEngine
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
    engine.cache_manager.check()
    counts = engine.cache_manager.counts()
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


def _instrument(engine: LLMEngine, victims: int) -> tuple[set[str], list[int]]:
    """Make the runner abort the first `victims` requests it verifies drafts for, between launching the verify and
    collecting its results (what a client disconnect does while the device runs the step). Returns the aborted ids
    and, filled as the engine runs, the number of rows of every launched step."""
    aborted: set[str] = set()
    batches: list[int] = []
    runner = engine.runner
    launch, collect = runner.launch, runner.collect
    launched = []

    def launch_and_remember(plan):
        launched.append(plan)
        batches.append(len(plan.chunks))
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
    return aborted, batches


CROWD = 16  # requests running together
CROWD_SLOTS = 3 * CROWD  # Ling: a working slot and two checkpoint slots per running request
CROWD_PAGES = 64  # about a third of what the 16 requests' full lengths take


def _crowded_engine(directory, spec: dict) -> LLMEngine:
    """An engine that runs all 16 requests at once (16 running places, a step budget for 16 prefill chunks of 6
    tokens) over a KV pool too small for them all to finish together, so running rows preempt the newest."""
    roomy = _engine(directory, spec).runner.memory_plan
    k = spec["num_speculative_tokens"]
    budget = (CROWD_SLOTS + k * CROWD) * roomy.slot_bytes + CROWD_PAGES * (roomy.page_bytes + roomy.window_page_bytes)
    engine = _engine(directory, spec, chunked_prefill_size=6, max_num_batched_tokens=6 * CROWD,
                     max_state_slots=CROWD_SLOTS, max_running_requests=CROWD, kv_cache_memory_bytes=budget,
                     max_model_len=64)
    plan = engine.runner.memory_plan
    assert plan.max_running_requests == CROWD and plan.num_pages <= CROWD_PAGES, plan
    return engine


def _run_crowded(engine: LLMEngine, kind: str, directory, prompts) -> dict:
    """Warm the prefix cache with the first prompt (a third of the prompts share its 9-token prefix), then run all
    16 prompts in one batch, aborting two of them mid-verify; every other output must be the plain greedy one, the
    resources must add up after every step and be idle at the end. Returns the run's counters (deltas)."""
    reference = _reference(kind, directory, prompts)
    assert _tokens(_run(engine, prompts[:1])) == reference[:1]
    before = engine.stats()
    aborted, batches = _instrument(engine, victims=2)
    ids = _submit(engine, prompts, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                finished[out.request_id] = out.outputs[0].token_ids
        engine.cache_manager.check()
    assert len(aborted) == 2 and set(finished) == set(ids) - aborted
    assert [finished.get(i) for i in ids] == [None if i in aborted else t for i, t in zip(ids, reference)]
    _assert_idle(engine)
    stats = {key: value - before[key] for key, value in engine.stats().items() if key in before}
    assert max(batches) == len(prompts), batches  # every request in one step's batch
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    return stats


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculation_equals_plain_with_cache_chunks_preemption_and_aborts(model, k):
    kind, directory, method = model
    prompts = _prompts(CROWD, seed=k)
    stats = _run_crowded(_crowded_engine(directory, _spec(method, k)), kind, directory, prompts)
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]
    assert stats["spec_accepted_tokens"] > 0 or method == "mtp"  # random MTP weights: its drafts rarely hold
    # Prompts that run into pages (ZAYA footers) and checkpoints (Ling) written while verifying, in a roomy pool.
    reference = _reference(kind, directory, prompts)
    engine = _engine(directory, _spec(method, k), chunked_prefill_size=6)
    originals = prompts[:8]
    assert _tokens(_run(engine, originals)) == reference[:8]
    extended = [p + t[:12] for p, t in zip(originals, reference)]
    again = _run(engine, extended)
    assert _tokens(again) == _reference(kind, directory, extended)
    assert all(o.num_cached_tokens > len(p) for o, p in zip(again, originals))
    _assert_idle(engine)


@pytest.mark.parametrize("k", [2, 4])
def test_accepted_mtp_drafts_meet_preemption_cache_hits_and_aborts(ling_dir, k):
    """Ling's random MTP layer rarely drafts right, so the test above hardly meets an accepted MTP run. Here the
    verified drafts are the plain run's tokens with every fifth one wrong (runs of up to 4 accepted, then a
    rejection), replayed while the MTP layer still drafts beside, keeping its KV and chain over each accepted run,
    in the same crowded batch with preemption, cache hits and mid-verify aborts."""
    prompts = _prompts(CROWD, seed=60 + k)
    reference = _reference("ling", ling_dir, prompts)
    engine = _crowded_engine(ling_dir, _spec("mtp", k))
    drafts = {tuple(p): [(t + 1) % 128 if j % 5 == 4 else t for j, t in enumerate(tokens)]
              for p, tokens in zip(prompts, reference)}
    engine.set_draft_source(ReplayDrafts(drafts, key=lambda request: tuple(request.prompt_token_ids)))
    stats = _run_crowded(engine, "ling", ling_dir, prompts)
    assert 0 < stats["spec_draft_tokens"] < 2 * stats["spec_accepted_tokens"], stats
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats


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
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=3, logprobs=2,
                   logprob_token_ids=[7, 100]),
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
        assert all(set(params.logprob_token_ids) <= set(entry) for o in spec for c in o.outputs for entry in c.logprobs)
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


def test_acceptance_counts_the_drafts_verification_accepted_also_past_a_stop(model):
    """A stop inside an accepted run drops the rest of the run from the output, but verification accepted those
    drafts and they stay counted (vLLM's counting): the acceptance rate measures the drafter, not where requests
    ended. Right drafts, k = 4: verify row s yields tokens 5s - 4 .. 5s, so a stop token first drawn at position p
    (a draft's, with drafts after it) ends the request in row ceil(p / 5), every row having accepted all 4."""
    kind, directory, method = model
    prompts = _prompts(8, seed=11)
    stops = [(prompt, tokens, p) for prompt, tokens in zip(prompts, _reference(kind, directory, prompts))
             for p in range(1, 19) if p % 5 in (1, 2, 3) and tokens[p] not in tokens[:p]]
    assert stops, "no greedy continuation with a new token inside a run"  # (random weights soon repeat one)
    prompt, tokens, p = stops[0]
    engine = _engine(directory, _spec(method, 4), state_checkpoint_interval=256)  # no snapshot cuts a run short
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[tokens[p]])
    completion = _replay(engine, [prompt], params, [[tokens]])[0].outputs[0]
    assert (completion.token_ids, completion.finish_reason) == (tokens[:p + 1], "stop")
    rows = -(-p // 5)
    stats = engine.stats()
    assert stats["spec_verify_rows"] == rows and stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] == 4 * rows
    kept = p + 1 - rows  # output drafts: all tokens but the prefill's draw and the bonuses of the rows before
    assert kept < 4 * rows
    _assert_idle(engine)


def test_start_up_logs_the_intermediate_states_the_planner_reserved(model, caplog):
    """k intermediate states per running request, as logged and as the state pool holds them beside its slots."""
    kind, directory, method = model
    with caplog.at_level(logging.INFO, logger="hybridserve.runtime.model_runner"):
        engine = _engine(directory, _spec(method, 3), max_running_requests=5, max_state_slots=20)
    plan = engine.runner.memory_plan
    assert (plan.max_running_requests, plan.num_state_slots) == (5, 20)
    lines = [r.getMessage() for r in caplog.records if "intermediate states" in r.getMessage()]
    assert len(lines) == 1 and re.fullmatch(rf"speculative decoding: {method}, 3 draft tokens; 15 intermediate states "
                                            r"of \d+\.\d\d MiB reserved \(3 per running request, 5 running\)", lines[0])
    assert all(buffer.shape[1] == 1 + 20 + 15 for buffer in engine.runner.state_pool.buffers.values())
    assert plan.intermediate_bytes == 15 * plan.slot_bytes


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
