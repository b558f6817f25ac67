"""The hybrid radix tree on its own: matching rules, splits, dedup, locks, LRU eviction and accounting."""
from __future__ import annotations

import pytest

from hybridserve.cache.kv_pool import PageAllocator
from hybridserve.cache.prefix_cache import HybridPrefixCache
from hybridserve.cache.state_pool import SlotAllocator

P = 4  # page size


def _cache(per_page: bool, pages: int = 64, slots: int = 16):
    allocator, slot_allocator = PageAllocator(pages), SlotAllocator(slots)
    return HybridPrefixCache(P, allocator, slot_allocator, per_page), allocator, slot_allocator


def _store(cache, allocator, tokens, checkpoint=None):
    """Insert as a finished request would: its own pages, then it lets go of them."""
    pages = allocator.allocate(len(tokens) // P)
    node = cache.insert(tokens, pages, checkpoint)
    allocator.release(pages)
    return node


def _assert_accounting(cache, allocator, slot_allocator, request_pages=0, request_slots=0):
    held, locked, checkpoints, locked_checkpoints, _ = cache.recount()
    assert (cache.num_pages, cache.num_locked_pages) == (len(held), len(locked))
    assert (cache.num_checkpoints, cache.num_locked_checkpoints) == (checkpoints, locked_checkpoints)
    assert allocator.num_free + len(held) + request_pages == allocator.capacity
    assert slot_allocator.num_free + checkpoints + request_slots == slot_allocator.capacity


def test_per_page_hits_any_full_page_match_up_to_the_cap():
    cache, allocator, slots = _cache(per_page=True)
    seq = list(range(1, 13))  # 3 pages
    _store(cache, allocator, seq)
    assert cache.match(seq + [99], max_tokens=12).num_tokens == 12
    assert cache.match(seq, max_tokens=11).num_tokens == 8  # at least one token must be recomputed
    partial = cache.match(seq[:6] + [77, 78, 79], max_tokens=100)
    assert (partial.num_tokens, len(partial.pages)) == (4, 1)
    assert cache.match([5] + seq[1:], max_tokens=100).num_tokens == 0
    _assert_accounting(cache, allocator, slots)


def test_sparse_hits_stop_at_the_deepest_checkpoint_and_report_the_branch_point():
    cache, allocator, slots = _cache(per_page=False)
    seq = list(range(1, 17))  # 4 pages
    ckpt = slots.allocate()
    _store(cache, allocator, seq[:8], ckpt)
    _store(cache, allocator, seq, slots.allocate())
    hit = cache.match(seq[:12] + [50, 51, 52, 53], max_tokens=100)
    assert (hit.num_tokens, hit.restore_slot, hit.kv_tokens) == (8, ckpt, 12)
    assert len(hit.pages) == 2
    full = cache.match(seq + [1], max_tokens=16)
    assert full.num_tokens == 16 and full.restore_slot not in (None, ckpt)
    _assert_accounting(cache, allocator, slots, request_slots=0)


def test_split_keeps_the_checkpoint_below_and_duplicates_are_not_taken():
    cache, allocator, slots = _cache(per_page=False)
    seq = list(range(1, 13))
    low = slots.allocate()
    _store(cache, allocator, seq, low)
    branch = slots.allocate()
    node = _store(cache, allocator, seq[:8], branch)  # splits the 3-page node after 2 pages
    assert node.end == 8 and node.checkpoint == branch
    assert cache.match(seq, max_tokens=12).restore_slot == low
    free_before = allocator.num_free
    dup_slot = slots.allocate()
    _store(cache, allocator, seq, dup_slot)  # same tokens, other pages: the tree keeps its own
    assert allocator.num_free == free_before and slots.num_free == slots.capacity - 2
    _assert_accounting(cache, allocator, slots)


def test_locked_paths_survive_eviction_and_lru_order_is_respected():
    cache, allocator, slots = _cache(per_page=True, pages=9)  # 8 usable pages
    a, b, c = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22, 23, 24]
    for seq in (a, b, c):
        _store(cache, allocator, seq)
    assert allocator.num_free == 2
    hit_b = cache.match(b, max_tokens=8)
    cache.lock(hit_b.node)
    cache.match(a, max_tokens=8)  # a is now more recent than c
    assert cache.evict_pages(2) == 2  # c goes (LRU); b is locked
    assert cache.match(c, max_tokens=8).num_tokens == 0 and cache.match(a, max_tokens=8).num_tokens == 8
    assert cache.evict_pages(10) == 2  # only a can go
    assert cache.match(b, max_tokens=8).num_tokens == 8
    _assert_accounting(cache, allocator, slots)
    cache.unlock(hit_b.node)
    with pytest.raises(RuntimeError):
        cache.unlock(hit_b.node)
    cache.clear()
    assert allocator.num_free == allocator.capacity


