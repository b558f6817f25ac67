"""Scheduler: FCFS continuous batching under the KV-page and state-slot budgets, with hybrid prefix caching.

Every step runs the running requests first (a decode token, or the next chunk of a prompt) and then admits waiting
requests in arrival order while the token budget, the running-request cap, pages and slots allow. Prefill chunks
and decode rows share one forward. A chunk never crosses a state-snapshot position, so a snapshot is simply the
working state at a chunk end (copied into a fresh checkpoint slot after the forward).

Prefix caching: on admission a request takes the longest usable cached prefix (its pages are shared, the path is
locked, and the state is copied into the request's own working slot before the forward: copy on hit). After each
step its newly cached positions are inserted: for per-page-state models every completed page, for sparse models the
snapshots taken at the end of the prompt (the last page boundary before it), every `checkpoint_interval` tokens and
at branch points. When pages or slots run out, unlocked cache entries are evicted first; then the most recently
admitted running request is preempted (everything it holds is freed and it is recomputed later).

Speculative decoding (`speculation`): a running request's decode row also carries the drafts its draft source
proposes (a verify row: its last drawn token, then up to k drafts, with a draw at every position; the row's
intermediate state slots receive the states after the drafts). Drafts never reach past max_tokens or the context
length, and never past a sparse snapshot position (a checkpoint is only ever taken from a verified state). Once the
step is processed, `accept_drafts` sets the row's computed length to the accepted tokens and returns the pages
only the rejected drafts used.

Sliding-window layers (a window KV group): a request holds window pages, column for column beside its full pages,
only where a current or future query can still see them. Both groups' pages for new tokens are allocated together;
after a step that leaves kv_len tokens, window pages before `window_first_page(kv_len)` are released (after the
completed pages went to the prefix cache, which keeps its own reference on them).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridserve.cache.kv_pool import PageAllocator, window_first_page
from hybridserve.cache.prefix_cache import HybridPrefixCache, TreeNode
from hybridserve.cache.state_pool import SlotAllocator
from hybridserve.core.batch import FUTURE_TOKEN, ScheduledChunk
from hybridserve.core.step import PromptLogprobTargets, SamplingRow, StepPlan
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.spec.drafts import Speculation

# Prompt-logprob chunks produce [tokens, vocab] fp32 logits; this bounds them per step, across all requests.
PROMPT_LOGPROB_TOKENS_PER_STEP = 512


@dataclass
class ScheduledStep:
    plan: StepPlan
    requests: list[Request]  # the request behind each chunk of the plan
    scoring_left: int  # prompt tokens this step may still score
    snapshots: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, position, slot) to cache
    state_locked: list[TreeNode] = field(default_factory=list)  # checkpoints restored in this step
    fork_draws: int = 0  # sequences forked off in this step (each takes a running place after it)
    num_draws: int = 0  # sampling rows so far, in plan order
    forks: bool = False  # a prompt forks into n > 1 sequences when this step's draws are processed


class Scheduler:
    def __init__(self, pages: PageAllocator, slots: SlotAllocator, page_size: int, max_running_requests: int,
                 max_num_batched_tokens: int, chunked_prefill_size: int | None = None,
                 prefix_cache: HybridPrefixCache | None = None, checkpoint_interval: int | None = None,
                 window_pages: PageAllocator | None = None, sliding_window: int | None = None,
                 max_model_len: int | None = None,
                 speculation: Speculation | None = None):
        if (window_pages is None) != (sliding_window is None):
            raise ValueError("a window group needs both its page allocator and the sliding window")
        self.pages = pages
        self.window_pages = window_pages  # the window group's allocator (None without sliding layers)
        self.window = sliding_window
        self.slots = slots
        self.page_size = page_size
        self.max_running = max_running_requests
        self.max_tokens = max_num_batched_tokens
        self.chunk_cap = chunked_prefill_size or max_num_batched_tokens
        self.scoring_per_step = PROMPT_LOGPROB_TOKENS_PER_STEP
        self.cache = prefix_cache
        self.sparse = prefix_cache is not None and not prefix_cache.per_page_state
        self.checkpoint_interval = checkpoint_interval
        self.max_model_len = max_model_len if max_model_len is not None else float("inf")
        self.speculation = speculation
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0  # usable hits: KV and state both restored
        self.prefix_kv_match_tokens = 0  # attention KV matched, also beyond the deepest state checkpoint
        # Copies a fork needs before the next forward (whatever that step schedules), and the table rows handed
        # to new sequences since the last plan.
        self._pending_page_copies: list[tuple[int, int]] = []
        self._pending_window_copies: list[tuple[int, int]] = []
        self._pending_restores: list[tuple[int, int]] = []
        self._pending_row_resets: list[int] = []
        self._pending_truncations: list[tuple[int, int]] = []
        self._free_rows = list(range(max_running_requests - 1, -1, -1))  # running sequences <= max_running
        self._unsettled_checkpoints: set[int] = set()  # snapshot slots of scheduled steps not yet processed

    # --- queue management ------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Retire a request (finished or aborted) wherever it is, caching what it computed and freeing the rest."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            if reason != "abort":
                self._cache_pages(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason

    def _free(self, request: Request) -> None:
        if self.cache is not None:
            self.cache.unlock(request.cache_node)
        request.cache_node = None
        self.pages.release(request.page_ids)
        request.page_ids = []
        if self.window_pages is not None:
            self.window_pages.release([p for p in request.window_page_ids[request.window_start:] if p])
            request.window_page_ids, request.window_start = [], 0
        if request.state_slot is not None:
            self.slots.release(request.state_slot)
            request.state_slot = None
        if request.table_row is not None:
            self._free_rows.append(request.table_row)
            request.table_row = None
        request.num_computed_tokens = request.cached_len = request.branch_point = 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # --- allocation with eviction ----------------------------------------------------------------------------
    def _allocate_pages(self, count: int) -> tuple[list[int], list[int]] | None:
        """`count` full pages and (window group) `count` window pages, or None and nothing taken."""
        pages = self.pages.allocate(count)
        if pages is None and self.cache is not None:
            self.cache.evict_pages(count - self.pages.num_free)
            pages = self.pages.allocate(count)
        if pages is None or self.window_pages is None:
            return None if pages is None else (pages, [])
        window = self.window_pages.allocate(count)
        if window is None and self.cache is not None:
            self.cache.evict_window_pages(count - self.window_pages.num_free)
            window = self.window_pages.allocate(count)
        if window is None:
            self.pages.release(pages)
            return None
        return pages, window

    def _release_window(self, request: Request) -> None:
        """Release the window pages no current or future query of the request can see any more."""
        first = window_first_page(request.num_computed_tokens, self.window, self.page_size)
        if first > request.window_start:
            self.window_pages.release([p for p in request.window_page_ids[request.window_start:first] if p])
            request.window_page_ids[request.window_start:first] = [0] * (first - request.window_start)
            request.window_start = first

    def _take_row(self) -> int:
        """A device-table row; callers check `max_running` first, so one is always free."""
        return self._free_rows.pop()

    def _allocate_slot(self) -> int | None:
        slot = self.slots.allocate()
        while slot is None and self.cache is not None and self.cache.evict_checkpoint():
            slot = self.slots.allocate()
        return slot

    # --- one step --------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        step = ScheduledStep(StepPlan(chunks=[], samples=[], prompt_logprobs=[],
                                      page_copies=self._pending_page_copies, restores=self._pending_restores,
                                      table_resets=self._pending_row_resets), [], scoring_left=self.scoring_per_step)
        step.plan.window_page_copies = self._pending_window_copies
        step.plan.table_truncations = self._pending_truncations
        self._pending_page_copies, self._pending_restores, self._pending_row_resets = [], [], []
        self._pending_window_copies, self._pending_truncations = [], []
        budget = self.max_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING or self._ends_with_pending(request):
                continue  # preempted earlier in this loop, or its token in flight is its last
            count = self._chunk_length(request, budget, step)
            drafts = self._propose(request, budget) if count == 1 else []
            if count == 0 or not self._reserve_pages(request, count + len(drafts), preempt=True):
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
            # Nothing to run, so nothing can overwrite a fork's source yet: keep its copies for the next plan.
            self._pending_page_copies, self._pending_restores = step.plan.page_copies, step.plan.restores
            self._pending_window_copies = step.plan.window_page_copies
            self._pending_row_resets = step.plan.table_resets
            self._pending_truncations = step.plan.table_truncations
            return None
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
        needed = self._pages_needed(request, min(target, self.max_model_len) - start)
        if needed and needed <= self.pages.num_free and (self.window_pages is None or
                                                         needed <= self.window_pages.num_free):
            pages, window = self._allocate_pages(needed)
            request.page_ids.extend(pages)
            request.window_page_ids.extend(window)

    def accept_drafts(self, request: Request, start: int, accepted: int) -> None:
        """A verify row that started at `start` kept its first token and `accepted` drafts: only their positions
        count as computed, and the pages (both groups) beyond them go back, with the rejected drafts' KV."""
        request.num_computed_tokens = start + 1 + accepted
        keep = -(-request.num_computed_tokens // self.page_size)
        if keep < len(request.page_ids):
            self._pending_truncations.append((request.table_row, keep))
        self.pages.release(request.page_ids[keep:])
        del request.page_ids[keep:]
        if self.window_pages is not None:
            self.window_pages.release([p for p in request.window_page_ids[keep:] if p])
            del request.window_page_ids[keep:]

    def _next_snapshot(self, request: Request, done: int) -> int | None:
        """The first position after `done` where a sparse checkpoint must be taken, if any."""
        size = self.page_size
        candidates = [request.branch_point, (request.num_prompt_tokens - 1) // size * size]
        if self.checkpoint_interval:
            candidates.append((done // self.checkpoint_interval + 1) * self.checkpoint_interval)
        later = [c for c in candidates if c > done]
        return min(later) if later else None

    @staticmethod
    def _scores_prompt(request: Request) -> bool:
        return request.params.prompt_logprobs is not None and request.num_prompt_scored < request.num_prompt_tokens - 1

    def _chunk_length(self, request: Request, budget: int, step: ScheduledStep) -> int:
        cap = min(self.chunk_cap, step.scoring_left) if self._scores_prompt(request) else self.chunk_cap
        count = min(request.num_tokens - request.num_computed_tokens, budget, cap)
        if self.sparse:
            snapshot = self._next_snapshot(request, request.num_computed_tokens)
            if snapshot is not None:
                count = min(count, snapshot - request.num_computed_tokens)
        return count

    def _pages_needed(self, request: Request, count: int) -> int:
        end = request.num_computed_tokens + count
        return max(0, -(-end // self.page_size) - len(request.page_ids))

    def _reserve_pages(self, request: Request, count: int, preempt: bool) -> bool:
        """Give the request the pages for its next `count` tokens; a running request may preempt newer ones
        (`preempt`), an admission never does."""
        needed = self._pages_needed(request, count)
        while True:
            pages = self._allocate_pages(needed)
            if pages is not None:
                request.page_ids.extend(pages[0])
                request.window_page_ids.extend(pages[1])
                return True
            if not preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False

    def _admit(self, step: ScheduledStep, request: Request, budget: int) -> bool:
        """Take a working slot and the prefix-cache hit, or leave everything untouched and return False. A request
        preempted with a token in flight waits until that token is on the host (its prefix is matched by value)."""
        if request.num_pending or self._chunk_length(request, budget, step) == 0:
            return False
        slot = self._allocate_slot()
        if slot is None:
            return False
        hit = None
        if self.cache is not None and request.params.prompt_logprobs is None:  # scoring needs every position
            hit = self.cache.match(request.token_ids(0, request.num_tokens), max_tokens=request.num_tokens - 1)
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += hit.num_tokens
            self.prefix_kv_match_tokens += hit.kv_tokens
            self.pages.share(hit.pages)
            self.cache.lock(hit.node)
            request.page_ids, request.cache_node = list(hit.pages), hit.node
            if self.window_pages is not None:
                request.window_page_ids = list(hit.window_pages)
                request.window_start = window_first_page(hit.num_tokens, self.window, self.page_size)
                self.window_pages.share([p for p in hit.window_pages if p])
            request.num_computed_tokens = request.cached_len = hit.num_tokens
        if not self._reserve_pages(request, self._chunk_length(request, budget, step), preempt=False):
            self._free(request)  # drops the shared pages and the lock taken for the hit
            self.slots.release(slot)
            return False
        request.state_slot = slot
        request.table_row = self._take_row()
        step.plan.table_resets.append(request.table_row)
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.num_tokens if hit else 0
        if hit is not None and hit.num_tokens:
            if hit.restore_slot is not None:
                self.cache.lock_state(hit.node)
                step.state_locked.append(hit.node)
                step.plan.restores.append((hit.restore_slot, slot))
            else:
                step.plan.page_restores.append((hit.pages[-1], slot))
        if self.sparse and hit is not None and hit.kv_tokens > hit.num_tokens:
            request.branch_point = hit.kv_tokens  # snapshot there, so the next request sharing it can hit
        self.running.append(request)
        return True

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
        if self._scores_prompt(request):
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
            window_page_ids=request.window_page_ids if self.window_pages is not None else None,
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
            self._snapshot(step, request, end)
        return count + forks

    def _snapshot(self, step: ScheduledStep, request: Request, position: int) -> None:
        """Copy the working slot (the state at `position`) into a checkpoint slot after the forward, if one is free."""
        checkpoint = self._allocate_slot()
        if checkpoint is not None:
            step.plan.snapshots.append((request.state_slot, checkpoint))
            step.snapshots.append((request, position, checkpoint))
            self._unsettled_checkpoints.add(checkpoint)

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
            window_page_ids=request.window_page_ids if self.window_pages is not None else None,
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
            self._snapshot(step, request, start + 1)
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
        """Start `child` from `parent`'s state right after the prompt: full pages are shared, the partly filled
        page and the state slot are copied before the next forward. A child whose first token was not drawn yet
        (`drawn` False), or that finds no free slot or page (or room under max_running_requests), waits and is
        recomputed, which the prefix cache makes cheap; its prompt is not scored twice."""
        child.num_cached_tokens, child.num_prompt_scored = parent.num_cached_tokens, parent.num_prompt_scored
        size = self.page_size
        full, partial = divmod(parent.num_computed_tokens, size)
        slot = self._allocate_slot() if drawn and len(self.running) < self.max_running else None
        new = self._allocate_pages(1 if partial else 0) if slot is not None else None
        if new is None:
            if slot is not None:
                self.slots.release(slot)
            self.waiting.appendleft(child)
            return
        page, window = new
        self.pages.share(parent.page_ids[:full])
        child.page_ids = parent.page_ids[:full] + page
        if partial:
            self._pending_page_copies.append((parent.page_ids[full], page[0]))
        if self.window_pages is not None:
            self.window_pages.share([p for p in parent.window_page_ids[:full] if p])
            child.window_page_ids = parent.window_page_ids[:full] + window
            child.window_start = parent.window_start
            if partial:
                self._pending_window_copies.append((parent.window_page_ids[full], window[0]))
        self._pending_restores.append((parent.state_slot, slot))
        child.state_slot, child.num_computed_tokens = slot, parent.num_computed_tokens
        child.table_row = self._take_row()
        self._pending_row_resets.append(child.table_row)
        if self.cache is not None:
            self.cache.lock(parent.cache_node)
            child.cache_node, child.cached_len = parent.cache_node, parent.cached_len
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    # --- after the step has run --------------------------------------------------------------------------------
    def after_step(self, step: ScheduledStep) -> None:
        """Hand this step's checkpoints and completed pages to the prefix cache; release restore locks."""
        for node in step.state_locked:
            self.cache.unlock_state(node)
        if self.cache is not None:
            for request, position, checkpoint in step.snapshots:
                self._unsettled_checkpoints.discard(checkpoint)
                if request.status is RequestStatus.RUNNING:
                    self._insert(request, position, checkpoint)
                else:  # finished or preempted while its step ran (overlapped scheduling): its pages are gone
                    self.slots.release(checkpoint)
            if not self.sparse:
                for request in step.requests:
                    if request.status is RequestStatus.RUNNING:
                        self._cache_pages(request)
        if self.window_pages is not None:
            for request in step.requests:
                if request.status is RequestStatus.RUNNING:
                    self._release_window(request)

    def _cache_pages(self, request: Request) -> None:
        """Per-page-state models: cache every completed page (each carries its state footer)."""
        if self.cache is None or self.sparse:
            return
        full = min(request.num_computed_tokens, request.num_known_tokens) // self.page_size * self.page_size
        if full > request.cached_len:
            self._insert(request, full, None)

    def _insert(self, request: Request, position: int, checkpoint: int | None) -> None:
        pages = position // self.page_size
        window = request.window_page_ids[:pages] if self.window_pages is not None else None
        node = self.cache.insert(request.token_ids(0, position), request.page_ids[:pages], checkpoint, window)
        self.cache.lock(node)
        self.cache.unlock(request.cache_node)
        request.cache_node = node
        request.cached_len = max(request.cached_len, position)

    # --- bookkeeping --------------------------------------------------------------------------------------------
    def resource_counts(self) -> dict[str, int]:
        """Free / evictable (held only by the prefix cache) / protected (in use) pages and slots. Cheap: kept by
        counters; `check_resources` recounts everything and checks free + evictable + protected == total. With
        a window group also its total, free and cached (held by the prefix cache, maybe also by requests) pages."""
        cache = self.cache
        pages_evictable = cache.num_pages - cache.num_locked_pages if cache else 0
        slots_evictable = cache.num_checkpoints - cache.num_locked_checkpoints if cache else 0
        counts = {
            "pages_total": self.pages.capacity, "pages_free": self.pages.num_free, "pages_evictable": pages_evictable,
            "pages_protected": self.pages.capacity - self.pages.num_free - pages_evictable,
            "slots_total": self.slots.capacity, "slots_free": self.slots.num_free, "slots_evictable": slots_evictable,
            "slots_protected": self.slots.capacity - self.slots.num_free - slots_evictable,
        }
        if self.window_pages is not None:
            counts.update(window_pages_total=self.window_pages.capacity, window_pages_free=self.window_pages.num_free,
                          window_pages_cached=cache.num_window_pages if cache else 0)
        return counts

    def check_resources(self) -> None:
        """Recount who holds every page and slot; raise on a leak, a double count or a drifted counter."""
        request_pages = {p for r in self.running for p in r.page_ids}
        working = [r.state_slot for r in self.running if r.state_slot is not None]
        tree_pages, tree_locked, checkpoints, locked_checkpoints, tree_window = set(), set(), 0, 0, []
        if self.cache is not None:
            tree_pages, tree_locked, checkpoints, locked_checkpoints, tree_window = self.cache.recount()
        recounted = {
            "pages_evictable": len(tree_pages - tree_locked - request_pages),
            "pages_protected": len(request_pages | tree_locked),
            "slots_evictable": checkpoints - locked_checkpoints,
            "slots_protected": len(set(working)) + locked_checkpoints + len(self._unsettled_checkpoints),
        }
        counts = self.resource_counts()
        for kind in ("pages", "slots"):
            parts = counts[f"{kind}_free"] + recounted[f"{kind}_evictable"] + recounted[f"{kind}_protected"]
            if parts != counts[f"{kind}_total"] or len(working) != len(set(working)):
                raise RuntimeError(f"{kind} accounting broken: free + evictable + protected = {parts}, total "
                                   f"{counts[f'{kind}_total']} ({recounted}, {counts})")
        rows = [r.table_row for r in self.running]
        if sorted(rows + self._free_rows) != list(range(self.max_running)):
            raise RuntimeError(f"device-table rows broken: running {rows}, free {self._free_rows}")
        if self.window_pages is not None:
            self._check_window(tree_window)
            recounted["window_pages_cached"] = len(tree_window)
        drifted = {k: (v, counts[k]) for k, v in recounted.items() if counts[k] != v}
        if drifted:
            raise RuntimeError(f"resource counters drifted from a recount (recount, counter): {drifted}")

    def _check_window(self, tree_window: list[int]) -> None:
        """The window group: every page's reference count equals its holders (requests and prefix-cache nodes),
        the free list holds exactly the pages nobody holds, and each request holds a column's window page exactly
        from its window start on."""
        holders = [0] * (self.window_pages.capacity + 1)
        for request in self.running:
            held = request.window_page_ids
            if (len(held) != len(request.page_ids) or any(held[:request.window_start])
                    or not all(held[request.window_start:])):
                raise RuntimeError(f"request {request.request_id}: window pages {held} do not match its "
                                   f"{len(request.page_ids)} pages from window start {request.window_start}")
            for page in held[request.window_start:]:
                holders[page] += 1
        for page in tree_window:
            holders[page] += 1
        wrong = [p for p in range(1, len(holders)) if holders[p] != self.window_pages.refcount(p)]
        if wrong or holders.count(0) - 1 != self.window_pages.num_free:
            raise RuntimeError(f"window-group accounting broken: pages {wrong[:8]} have other reference counts than "
                               f"holders; {holders.count(0) - 1} unheld, {self.window_pages.num_free} free")
