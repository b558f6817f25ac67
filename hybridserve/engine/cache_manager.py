"""HybridCacheManager: who holds which KV page (both groups), state slot, checkpoint slot and device-table row.

The scheduler decides what runs; this module keeps the books of what that costs in the caches, so policy and
accounting can be read (and tested) apart. Every change a device must see is queued as a `CacheOps` entry and
handed to the next plan (`take`): a fork's copies made between steps run before the next forward, whatever it
schedules.

Prefix caching: on admission a request takes the longest usable cached prefix (its pages are shared, the path is
locked, and the state is copied into the request's own working slot before the forward: copy on hit). After each
step (`settle`) its newly cached positions are inserted: for per-page-state models every completed page, for
sparse models the snapshots the scheduler asked for. When pages or slots run out, unlocked cache entries are
evicted first; a caller that still finds none preempts (the scheduler's decision).

Sliding-window layers (a window KV group): a request holds window pages, column for column beside its full pages,
only where a current or future query can still see them. Both groups' pages for new tokens are allocated together;
after a step that leaves kv_len tokens, window pages before `window_first_page(kv_len)` are released (after the
completed pages went to the prefix cache, which keeps its own reference on them).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hybridserve.cache.kv_pool import PageAllocator, window_first_page
from hybridserve.cache.memory import MemoryPlan
from hybridserve.cache.prefix_cache import HybridPrefixCache, TreeNode
from hybridserve.cache.state_pool import SlotAllocator
from hybridserve.core.step import CacheOps
from hybridserve.engine.request import Request, RequestStatus


@dataclass
class Snapshot:
    """A checkpoint slot that receives a request's working state at `position` after the step's forward."""

    request: Request
    position: int
    slot: int
    void: bool = False  # the request gave back what it held before the step ran: only the slot is left


@dataclass
class StepCache:
    """One scheduled step's cache work: the device ops its plan carries, and what it holds in the prefix cache
    until it is processed (`HybridCacheManager.settle`)."""

    ops: CacheOps = field(default_factory=CacheOps)
    snapshots: list[Snapshot] = field(default_factory=list)  # checkpoints to insert once the step has run
    restore_locks: list[TreeNode] = field(default_factory=list)  # checkpoints the step restores from


class HybridCacheManager:
    def __init__(self, plan: MemoryPlan, page_size: int, prefix_caching: bool, per_page_state: bool = False,
                 sliding_window: int | None = None):
        """The allocators of the pools `plan` sized (a dummy page and slot on top), one device-table row per
        running request, and the prefix cache if `prefix_caching` (`per_page_state`: every page's footer holds
        its state, else checkpoints are sparse slots). `sliding_window`: the window group's window, if any."""
        self.page_size = page_size
        self.window = sliding_window
        self.pages = PageAllocator(plan.num_pages + 1)
        self.window_pages = PageAllocator(plan.num_window_pages + 1) if sliding_window is not None else None
        self.slots = SlotAllocator(plan.num_state_slots)
        self.prefix_cache = HybridPrefixCache(page_size, self.pages, self.slots, per_page_state, self.window_pages,
                                              sliding_window) if prefix_caching else None
        self.sparse = prefix_caching and not per_page_state  # checkpoints only where the scheduler snapshots
        self.num_rows = plan.max_running_requests
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0  # usable hits: KV and state both restored
        self.prefix_kv_match_tokens = 0  # attention KV matched, also beyond the deepest state checkpoint
        self._free_rows = list(range(self.num_rows - 1, -1, -1))
        self._holders: dict[int, Request] = {}  # by serial: the requests that hold pages, a slot and a row
        # by serial: the holders forked from one request (n > 1), which may share pages their own locks miss
        self._families: dict[int, list[Request]] = {}
        self._pending = StepCache()  # work for the next plan
        self._unsettled: dict[int, Snapshot] = {}  # by slot: checkpoints of scheduled steps not yet processed

    # --- taking and giving back ------------------------------------------------------------------------------
    def admit(self, request: Request, chunk_length: Callable[[Request], int]) -> bool:
        """Give a waiting request a working slot, a table row, the longest usable cached prefix and the pages of
        its first chunk (`chunk_length`, asked once the hit is known); or take nothing and return False. A request
        still scoring its prompt hits at most the positions already scored (the rest must be computed): none on
        its first admission, all it scored before a preemption on a later one."""
        slot = self._allocate_slot()
        if slot is None:
            return False
        hit = None
        limit = request.num_prompt_scored if request.scores_prompt else request.num_tokens - 1
        if self.prefix_cache is not None and not (request.scores_prompt and limit == 0):
            hit = self.prefix_cache.match(request.token_ids(0, request.num_tokens), max_tokens=limit)
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += hit.num_tokens
            self.prefix_kv_match_tokens += hit.kv_tokens
            self.pages.share(hit.pages)
            self.prefix_cache.lock(hit.node)
            request.page_ids, request.cache_node = list(hit.pages), hit.node
            if self.window_pages is not None:
                request.window_page_ids = list(hit.window_pages)
                request.window_start = window_first_page(hit.num_tokens, self.window, self.page_size)
                self.window_pages.share([p for p in hit.window_pages if p])
            request.num_computed_tokens = request.cached_len = hit.num_tokens
        if not self.reserve(request, chunk_length(request)):
            self._drop(request)  # the shared pages and the lock taken for the hit
            self.slots.release(slot)
            return False
        request.state_slot = slot
        self._take_row(request)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.num_tokens if hit else 0
        if hit is not None and hit.num_tokens:
            if hit.restore_slot is not None:
                self.prefix_cache.lock_state(hit.node)
                self._pending.restore_locks.append(hit.node)
                self._pending.ops.restores.append((hit.restore_slot, slot))
            else:
                self._pending.ops.page_restores.append((hit.pages[-1], slot))
        if self.sparse and hit is not None and hit.kv_tokens > hit.num_tokens:
            request.branch_point = hit.kv_tokens  # snapshot there, so the next request sharing it can hit
        return True

    def reserve(self, request: Request, count: int, evict: bool = True) -> bool:
        """Pages (both groups) for the request's next `count` tokens, evicting unlocked cache entries if needed
        (`evict`; else only from free pages); False and nothing taken when there are not enough."""
        needed = self._pages_needed(request, count)
        if not evict and (needed > self.pages.num_free or
                          (self.window_pages is not None and needed > self.window_pages.num_free)):
            return False
        pages = self._allocate_pages(needed)
        if pages is None:
            return False
        request.page_ids.extend(pages[0])
        request.window_page_ids.extend(pages[1])
        return True

    def fork(self, parent: Request, child: Request) -> bool:
        """Start `child` from `parent`'s state: full pages shared, the partly filled page (both groups) and the
        state slot copied before the next forward; False and nothing taken without a free slot or page."""
        full, partial = divmod(parent.num_computed_tokens, self.page_size)
        slot = self._allocate_slot()
        new = self._allocate_pages(1 if partial else 0) if slot is not None else None
        if new is None:
            if slot is not None:
                self.slots.release(slot)
            return False
        page, window = new
        ops = self._pending.ops
        self.pages.share(parent.page_ids[:full])
        child.page_ids = parent.page_ids[:full] + page
        if partial:
            ops.page_copies.append((parent.page_ids[full], page[0]))
        if self.window_pages is not None:
            self.window_pages.share([p for p in parent.window_page_ids[:full] if p])
            child.window_page_ids = parent.window_page_ids[:full] + window
            child.window_start = parent.window_start
            if partial:
                ops.window_page_copies.append((parent.window_page_ids[full], window[0]))
        ops.restores.append((parent.state_slot, slot))
        child.state_slot, child.num_computed_tokens = slot, parent.num_computed_tokens
        self._take_row(child)
        if full:  # they share pages (a parent preempted meanwhile holds none)
            family = self._families.setdefault(parent.serial, [parent])
            family.append(child)
            self._families[child.serial] = family
        if self.prefix_cache is not None:
            self.prefix_cache.lock(parent.cache_node)
            child.cache_node, child.cached_len = parent.cache_node, parent.cached_len
        return True

    def release(self, request: Request, cache_pages: bool = False) -> None:
        """Free everything the request holds (first caching its completed pages, if `cache_pages`); its computed
        length goes back to 0."""
        if cache_pages:
            self._cache_pages(request)
        for snapshot in self._unsettled.values():
            snapshot.void |= snapshot.request is request  # re-admitted before its step ran, it holds new pages
        self._holders.pop(request.serial, None)
        family = self._families.pop(request.serial, None)
        if family is not None:
            family.remove(request)
        self._drop(request)

    def accept(self, request: Request, computed: int) -> None:
        """A verify row's accepted tokens end at `computed`: the pages (both groups) beyond them go back, with the
        rejected drafts' KV."""
        request.num_computed_tokens = computed
        keep = -(-computed // self.page_size)
        if keep < len(request.page_ids):
            self._pending.ops.table_truncations.append((request.table_row, keep))
        self.pages.release(request.page_ids[keep:])
        del request.page_ids[keep:]
        if self.window_pages is not None:
            self.window_pages.release([p for p in request.window_page_ids[keep:] if p])
            del request.window_page_ids[keep:]

    def snapshot(self, request: Request, position: int) -> None:
        """Copy the working slot (the state at `position`) into a checkpoint slot after the forward, if one is
        free; the prefix cache takes it once the step has run."""
        checkpoint = self._allocate_slot()
        if checkpoint is not None:
            self._pending.ops.snapshots.append((request.state_slot, checkpoint))
            self._unsettled[checkpoint] = snapshot = Snapshot(request, position, checkpoint)
            self._pending.snapshots.append(snapshot)

    def take(self) -> StepCache:
        """The work queued since the last plan, for the step being scheduled."""
        taken, self._pending = self._pending, StepCache()
        return taken

    def settle(self, step: StepCache, requests: list[Request]) -> None:
        """After a step (with `requests`) has run: its checkpoints and completed pages go to the prefix cache, its
        restore locks are released and each running request's window pages out of every query's sight go back."""
        cache = self.prefix_cache
        for node in step.restore_locks:
            cache.unlock_state(node)
        if cache is not None:
            for snapshot in step.snapshots:
                del self._unsettled[snapshot.slot]
                if snapshot.void:  # finished or preempted while its step ran (overlapped scheduling)
                    self.slots.release(snapshot.slot)
                else:
                    self._insert(snapshot.request, snapshot.position, snapshot.slot)
            for request in requests:
                if request.status is RequestStatus.RUNNING:
                    self._cache_pages(request)
        if self.window_pages is not None:
            for request in requests:
                if request.status is RequestStatus.RUNNING:
                    self._release_window(request)

    # --- internals -------------------------------------------------------------------------------------------
    def _drop(self, request: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.unlock(request.cache_node)
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

    def _take_row(self, request: Request) -> None:
        """A device-table row for a new holder (the scheduler keeps at most `num_rows` running, so one is free)."""
        request.table_row = self._free_rows.pop()
        self._pending.ops.table_resets.append(request.table_row)
        self._holders[request.serial] = request

    def _allocate_pages(self, count: int) -> tuple[list[int], list[int]] | None:
        """`count` full pages and (window group) `count` window pages, or None and nothing taken."""
        pages = self.pages.allocate(count)
        if pages is None and self.prefix_cache is not None:
            self.prefix_cache.evict_pages(count - self.pages.num_free)
            pages = self.pages.allocate(count)
        if pages is None or self.window_pages is None:
            return None if pages is None else (pages, [])
        window = self.window_pages.allocate(count)
        if window is None and self.prefix_cache is not None:
            self.prefix_cache.evict_window_pages(count - self.window_pages.num_free)
            window = self.window_pages.allocate(count)
        if window is None:
            self.pages.release(pages)
            return None
        return pages, window

    def _allocate_slot(self) -> int | None:
        slot = self.slots.allocate()
        while slot is None and self.prefix_cache is not None and self.prefix_cache.evict_checkpoint():
            slot = self.slots.allocate()
        return slot

    def _pages_needed(self, request: Request, count: int) -> int:
        end = request.num_computed_tokens + count
        return max(0, -(-end // self.page_size) - len(request.page_ids))

    def _release_window(self, request: Request) -> None:
        """Release the window pages no current or future query of the request can see any more."""
        first = window_first_page(request.num_computed_tokens, self.window, self.page_size)
        if first > request.window_start:
            self.window_pages.release([p for p in request.window_page_ids[request.window_start:first] if p])
            request.window_page_ids[request.window_start:first] = [0] * (first - request.window_start)
            request.window_start = first

    def _cache_pages(self, request: Request) -> None:
        """Per-page-state models: cache every completed page (each carries its state footer)."""
        if self.prefix_cache is None or self.sparse:
            return
        full = min(request.num_computed_tokens, request.num_known_tokens) // self.page_size * self.page_size
        if full > request.cached_len:
            self._insert(request, full, None)

    def _insert(self, request: Request, position: int, checkpoint: int | None) -> None:
        """Cache the request's first `position` tokens under a lock it holds. The requests of its fork family
        that share leading pages with it hold those through a lock of their own (a page a running request holds
        is never evictable, and the request's lock ends when it does)."""
        pages = position // self.page_size
        window = request.window_page_ids[:pages] if self.window_pages is not None else None
        node = self.prefix_cache.insert(request.token_ids(0, position), request.page_ids[:pages], checkpoint, window)
        self.prefix_cache.lock(node)
        self.prefix_cache.unlock(request.cache_node)
        request.cache_node = node
        request.cached_len = max(request.cached_len, position)
        self._use_cached_pages(request, node)
        for holder in self._families.get(request.serial, ()):
            shared = self._shared_pages(holder, request.page_ids[:pages]) * self.page_size
            if holder is not request and shared > holder.cached_len:
                self._insert(holder, shared, None)

    @staticmethod
    def _shared_pages(request: Request, pages: list[int]) -> int:
        """How many of `pages` the request holds as its own leading pages."""
        count = 0
        for mine, theirs in zip(request.page_ids, pages):
            if mine != theirs:
                break
            count += 1
        return count

    def _use_cached_pages(self, request: Request, node: TreeNode) -> None:
        """Where the tree already held pages of the same tokens (the request computed them again: it scored its
        prompt, or another request inserted them meanwhile), the request takes the tree's pages, which its lock
        protects, and gives its own copies back; else it would hold both, and a tight pool could preempt it
        forever. The row's table is written again from the first column changed."""
        cached, cached_window = self.prefix_cache.path_pages(node)
        changed = [col for col, page in enumerate(cached) if request.page_ids[col] != page]
        for col in changed:
            self.pages.share([cached[col]])
            self.pages.release([request.page_ids[col]])
            request.page_ids[col] = cached[col]
            own = request.window_page_ids[col] if self.window_pages is not None else 0
            if own and cached_window[col] and own != cached_window[col]:
                self.window_pages.share([cached_window[col]])
                self.window_pages.release([own])
                request.window_page_ids[col] = cached_window[col]
        if changed:
            self._pending.ops.table_truncations.append((request.table_row, changed[0]))

    # --- bookkeeping -----------------------------------------------------------------------------------------
    @property
    def holders(self) -> list[Request]:
        return list(self._holders.values())

    def counts(self) -> dict[str, int]:
        """Free / evictable (held only by the prefix cache) / protected (in use) pages and slots. Cheap: kept by
        counters; `check` recounts everything and checks free + evictable + protected == total. With a window
        group also its total, free and cached (held by the prefix cache, maybe also by requests) pages."""
        cache = self.prefix_cache
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

    def check(self) -> None:
        """Recount who holds every page, slot and row; raise on a leak, a double count or a drifted counter."""
        holders = self.holders
        request_pages = {p for r in holders for p in r.page_ids}
        working = [r.state_slot for r in holders]
        tree_pages, tree_locked, checkpoints, locked_checkpoints, tree_window = set(), set(), 0, 0, []
        if self.prefix_cache is not None:
            tree_pages, tree_locked, checkpoints, locked_checkpoints, tree_window = self.prefix_cache.recount()
        recounted = {
            "pages_evictable": len(tree_pages - tree_locked - request_pages),
            "pages_protected": len(request_pages | tree_locked),
            "slots_evictable": checkpoints - locked_checkpoints,
            "slots_protected": len(set(working)) + locked_checkpoints + len(self._unsettled),
        }
        counts = self.counts()
        for kind in ("pages", "slots"):
            parts = counts[f"{kind}_free"] + recounted[f"{kind}_evictable"] + recounted[f"{kind}_protected"]
            if parts != counts[f"{kind}_total"] or len(working) != len(set(working)) or None in working:
                raise RuntimeError(f"{kind} accounting broken: free + evictable + protected = {parts}, total "
                                   f"{counts[f'{kind}_total']} ({recounted}, {counts})")
        rows = [r.table_row for r in holders]
        if any(self._holders.get(r.serial) is not r for family in self._families.values() for r in family):
            raise RuntimeError("a fork family lists a request that no longer holds anything")
        if sorted(rows + self._free_rows) != list(range(self.num_rows)):
            raise RuntimeError(f"device-table rows broken: held {rows}, free {self._free_rows}")
        if self.window_pages is not None:
            self._check_window(holders, tree_window)
            recounted["window_pages_cached"] = len(tree_window)
        drifted = {k: (v, counts[k]) for k, v in recounted.items() if counts[k] != v}
        if drifted:
            raise RuntimeError(f"resource counters drifted from a recount (recount, counter): {drifted}")

    def _check_window(self, holders: list[Request], tree_window: list[int]) -> None:
        """The window group: every page's reference count equals its holders (requests and prefix-cache nodes),
        the free list holds exactly the pages nobody holds, and each request holds a column's window page exactly
        from its window start on."""
        counted = [0] * (self.window_pages.capacity + 1)
        for request in holders:
            held = request.window_page_ids
            if (len(held) != len(request.page_ids) or any(held[:request.window_start])
                    or not all(held[request.window_start:])):
                raise RuntimeError(f"request {request.request_id}: window pages {held} do not match its "
                                   f"{len(request.page_ids)} pages from window start {request.window_start}")
            for page in held[request.window_start:]:
                counted[page] += 1
        for page in tree_window:
            counted[page] += 1
        wrong = [p for p in range(1, len(counted)) if counted[p] != self.window_pages.refcount(p)]
        if wrong or counted.count(0) - 1 != self.window_pages.num_free:
            raise RuntimeError(f"window-group accounting broken: pages {wrong[:8]} have other reference counts than "
                               f"holders; {counted.count(0) - 1} unheld, {self.window_pages.num_free} free")
