"""The scheduler and the cache manager without a model: random sequences of admissions, steps, aborts, stops,
forks (n > 1) and preemptions, overlapped or serial, with speculative verify rows, prefix caching of both kinds and
a window group. The books are recounted after every operation (`HybridCacheManager.check`), and once everything
has ended nothing is held but the prefix cache's entries, which it gives back whole."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve.cache.memory import MemoryPlan, min_window_pages
from hybridserve.config import NO_CHUNKING
from hybridserve.engine.cache_manager import HybridCacheManager
from hybridserve.engine.drafts import Speculation
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.engine.scheduler import ScheduledStep, Scheduler
from hybridserve.sampling import SamplingParams
from hybridserve.spec.verify import IntermediateSlots, accepted_length

VOCAB = 4  # small, so prompts share prefixes and drafts are sometimes right
PROMPTS = [[(i * 7 + b) % VOCAB for i in range(64)] for b in range(2)]


class CountingDrafts:
    """Drafts that depend only on the request's length (deterministic under hypothesis's replay)."""

    def propose(self, request: Request, limit: int) -> list[int]:
        return [(request.num_tokens + i) % VOCAB for i in range(limit)]


@dataclass
class Driver:
    """What LLMEngine does with the scheduler's steps, with drawn tokens from a seeded generator."""

    scheduler: Scheduler
    cache: HybridCacheManager
    overlap: bool
    rng: random.Random
    live: list[Request] = field(default_factory=list)
    in_flight: ScheduledStep | None = None
    requests: int = 0

    def add(self, prompt: list[int], params: SamplingParams) -> None:
        request = Request(f"r{self.requests}", prompt, params, seed=self.requests, eos_token_ids=frozenset(),
                          num_forks=params.n - 1)
        self.requests += 1
        self.live.append(request)
        self.scheduler.add(request)

    def step(self) -> None:
        if not self.overlap:
            scheduled = self.scheduler.schedule()
            if scheduled is not None:
                self._process(scheduled)
            return
        previous, self.in_flight = self.in_flight, None
        if previous is not None and previous.forks:
            self._process(previous)
            previous = None
        self.in_flight = self.scheduler.schedule()
        if previous is not None:
            self._process(previous)
        self.settle_discarded()

    def end(self, index: int, reason: str) -> None:
        """Abort (nothing cached) or stop (its pages cached) a live request."""
        live = [r for r in self.live if not r.finished]
        if live:
            self.scheduler.finish(live[index % len(live)], reason)
            self.settle_discarded()

    def preempt(self) -> None:
        if self.scheduler.running:
            self.scheduler._preempt(self.scheduler.running[-1])

    def settle_discarded(self) -> None:
        if self.in_flight is not None and all(r.finished for r in self.in_flight.requests):
            scheduled, self.in_flight = self.in_flight, None
            self._process(scheduled)

    def _process(self, scheduled: ScheduledStep) -> None:
        plan = scheduled.plan
        drawn = [[self.rng.randrange(VOCAB) for _ in rows] for rows in plan.samples]
        accepted = {}
        for request, chunk, tokens in zip(scheduled.requests, plan.chunks, drawn):
            if chunk.num_drafts and not request.finished:
                accepted[request.serial] = n = accepted_length(tokens, chunk.token_ids[1:])
                self.cache.accept(request, chunk.prefix_len + 1 + n)
        self.cache.settle(scheduled.cache, scheduled.requests)
        for request, chunk, tokens in zip(scheduled.requests, plan.chunks, drawn):
            if request.finished or not tokens:
                continue
            request.num_pending -= 1
            if chunk.num_drafts:
                for token in tokens[:accepted[request.serial] + 1]:
                    if self._append(request, token):
                        break
                continue
            first, *forks = tokens
            for token in forks:
                self._append(self._fork(request, True), token)
            for _ in range(request.num_forks - len(forks)):
                self._fork(request, False)
            request.num_forks = 0
            self._append(request, first)

    def _fork(self, parent: Request, drawn: bool) -> Request:
        child = Request(f"{parent.request_id}#{self.requests}", parent.prompt_token_ids, parent.params,
                        seed=self.requests, eos_token_ids=frozenset())
        self.requests += 1
        self.live.append(child)
        self.scheduler.fork(parent, child, drawn)
        return child

    def _append(self, request: Request, token: int) -> bool:
        request.output_token_ids.append(token)
        if len(request.output_token_ids) >= request.params.max_tokens or \
                request.num_tokens >= self.scheduler.max_model_len:
            self.scheduler.finish(request, "length")
        return request.finished