def test_checkpoint_eviction_tombstones_internal_nodes_and_prunes_leaves():
    cache, allocator, slots = _cache(per_page=False, slots=4)
    seq = list(range(1, 13))
    upper, lower = slots.allocate(), slots.allocate()
    _store(cache, allocator, seq[:4], upper)
    _store(cache, allocator, seq, lower)
    cache.match(seq, max_tokens=12)  # the leaf becomes most recent: the internal checkpoint goes first
    assert cache.evict_checkpoint()
    assert cache.match(seq[:4] + [0], max_tokens=5).num_tokens == 0  # tombstone: KV kept, state gone
    assert cache.match(seq + [0], max_tokens=13).num_tokens == 12
    assert cache.evict_checkpoint()  # the leaf and then the tombstone above it are removed with their pages
    assert cache.num_pages == 0 and allocator.num_free == allocator.capacity
    assert not cache.evict_checkpoint()
    _assert_accounting(cache, allocator, slots)


def test_state_locked_checkpoints_are_not_evicted():
    cache, allocator, slots = _cache(per_page=False, slots=2)
    seq = list(range(1, 9))
    _store(cache, allocator, seq, slots.allocate())
    hit = cache.match(seq + [1], max_tokens=8)
    cache.lock(hit.node)
    cache.lock_state(hit.node)
    assert not cache.evict_checkpoint()
    _assert_accounting(cache, allocator, slots)
    cache.unlock_state(hit.node)
    assert cache.evict_checkpoint()  # the checkpoint goes; the path-locked node stays as a tombstone


def test_window_pages_limit_hits_and_are_evicted_apart():
    """W = 6, page 4: a hit of P tokens needs the window pages of positions (P - 6, P). A column whose window page
    was released at insert time (0) caps the hit below it; dropping window pages keeps the full pages but shortens
    the next hit; removing a leaf releases its window pages too."""
    full, window, slots = PageAllocator(32), PageAllocator(32), SlotAllocator(4)
    cache = HybridPrefixCache(P, full, slots, per_page_state=True, window_pages=window, sliding_window=6)
    tokens = list(range(24))  # 6 pages
    pages, held = full.allocate(6), window.allocate(6)
    window.release([held[1]])
    held[1] = 0  # the inserter had released page 1's window page (positions 4..7)
    cache.insert(tokens, pages, window_pages=held)
    full.release(pages)
    window.release([p for p in held if p])
    hit = cache.match(tokens + [99], max_tokens=24)
    assert hit.num_tokens == 24 and hit.window_pages == [0, 0, 0, 0, held[4], held[5]]  # (18, 24): pages 4, 5
    assert cache.match(tokens[:12] + [99], max_tokens=12).num_tokens == 4  # 12 and 8 need page 1; 4 needs page 0
    assert cache.num_window_pages == 5 and window.num_free == 31 - 5
    assert cache.evict_window_pages(1) == 5  # whole nodes, least recently used first: the one node holds all 5
    assert cache.num_window_pages == 0 and window.num_free == 31 and cache.num_pages == 6
    assert cache.match(tokens + [99], max_tokens=24).num_tokens == 0
    fresh = window.allocate(6)  # an inserter with the same full pages: the node adopts its window pages
    cache.insert(tokens, pages, window_pages=fresh)
    window.release(fresh)
    assert cache.num_window_pages == 6 and cache.match(tokens + [99], max_tokens=24).num_tokens == 24
    cache.clear()
    assert cache.num_pages == cache.num_window_pages == 0 and window.num_free == 31 and full.num_free == 31
