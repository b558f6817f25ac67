"""Scheduler: FCFS continuous batching under the KV-page and state-slot budgets.

Every step runs the running requests first (a decode token, or the next chunk of a prompt) and then admits waiting
requests in arrival order while the token budget, the running-request cap, pages and slots allow; a prompt that
does not fit the remaining token budget is split into chunks. Prefill chunks and decode rows share one forward.
When a running request needs a page and none is free, the most recently admitted request is preempted: its pages
and slot are freed and it goes back to the front of the queue, to be recomputed later.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridserve.cache.kv_pool import PageAllocator
from hybridserve.cache.state_pool import SlotAllocator
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.layers.sampler import SamplingRow
from hybridserve.runtime.batch import ScheduledChunk
from hybridserve.runtime.step import StepPlan


@dataclass
class ScheduledStep:
    plan: StepPlan
    requests: list[Request]  # the request behind each chunk of the plan


class Scheduler:
    def __init__(self, pages: PageAllocator, slots: SlotAllocator, page_size: int, max_running_requests: int,
                 max_num_batched_tokens: int):
        self.pages = pages
        self.slots = slots
        self.page_size = page_size
        self.max_running = max_running_requests
        self.max_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # --- queue management ------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Retire a request (finished or aborted) wherever it is, returning its pages and slot."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason

    def _free(self, request: Request) -> None:
        self.pages.release(request.page_ids)
        request.page_ids = []
        if request.state_slot is not None:
            self.slots.release(request.state_slot)
            request.state_slot = None
        request.num_computed_tokens = 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # --- one step --------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        step = ScheduledStep(StepPlan(chunks=[], samples=[]), [])
        budget = self.max_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_pages(request, count, preempt=True):
                continue
            self._add_chunk(step, request, count)
            budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            count = min(request.num_tokens, budget)
            if not self._admit(request, count):
                break
            self.waiting.popleft()
            self._add_chunk(step, request, count)
            budget -= count
        return step if step.requests else None

    def _pages_needed(self, request: Request, count: int) -> int:
        end = request.num_computed_tokens + count
        return max(0, -(-end // self.page_size) - len(request.page_ids))

    def _reserve_pages(self, request: Request, count: int, preempt: bool) -> bool:
        """Give the request the pages for its next `count` tokens, preempting newer requests if allowed."""
        needed = self._pages_needed(request, count)
        while True:
            pages = self.pages.allocate(needed)
            if pages is not None:
                request.page_ids.extend(pages)
                return True
            if not preempt or not self.running:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False

    def _admit(self, request: Request, count: int) -> bool:
        slot = self.slots.allocate()
        if slot is None:
            return False
        if not self._reserve_pages(request, count, preempt=False):
            self.slots.release(slot)
            return False
        request.state_slot = slot
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def _add_chunk(self, step: ScheduledStep, request: Request, count: int) -> None:
        plan = step.plan
        step.requests.append(request)
        start = request.num_computed_tokens
        completes = start + count == request.num_tokens
        plan.chunks.append(ScheduledChunk(
            token_ids=request.token_ids(start, start + count),
            prefix_len=start,
            page_ids=list(request.page_ids),
            state_slot=request.state_slot,
            has_initial_state=start > 0,
            logits_offsets=[count - 1] if completes else [],
        ))
        plan.samples.append(SamplingRow(
            params=request.params, seed=request.seed, output_token_ids=request.output_token_ids,
            prompt_token_ids=request.prompt_token_ids, banned_token_ids=request.banned_token_ids(),
        ) if completes else None)
        request.num_computed_tokens = start + count

    # --- bookkeeping --------------------------------------------------------------------------------------------
    def resource_counts(self) -> dict[str, int]:
        return {"pages_free": self.pages.num_free, "pages_total": self.pages.capacity,
                "slots_free": self.slots.num_free, "slots_total": self.slots.capacity}