def _driver(page_size: int, num_pages: int, max_running: int, slots: int, caching: str, window: int | None,
            window_pages: int, k: int, lookahead: int, token_budget: int, chunk: int | None, interval: int | None,
            scoring: int, overlap: bool, seed: int) -> Driver:
    plan = MemoryPlan(budget_bytes=0, num_pages=num_pages, num_state_slots=slots, max_running_requests=max_running,
                      intermediate_bytes=0, page_bytes=1, slot_bytes=1, num_window_pages=window_pages)
    cache = HybridCacheManager(plan, page_size, caching != "off", per_page_state=caching == "per_page",
                               sliding_window=window)
    speculation = Speculation(CountingDrafts(), IntermediateSlots(slots + 1, k), lookahead) if k else None
    scheduler = Scheduler(cache, token_budget, chunk, interval, max_model_len=num_pages * page_size,
                          speculation=speculation)
    scheduler.scoring_per_step = scoring
    return Driver(scheduler, cache, overlap=overlap and not k, rng=random.Random(seed))


@st.composite
def setups(draw: st.DrawFn) -> tuple[dict, list]:
    page_size = draw(st.sampled_from([2, 4]))
    num_pages, max_running, window, k = (draw(st.integers(6, 24)), draw(st.integers(1, 5)),
                                         draw(st.sampled_from([None, 3, 6])), draw(st.sampled_from([0, 0, 1, 3])))
    config = dict(page_size=page_size, num_pages=num_pages, max_running=max_running,
                  slots=draw(st.integers(max_running, 10)), caching=draw(st.sampled_from(["off", "per_page", "sparse"])),
                  window=window, window_pages=draw(st.integers(max(4, num_pages // 2), num_pages)) if window else 0,
                  k=k, lookahead=draw(st.integers(0, k)), token_budget=draw(st.integers(1, 16)),
                  chunk=draw(st.sampled_from([None, 3, 8, NO_CHUNKING])),
                  interval=draw(st.sampled_from([None, page_size, 2 * page_size])),  # a multiple of the page
                  scoring=draw(st.sampled_from([4, 512])), overlap=draw(st.booleans()), seed=draw(st.integers(0, 99)))
    max_model_len = num_pages * page_size
    prompt = st.builds(lambda base, length, tail: (PROMPTS[base][:length] + tail)[:max_model_len - 1],
                       st.integers(0, 1), st.integers(1, 6 * page_size), st.lists(st.integers(0, VOCAB - 1),
                                                                               max_size=3))
    params = st.builds(SamplingParams, n=st.integers(1, 3), max_tokens=st.integers(1, 12),
                       prompt_logprobs=st.sampled_from([None, None, None, 1]))
    step = st.tuples(st.just("step"))
    ops = st.one_of(st.tuples(st.just("add"), prompt, params), step, step, step,
                    st.tuples(st.just("end"), st.integers(0, 9), st.sampled_from(["abort", "stop"])),
                    st.tuples(st.just("preempt")))
    return config, draw(st.lists(ops, min_size=8, max_size=80))


def _check(driver: Driver) -> None:
    driver.cache.check()
    assert {r.serial for r in driver.cache.holders} == {r.serial for r in driver.scheduler.running}


def _one_request_fits(config: dict) -> bool:
    """Whether the window group (if any) holds one request's window and one step's tokens, drafts included, as
    the memory planner makes sure (the full group holds max_model_len tokens by construction)."""
    window = config["window"]
    return window is None or config["window_pages"] >= min_window_pages(1, window, config["page_size"],
                                                                          config["token_budget"] + config["k"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_random_schedules_keep_the_books(setup: tuple[dict, list]) -> None:
    config, ops = setup
    driver = _driver(**config)
    for op, *args in ops:
        if op == "add":
            driver.add(*args)
        elif op == "step":
            driver.step()
        elif op == "end":
            driver.end(*args)
        else:
            driver.preempt()
        _check(driver)
    for _ in range(2000):  # run what is left
        if not driver.scheduler.has_work() and driver.in_flight is None:
            break
        driver.step()
        _check(driver)
    if _one_request_fits(config):  # then preemption cannot go round in circles: everything ends by itself
        assert not driver.scheduler.has_work() and driver.in_flight is None, "requests left running or waiting"
    for _ in driver.live:
        driver.end(0, "abort")
    assert not driver.scheduler.has_work() and driver.in_flight is None
    assert all(r.finished for r in driver.live)
    counts = driver.cache.counts()
    assert counts["pages_protected"] == counts["slots_protected"] == 0 and not driver.cache.holders
    if driver.cache.prefix_cache is not None:
        driver.cache.prefix_cache.clear()
    counts = driver.cache.counts()
    assert counts["pages_free"] == counts["pages_total"] and counts["slots_free"] == counts["slots_total"]
    assert counts.get("window_pages_free") == counts.get("window_pages_total")


def _drain(driver: Driver, steps: int) -> None:
    for _ in range(steps):
        if not driver.scheduler.has_work():
            return
        driver.step()
        _check(driver)


def test_a_prompt_scoring_request_recomputing_cached_pages_fits_a_pool_of_its_size() -> None:
    """A request that scores its prompt skips the prefix cache, so it computes pages the tree already holds; it
    takes the tree's pages for them (locked for it) and gives its copies back. Holding both, it needed 7 pages of
    a 6-page pool, was preempted and re-admitted without end."""
    for token_budget in (1, 4):
        driver = _driver(page_size=2, num_pages=6, max_running=1, slots=1, caching="per_page", window=None,
                         window_pages=0, k=0, lookahead=0, token_budget=token_budget, chunk=None, interval=None,
                         scoring=512, overlap=False, seed=0)
        driver.add([0, 1], SamplingParams(max_tokens=1))
        _drain(driver, 20)
        cached = driver.cache.prefix_cache.match([0, 1, 2], max_tokens=2).pages
        driver.add([0, 1], SamplingParams(max_tokens=10, prompt_logprobs=1))  # 12 tokens: all 6 pages
        scorer = driver.live[-1]
        driver.step()
        driver.step()  # its first page is complete and inserted: the tree's page replaced its own
        assert scorer.page_ids[0] == cached[0] and scorer.status is RequestStatus.RUNNING
        _drain(driver, 100)
        assert scorer.finished and driver.scheduler.num_preemptions == 0


def test_a_preempted_request_hits_the_prompt_positions_it_already_scored() -> None:
    driver = _driver(page_size=2, num_pages=12, max_running=1, slots=2, caching="per_page", window=None,
                     window_pages=0, k=0, lookahead=0, token_budget=2, chunk=None, interval=None, scoring=512,
                     overlap=False, seed=0)
    driver.add(list(range(8)), SamplingParams(max_tokens=1))
    _drain(driver, 20)
    driver.add(list(range(8)), SamplingParams(max_tokens=4, prompt_logprobs=1))
    scorer = driver.live[-1]
    for _ in range(3):  # 6 of its 8 prompt tokens computed, so positions 0-5 scored
        driver.step()
    assert scorer.num_prompt_scored == 6 and driver.cache.prefix_hit_tokens == 0
    driver.preempt()
    driver.step()
    assert driver.cache.prefix_hit_tokens == 6 and scorer.num_computed_tokens >= 6
    _drain(driver, 20)
    assert scorer.finished and scorer.num_prompt_scored == 7


def _prompt_chunks(chunk: int | None) -> dict[str, list[int]]:
    """The prompt tokens each request got per step, on a budget of 16: r0 (10 tokens) decodes 4 tokens while r1
    (16 tokens: the whole budget) and r2 (40: more than the budget) wait behind it."""
    driver = _driver(page_size=4, num_pages=64, max_running=4, slots=4, caching="off", window=None, window_pages=0,
                     k=0, lookahead=0, token_budget=16, chunk=chunk, interval=None, scoring=512, overlap=False,
                     seed=0)
    chunks: dict[str, list[int]] = {}
    schedule = driver.scheduler.schedule

    def recording() -> ScheduledStep | None:
        step = schedule()
        for request, scheduled in zip(step.requests if step else [], step.plan.chunks if step else []):
            if scheduled.prefix_len < request.num_prompt_tokens:  # a prompt chunk
                chunks.setdefault(request.request_id, []).append(len(scheduled.token_ids))
        return step

    driver.scheduler.schedule = recording
    driver.add(PROMPTS[0][:10], SamplingParams(max_tokens=4))
    driver.step()
    driver.add(PROMPTS[1][:16], SamplingParams(max_tokens=1))
    driver.add(PROMPTS[1][:40], SamplingParams(max_tokens=1))
    while driver.scheduler.has_work():
        driver.step()
        _check(driver)
    return chunks


def test_no_chunking_prefills_a_prompt_that_fits_the_budget_in_one_step():
    """--chunked-prefill-size -1 (SGLang's): r1 waits for a step with room for its 16 tokens instead of taking the
    15 left beside r0's decode row; r2, longer than the budget, is split at the budget all the same."""
    assert _prompt_chunks(None) == {"r0": [10], "r1": [15, 1], "r2": [14, 15, 11]}
    assert _prompt_chunks(NO_CHUNKING) == {"r0": [10], "r1": [16], "r2": [16, 16, 8]}


def test_a_fork_keeps_the_pages_it_shares_protected_when_its_parent_caches_them_and_ends() -> None:
    """Found by the random schedules: a parent (n=2) forks with pages shared, then caches them in a node deeper
    than the fork's lock and ends. The shared pages must stay protected while the fork runs (they were counted
    evictable, so the counters drifted from the recount)."""
    driver = _driver(page_size=2, num_pages=6, max_running=2, slots=3, caching="sparse", window=3, window_pages=4,
                     k=1, lookahead=0, token_budget=2, chunk=None, interval=2, scoring=4, overlap=False, seed=0)
    driver.add(PROMPTS[0][:5], SamplingParams(n=1, max_tokens=1))
    driver.step()
    driver.add([0, 3, 0], SamplingParams(n=1, max_tokens=2))
    for _ in range(4):
        driver.step()
    driver.add(PROMPTS[0][:1], SamplingParams(n=1, max_tokens=2))
    driver.end(0, "abort")
    driver.add(PROMPTS[0][:5], SamplingParams(n=2, max_tokens=3))
    forked_while_parent_ran = False
    while driver.scheduler.has_work():
        driver.step()
        _check(driver)
        running = {r.request_id for r in driver.scheduler.running}
        forked_while_parent_ran |= {"r3", "r3#4"} <= running
    assert forked_while_parent_ran
