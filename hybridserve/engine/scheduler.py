"""Scheduler: FCFS continuous batching under the token budget, the running-request cap and what the cache manager
can give (pages, slots), with hybrid prefix caching. Policy only: who holds what is `HybridCacheManager`'s.

Every step runs the running requests first (a decode token, or the next chunk of a prompt) and then admits waiting
requests in arrival order while the token budget, the running-request cap, pages and slots allow. Prefill chunks
and decode rows share one forward. A chunk never crosses a state-snapshot position (sparse checkpoints: the end of
the prompt's last whole page, every `checkpoint_interval` tokens and branch points), so a snapshot is simply the
working state at a chunk end. When a running request's pages run out (after eviction), the most recently admitted
running request is preempted (everything it holds is freed and it is recomputed later). With no chunking
(chunked_prefill_size -1, SGLang's) a prompt that fits the token budget starts only in a step with room for all of
it.

Speculative decoding (`speculation`): a running request's decode row also carries the drafts its draft source
proposes (a verify row: its last drawn token, then up to k drafts, with a draw at every position; the row's
intermediate state slots receive the states after the drafts). Drafts never reach past max_tokens or the context
length, and never past a sparse snapshot position (a checkpoint is only ever taken from a verified state). Once the
step is processed, `HybridCacheManager.accept` sets the row's computed length to the accepted tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridserve.config import NO_CHUNKING
from hybridserve.core.chunk import FUTURE_TOKEN, ScheduledChunk
from hybridserve.core.step import PromptLogprobTargets, SamplingRow, StepPlan
from hybridserve.engine.cache_manager import HybridCacheManager, StepCache
from hybridserve.engine.drafts import Speculation
from hybridserve.engine.request import Request, RequestStatus

# Prompt-logprob chunks produce [tokens, vocab] fp32 logits; this bounds them per step, across all requests.
PROMPT_LOGPROB_TOKENS_PER_STEP = 512


@dataclass
class ScheduledStep:
    plan: StepPlan
    requests: list[Request]  # the request behind each chunk of the plan
    scoring_left: int  # prompt tokens this step may still score
    cache: StepCache = field(default_factory=StepCache)  # the plan's cache ops and what the step holds until settled
    fork_draws: int = 0  # sequences forked off in this step (each takes a running place after it)
    num_draws: int = 0  # sampling rows so far, in plan order
    forks: bool = False  # a prompt forks into n > 1 sequences when this step's draws are processed


class Scheduler:
    def __init__(self, cache: HybridCacheManager, token_budget: int, chunked_prefill_size: int | None = None,
                 checkpoint_interval: int | None = None, max_model_len: int | None = None,
                 speculation: Speculation | None = None):
        """`token_budget`: tokens per step (max_num_batched_tokens); at most `cache.num_rows` requests run.
        `chunked_prefill_size`: the most prompt tokens of a request per step (None: the budget), or NO_CHUNKING."""
        self.cache = cache
        self.max_running = cache.num_rows
        self.token_budget = token_budget
        self.whole_prompts = chunked_prefill_size == NO_CHUNKING
        self.chunk_cap = token_budget if chunked_prefill_size in (None, NO_CHUNKING) else chunked_prefill_size
        self.scoring_per_step = PROMPT_LOGPROB_TOKENS_PER_STEP
        self.checkpoint_interval = checkpoint_interval
        self.max_model_len = max_model_len if max_model_len is not None else float("inf")
        self.speculation = speculation
        self.sparse = cache.sparse  # sparse checkpoints: chunks end at snapshot positions
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # --- queue management ------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Retire a request (finished or aborted) wherever it is, caching what it computed and freeing the rest."""
        running = request.status is RequestStatus.RUNNING
        if running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.release(request, cache_pages=running and reason != "abort")
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.release(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # --- one step --------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        """The next step's plan, or None when nothing can run (a fork's pending copies then wait for the next)."""
        step = ScheduledStep(StepPlan(chunks=[], samples=[], prompt_logprobs=[]), [],
                             scoring_left=self.scoring_per_step)
        budget = self.token_budget
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING or self._ends_with_pending(request):
                continue  # preempted earlier in this loop, or its token in flight is its last
            count = self._chunk_length(request, budget, step)
            drafts = self._propose(request, budget) if count == 1 else []
            if count == 0 or not self._reserve(request, count + len(drafts)):
                continue  # (0: a prompt to score, and this step's scoring budget is spent)
            self._reserve_lookahead(request, count + len(drafts))
            budget -= self._add_chunk(step, request, count, budget, drafts)
        while self.waiting and budget > 0 and len(self.running) + step.fork_draws < self.max_running:
            if not self._admit(step, self.waiting[0], budget):
                break
            request = self.waiting.popleft()
            count = self._chunk_length(request, budget, step)
            self._reserve_lookahead(request, count)
            budget -= self._add_chunk(step, request, count, budget)
        if not step.requests:
            return None
        step.cache = self.cache.take()
        step.plan.cache_ops = step.cache.ops
        return step

    def _ends_with_pending(self, request: Request) -> bool:
        """The token in flight reaches max_tokens or the context length: the request ends when it lands, so it
        gets no further work meanwhile (overlapped scheduling; other stops are known only from the token)."""
        max_tokens = request.params.max_tokens
        return request.num_pending > 0 and ((max_tokens is not None and request.num_output_tokens >= max_tokens)
                                            or request.num_tokens >= self.max_model_len)

    def _propose(self, request: Request, budget: int) -> list[int]:
        """Drafts for a decode row (speculative decoding): within the step's budget, max_tokens and the context
        length, and short of the next sparse snapshot position unless that is the row's first token (the working
        slot holds the state after it, a verified state; a later position would be a draft's state). A request
        under a grammar (structured output) gets none: its mask at a verify position would need the grammar
        advanced through the drafts before it, so it decodes one token a step."""
        spec = self.speculation
        if spec is None or not request.output_token_ids or request.num_computed_tokens != request.num_tokens - 1 \
                or request.params.structured_output is not None:
            return []
        limit = min(spec.slots.per_row, budget - 1, self.max_model_len - request.num_tokens - 1)
        if request.params.max_tokens is not None:
            limit = min(limit, request.params.max_tokens - request.num_output_tokens - 1)
        if self.sparse:
            snapshot = self._next_snapshot(request, request.num_computed_tokens)
            if snapshot is not None and snapshot > request.num_computed_tokens + 1:
                limit = min(limit, snapshot - request.num_computed_tokens - 2)
        return spec.drafts.propose(request, limit) if limit > 0 else []

    def _reserve_lookahead(self, request: Request, count: int) -> None:
        """Speculative decoding: pages past a drawing row's `count` tokens, if free ones are left (never by
        preemption or eviction): for the draft layer's chain (`Speculation.lookahead`) and, for a decode row, up to
        1 + k positions, which a CUDA-graph verify step pads every row to. Without them the chain's KV writes go to
        the dummy page (only those drafts suffer) and the step runs eagerly."""
        spec = self.speculation
        start = request.num_computed_tokens
        end = start + count
        if spec is None or end < request.num_tokens:  # not a drawing row
            return
        target = end + spec.lookahead
        if start == request.num_tokens - 1 and request.output_token_ids:
            target = max(target, start + 1 + spec.slots.per_row)
        self.cache.reserve(request, min(target, self.max_model_len) - start, evict=False)

    def _next_snapshot(self, request: Request, done: int) -> int | None:
        """The first position after `done` where a sparse checkpoint must be taken, if any."""
        size = self.cache.page_size
        candidates = [request.branch_point, (request.num_prompt_tokens - 1) // size * size]
        if self.checkpoint_interval:
            candidates.append((done // self.checkpoint_interval + 1) * self.checkpoint_interval)
        later = [c for c in candidates if c > done]
        return min(later) if later else None

    def _chunk_length(self, request: Request, budget: int, step: ScheduledStep) -> int:
        cap = min(self.chunk_cap, step.scoring_left) if request.scores_prompt else self.chunk_cap
        count = min(request.num_tokens - request.num_computed_tokens, budget, cap)
        if self.sparse:
            snapshot = self._next_snapshot(request, request.num_computed_tokens)
            if snapshot is not None:
                count = min(count, snapshot - request.num_computed_tokens)
        return count

    def _reserve(self, request: Request, count: int) -> bool:
        """Pages for a running request's next `count` tokens, preempting newer requests while there are none."""
        while not self.cache.reserve(request, count):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _admit(self, step: ScheduledStep, request: Request, budget: int) -> bool:
        """Admit the first waiting request if the cache can hold it (never by preemption). A request preempted with
        a token in flight waits until that token is on the host (its prefix is matched by value)."""
        if request.num_pending or self._chunk_length(request, budget, step) == 0 or not self._fits(request, budget):
            return False
        if not self.cache.admit(request, lambda r: self._chunk_length(r, budget, step)):
            return False
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def _fits(self, request: Request, budget: int) -> bool:
        """Whether this step may start the request's prompt: always, unless there is no chunking (NO_CHUNKING), where
        a prompt that fits the token budget waits for a step with room for all of it (one longer than the budget is
        split at the budget all the same). It waits at the head of the queue, so it is not passed over for ever."""
        rest = request.num_tokens - request.num_computed_tokens
        return not self.whole_prompts or rest <= budget or rest > self.token_budget

    def _add_chunk(self, step: ScheduledStep, request: Request, count: int, budget: int,
                   drafts: list[int] | None = None) -> int:
        """Schedule `count` tokens of the request (and the drafts after them: a verify row); return the budget
        they take (with the draws of forks)."""
        if drafts:
            return self._add_verify_chunk(step, request, drafts)
        plan = step.plan
        step.requests.append(request)
        start = request.num_computed_tokens
        end = start + count
        if request.scores_prompt:
            step.scoring_left -= count
        targets, scored = self._prompt_targets(request, start, end)
        forks = 0
        if end == request.num_tokens and request.num_forks and not request.output_token_ids:
            # Forks drawn now take budget and running places; the engine queues the others to draw after a
            # (prefix-cached) recompute.
            places = self.max_running - len(self.running) - step.fork_draws
            forks = max(0, min(request.num_forks, budget - count, places))
            step.fork_draws += forks
            step.forks = True
        draws = self._draws(request, forks) if end == request.num_tokens else []
        known = min(end, request.num_known_tokens)  # a token still being drawn can only be the last one
        plan.chunks.append(ScheduledChunk(
            token_ids=request.token_ids(start, known) + [FUTURE_TOKEN] * (end - known),
            prefix_len=start,
            page_ids=request.page_ids,  # not copied: see ScheduledChunk.page_ids
            state_slot=request.state_slot,
            has_initial_state=start > 0,
            logits_offsets=scored + ([count - 1] if draws else []),
            table_row=request.table_row,
            window_page_ids=request.window_page_ids if self.cache.window_pages is not None else None,
            future_token=request.pending_draw if end > known else None,
            next_token_id=request.token_ids(end, end + 1)[0] if end < request.num_known_tokens else None,
        ))
        if draws:  # the request's own draw, counted from now on (appended when the step is processed)
            request.num_pending += 1
            request.pending_draw = step.num_draws
            step.num_draws += len(draws)
        plan.samples.append(draws)
        plan.prompt_logprobs.append(targets)
        request.num_computed_tokens = end
        if self.sparse and end == self._next_snapshot(request, start):
            self.cache.snapshot(request, end)
        return count + forks

    def _add_verify_chunk(self, step: ScheduledStep, request: Request, drafts: list[int]) -> int:
        """The row's last drawn token and its drafts, with a draw at every position (`spec.verify`)."""
        start = request.num_computed_tokens
        step.requests.append(request)
        step.plan.chunks.append(ScheduledChunk(
            token_ids=request.token_ids(start, start + 1) + drafts,
            prefix_len=start,
            page_ids=request.page_ids,
            state_slot=request.state_slot,
            has_initial_state=True,
            logits_offsets=list(range(1 + len(drafts))),
            table_row=request.table_row,
            window_page_ids=request.window_page_ids if self.cache.window_pages is not None else None,
            draft_slots=self.speculation.slots.of(request.table_row, len(drafts)),
        ))
        step.plan.samples.append([
            SamplingRow(params=request.params, seed=request.seed, output_token_ids=request.output_token_ids,
                        prompt_token_ids=request.prompt_token_ids, banned_token_ids=request.banned_token_ids(i),
                        key=request.serial, token_index=request.num_output_tokens + i, draft_prefix=drafts[:i],
                        forced_token=drafts[i] if self.speculation.force_acceptance and i < len(drafts) else None)
            for i in range(1 + len(drafts))])
        step.plan.prompt_logprobs.append(None)
        request.num_pending += 1  # the first draw: the others land only as far as the drafts are accepted
        request.pending_draw = step.num_draws
        step.num_draws += 1 + len(drafts)
        request.num_computed_tokens = start + 1 + len(drafts)  # until accept_drafts
        if self.sparse and start + 1 == self._next_snapshot(request, start):
            self.cache.snapshot(request, start + 1)
        return 1 + len(drafts)

    @staticmethod
    def _prompt_targets(request: Request, start: int, end: int) -> tuple[PromptLogprobTargets | None, list[int]]:
        """Prompt positions of this chunk still to score (a recomputed chunk is not scored twice), and their
        offsets in the chunk. Position p scores prompt token p + 1; the last prompt position samples instead."""
        top_k = request.params.prompt_logprobs
        first, stop = max(start, request.num_prompt_scored), min(end, request.num_prompt_tokens - 1)
        if top_k is None or first >= stop:
            return None, []
        request.num_prompt_scored = stop
        targets = PromptLogprobTargets(top_k, request.token_ids(first + 1, stop + 1),
                                       request.params.prompt_logprobs_temperature)
        return targets, list(range(first - start, stop - start))

    @staticmethod
    def _draws(request: Request, forks: int) -> list[SamplingRow]:
        """The request's next draw, and the first draws of `forks` sequences it forks into (seed + i)."""
        return [SamplingRow(params=request.params, seed=request.seed + i,
                            output_token_ids=request.output_token_ids if i == 0 else [],
                            prompt_token_ids=request.prompt_token_ids, banned_token_ids=request.banned_token_ids(),
                            key=request.serial if i == 0 else None,
                            token_index=request.num_output_tokens if i == 0 else 0)
                for i in range(1 + forks)]

    def fork(self, parent: Request, child: Request, drawn: bool = True) -> None:
        """Start `child` from `parent`'s state right after the prompt (`HybridCacheManager.fork`). A child whose
        first token was not drawn yet (`drawn` False), or that finds no free slot or page (or room under
        max_running_requests), waits and is recomputed, which the prefix cache makes cheap; its prompt is not
        scored twice."""
        child.num_cached_tokens, child.num_prompt_scored = parent.num_cached_tokens, parent.num_prompt_scored
        if drawn and len(self.running) < self.max_running and self.cache.fork(parent, child):
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        else:
            self.waiting.appendleft(child)
