"""Memory planner: splits the cache budget between KV pages, state slots and speculative intermediate states.

R = bytes left for caches (after weights and the activation peak of a profiling forward), P = state bytes per slot,
r = state_to_kv_ratio, rho = slots per running request (1 working slot + checkpoint headroom), D = draft tokens.
Unless the number of slots M is pinned, the state side gets B = R*r/(1+r) and must hold M slots plus D intermediate
states for each of the at most M/rho running requests: M*P + (M/rho)*D*P = B, so M = floor(B / (P*(1 + D/rho))).
The intermediate states actually reserved are I = P*D*min(max_running_requests, floor(M/rho)); the KV pool gets
R - I - M*P. When slots cannot hold prefix-cache checkpoints (prefix caching off, or a model whose checkpoints live
in page footers), no more slots than running requests are useful, and M is capped there.

KV groups (models with sliding-window layers, window W): the window group's pages hold only the keys a query can
still see. Running requests need at most m = N*(ceil((W-1)/page) + 1) + ceil(T/page) + N of them (N running
requests each keeping the W-1 keys before its next query, plus one step of T = max_num_batched_tokens new tokens,
which may start a page per request). Every window page in use sits beside a full page in use (same column, shared
the same way), so more window pages than full pages are never useful: the window group gets min(m, F) pages, where
F is what the full group gets from the rest, and the full group gets all the rest, bought at its own bytes per
token (F = (KV - window pages * window page bytes) // full page bytes). The prefix cache keeps window pages in the
window group's free room and loses them (least recently used first) when running requests need it.

`max_total_tokens` (SGLang's --max-total-tokens) caps the full group's tokens (and the window group's pages at as
many); the bytes above the cap stay unused, and a cap above what the budget holds is an error.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    num_pages: int  # usable pages (a dummy page comes on top)
    num_state_slots: int  # usable slots (a dummy slot comes on top)
    max_running_requests: int
    intermediate_bytes: int  # speculative intermediate states
    page_bytes: int
    slot_bytes: int
    num_window_pages: int = 0  # usable pages of the window group (sliding layers; a dummy page comes on top)
    window_page_bytes: int = 0
    min_window_pages: int = 0  # what the running requests may need of them at once
    max_total_tokens: int | None = None  # the cap on the full group's tokens that set num_pages, if any

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes + self.num_window_pages * self.window_page_bytes

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots * self.slot_bytes

    def describe(self, page_size: int) -> str:
        speculative = f" | speculative {_size(self.intermediate_bytes)}" if self.intermediate_bytes else ""
        window = ""
        if self.num_window_pages:
            window = (f" (full layers {_size(self.num_pages * self.page_bytes)}, sliding-window layers "
                      f"{_size(self.num_window_pages * self.window_page_bytes)} = {self.num_window_pages} pages: "
                      f"the running requests' windows and one step need at most {self.min_window_pages})")
        cap = ", capped by --max-total-tokens" if self.max_total_tokens is not None else ""
        return (f"cache budget {_size(self.budget_bytes)}: KV {_size(self.kv_bytes)} = "
                f"{self.num_pages * page_size} tokens ({self.num_pages} pages of {page_size}{cap}){window} | state "
                f"{_size(self.state_bytes)} = {self.num_state_slots} slots of {_size(self.slot_bytes)}{speculative}"
                f" | max running requests {self.max_running_requests}")


def _size(num_bytes: int) -> str:
    """GiB from 1 GiB up, MiB below (a small state pool would read 0.00 GiB)."""
    return f"{num_bytes / GiB:.2f} GiB" if num_bytes >= GiB else f"{num_bytes / MiB:.2f} MiB"


def min_window_pages(running: int, window: int, page_size: int, max_num_batched_tokens: int) -> int:
    """Window-group pages `running` requests may hold at once: the W-1 keys before each one's next query, and the
    pages of one step's new tokens."""
    return (running * (math.ceil((window - 1) / page_size) + 1) + math.ceil(max_num_batched_tokens / page_size)
            + running)


