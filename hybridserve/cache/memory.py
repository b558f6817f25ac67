"""Splits the cache budget between the paged KV pool and the recurrent-state pool."""
from __future__ import annotations

from dataclasses import dataclass

from hybridserve.cache.kv_pool import KVCacheSpec
from hybridserve.cache.state_pool import StateSpec

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    num_pages: int  # including the dummy page 0
    num_state_slots: int  # usable slots (the dummy slot 0 comes on top)
    page_bytes: int
    slot_bytes: int

    def describe(self, page_size: int) -> str:
        kv = (self.num_pages - 1) * self.page_bytes
        state = self.num_state_slots * self.slot_bytes
        return (f"KV cache {kv / GiB:.3f} GiB = {(self.num_pages - 1) * page_size} tokens "
                f"({self.num_pages - 1} pages of {page_size}); state {state / GiB:.3f} GiB = "
                f"{self.num_state_slots} slots of {self.slot_bytes / (1 << 20):.3f} MiB")


def plan_memory(budget_bytes: int, kv_spec: KVCacheSpec, state_spec: StateSpec, page_size: int,
                max_running_requests: int, max_state_slots: int | None, state_to_kv_ratio: float = 0.9) -> MemoryPlan:
    """State gets budget * r / (1 + r) (at most one slot per running request) unless pinned; KV gets the rest."""
    page_bytes = kv_spec.bytes_per_token() * page_size
    slot_bytes = state_spec.bytes_per_slot()
    if max_state_slots is None:
        share = int(budget_bytes * state_to_kv_ratio / (1 + state_to_kv_ratio))
        slots = min(share // slot_bytes, max_running_requests)
    else:
        slots = max_state_slots
    kv_bytes = budget_bytes - (slots + 1) * slot_bytes
    pages = kv_bytes // page_bytes
    if slots < 1:
        raise ValueError(f"the cache budget of {budget_bytes / GiB:.3f} GiB cannot hold one state slot of "
                         f"{slot_bytes / (1 << 20):.2f} MiB; raise kv_cache_memory_bytes / gpu_memory_utilization")
    if pages < 2:
        raise ValueError(f"after {slots} state slots the cache budget leaves no room for KV pages; raise "
                         "kv_cache_memory_bytes / gpu_memory_utilization or lower max_state_slots")
    return MemoryPlan(num_pages=pages, num_state_slots=slots, page_bytes=page_bytes, slot_bytes=slot_bytes)