def plan_memory(budget_bytes: int, page_bytes: int, slot_bytes: int, *, max_running_requests: int,
                state_to_kv_ratio: float = 0.9, slots_per_request: int = 1, num_speculative_tokens: int = 0,
                max_state_slots: int | None = None, slots_hold_checkpoints: bool = False,
                window_page_bytes: int = 0, sliding_window: int | None = None, page_size: int = 1,
                max_num_batched_tokens: int = 0, max_total_tokens: int | None = None) -> MemoryPlan:
    """Solve the split; raise ValueError naming the knob to change when the configuration cannot work.

    With `window_page_bytes` (a window group for sliding-window layers of `sliding_window` keys) the KV bytes are
    split between the groups as the module docstring says. `max_total_tokens` (a multiple of `page_size`) caps the
    full group's tokens; the bytes it leaves stay unused."""
    rho, draft = slots_per_request, num_speculative_tokens
    if budget_bytes <= 0:
        raise ValueError("no memory is left for the caches after the weights and activations; raise "
                         "gpu_memory_utilization (or kv_cache_memory_bytes on CPU) or use a smaller model / dtype")
    if max_state_slots is not None:
        slots = max_state_slots
    else:
        state_budget = budget_bytes * state_to_kv_ratio / (1 + state_to_kv_ratio)
        slots = int(state_budget // (slot_bytes * (1 + draft / rho)))
        if not slots_hold_checkpoints:
            slots = min(slots, max_running_requests * rho)
    running = min(max_running_requests, slots // rho)
    if running < 1:
        spec = ", lower num_speculative_tokens" if draft else ""
        raise ValueError(f"{slots} state slots of {slot_bytes / MiB:.2f} MiB cannot serve one request (it needs "
                         f"{rho}); raise max_state_slots, state_to_kv_ratio or the memory budget "
                         f"(gpu_memory_utilization / kv_cache_memory_bytes){spec}")
    intermediate = slot_bytes * draft * running
    kv_bytes = budget_bytes - intermediate - slots * slot_bytes
    if kv_bytes < page_bytes:
        raise ValueError(f"after {slots} state slots ({slots * slot_bytes / GiB:.2f} GiB) and speculative states "
                         f"({intermediate / GiB:.2f} GiB) no memory is left for KV pages; lower max_state_slots, "
                         "state_to_kv_ratio or num_speculative_tokens, or raise the memory budget")
    plan = MemoryPlan(budget_bytes=budget_bytes, num_pages=int(kv_bytes // page_bytes), num_state_slots=slots,
                      max_running_requests=running, intermediate_bytes=intermediate, page_bytes=page_bytes,
                      slot_bytes=slot_bytes)
    if window_page_bytes:
        reserved = min_window_pages(running, sliding_window, page_size, max_num_batched_tokens)
        pages = int((kv_bytes - reserved * window_page_bytes) // page_bytes)
        window = reserved
        if pages < reserved:  # fewer full pages than that: one window page per full page is all the group can use
            pages = window = int(kv_bytes // (page_bytes + window_page_bytes))
        if pages < 1:
            raise ValueError(f"{_size(kv_bytes)} of KV memory cannot hold one page of the full layers and one of "
                             "the sliding-window layers; raise the memory budget (gpu_memory_utilization / "
                             "kv_cache_memory_bytes) or lower max_state_slots / state_to_kv_ratio")
        plan = dataclasses.replace(plan, num_pages=pages, num_window_pages=window,
                                   window_page_bytes=window_page_bytes, min_window_pages=reserved)
    return plan if max_total_tokens is None else _capped(plan, max_total_tokens, page_size)


def _capped(plan: MemoryPlan, max_total_tokens: int, page_size: int) -> MemoryPlan:
    """`plan` with its full group cut to `max_total_tokens` (SGLang's --max-total-tokens), and the window group to
    no more pages than that (more are never useful); a cap above what the budget holds cannot be honoured, so it is
    refused rather than lowered."""
    pages = max_total_tokens // page_size
    if pages > plan.num_pages:
        raise ValueError(f"max_total_tokens={max_total_tokens} (--max-total-tokens): the cache budget holds only "
                         f"{plan.num_pages * page_size} KV tokens ({plan.describe(page_size)}); lower it, or raise "
                         "the memory budget (gpu_memory_utilization / kv_cache_memory_bytes) or lower "
                         "max_state_slots / state_to_kv_ratio")
    return dataclasses.replace(plan, num_pages=pages, num_window_pages=min(plan.num_window_pages, pages),
                               max_total_tokens=max_total_tokens)
