"""Hybrid prefix cache: a radix tree over full KV pages whose nodes may own a recurrent-state checkpoint.

A cached prefix is only usable up to a position whose state can be restored:
- per-page state (ZAYA1): every cached page carries the state after its last token (a page footer written during
  the forward), so any full-page match is usable;
- sparse checkpoints (Ling): only node ends that own a checkpoint slot are usable; KV matched beyond the deepest
  checkpoint is reported as a branch point, where the next prefill should take a snapshot.

Sliding-window layers (a window KV group): a prefix of P tokens is usable only if the window group's pages covering
positions (P - W, P) are cached too (the query at P sees keys > P - W). A node keeps the window pages of its span
that its inserter still held (released ones are absent, 0); they can be evicted apart from the full pages
(`evict_window_pages`, least-recently-used nodes first), which only shortens later hits, and a removed leaf drops
them too. Requests hold their own references on the window pages they use, so window pages need no locks.

Ownership: the tree holds one reference on each of its pages and owns its checkpoint slots. Requests lock the path
they use (`lock`), so locked pages are never evicted; the checkpoint a step restores from is state-locked until the
step has run. Unlocked leaves are evicted least-recently-used first (a logical clock: parents are always older than
their children); dropping an internal node's checkpoint leaves a tombstone, and leaves are never tombstones.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hybridserve.cache.kv_pool import PageAllocator, window_first_page
from hybridserve.cache.state_pool import SlotAllocator


@dataclass(eq=False)
class TreeNode:
    tokens: tuple[int, ...]  # this edge's tokens: a whole number of pages
    pages: list[int]
    parent: TreeNode | None
    end: int  # tokens from the root to the end of this node
    window_pages: list[int] = field(default_factory=list)  # window group, one per page (0: absent); [] without
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    checkpoint: int | None = None  # state slot holding the state after token `end - 1`
    lock_count: int = 0  # requests using this node's pages (set along whole paths)
    state_locks: int = 0  # steps about to restore from this node's checkpoint
    last_used: int = 0


@dataclass
class PrefixMatch:
    num_tokens: int  # usable hit: KV and state restorable up to here
    pages: list[int]  # KV pages of [0, num_tokens)
    node: TreeNode | None  # the deepest node used (lock it to keep the pages)
    restore_slot: int | None = None  # sparse checkpoint to copy into the working slot
    kv_tokens: int = 0  # page-aligned KV match, possibly deeper than the usable hit
    window_pages: list[int] = field(default_factory=list)  # per page of `pages`: the window page, 0 where unneeded


class HybridPrefixCache:
    def __init__(self, page_size: int, pages: PageAllocator, slots: SlotAllocator, per_page_state: bool,
                 window_pages: PageAllocator | None = None, sliding_window: int | None = None):
        if (window_pages is None) != (sliding_window is None):
            raise ValueError("a window group needs both its page allocator and the sliding window")
        self.page_size = page_size
        self.pages = pages
        self.slots = slots
        self.per_page_state = per_page_state
        self.window_allocator = window_pages
        self.window = sliding_window
        self.root = TreeNode(tokens=(), pages=[], parent=None, end=0)
        self._clock = itertools.count(1)
        # Kept up to date on every change, so metrics never walk the tree (HybridCacheManager.check recounts them).
        self.num_pages = 0  # pages the tree holds
        self.num_locked_pages = 0  # of them, in nodes some request has locked
        self.num_checkpoints = 0  # state slots the tree owns
        self.num_locked_checkpoints = 0  # of them, about to be restored from
        self.num_window_pages = 0  # window-group pages the tree holds

    # --- lookup ----------------------------------------------------------------------------------------------
    def match(self, token_ids: list[int], max_tokens: int) -> PrefixMatch:
        """The longest usable cached prefix of `token_ids` no longer than `max_tokens` (bumps it in the LRU)."""
        size = self.page_size
        node, pages, path = self.root, [], []
        matched, window = 0, []
        limit = max_tokens - max_tokens % size
        while matched < limit:
            child = node.children.get(tuple(token_ids[matched:matched + size]))
            if child is None:
                break
            same = 0
            while (same < len(child.pages) and matched + (same + 1) * size <= limit
                   and child.tokens[same * size:(same + 1) * size] == tuple(token_ids[matched + same * size:
                                                                                      matched + (same + 1) * size])):
                same += 1
            pages.extend(child.pages[:same])
            window.extend(child.window_pages[:same])
            matched += same * size
            path.append(child)
            if same < len(child.pages):
                break
            node = child
        self._touch(path)
        if self.per_page_state:
            end = matched
            while end and not self._window_cached(window, end):
                end -= size
            node = next((n for n in reversed(path) if n.end - len(n.tokens) < end), None)
            return PrefixMatch(end, pages[: end // size], node, kv_tokens=matched,
                               window_pages=self._window_needed(window, end))
        usable = next((n for n in reversed(path) if n.checkpoint is not None and n.end <= matched
                       and self._window_cached(window, n.end)), None)
        if usable is None:
            return PrefixMatch(0, [], None, kv_tokens=matched)
        return PrefixMatch(usable.end, pages[: usable.end // size], usable, usable.checkpoint, kv_tokens=matched,
                           window_pages=self._window_needed(window, usable.end))

    def _window_cached(self, window: list[int], end: int) -> bool:
        """Whether the window pages a query at `end` reads (positions (end - W, end)) are all cached."""
        if self.window is None:
            return True
        return all(window[window_first_page(end, self.window, self.page_size): end // self.page_size])

    def _window_needed(self, window: list[int], end: int) -> list[int]:
        """The window pages of a hit of `end` tokens: those its next query reads, 0 before them."""
        if self.window is None:
            return []
        first = window_first_page(end, self.window, self.page_size)
        return [0] * first + window[first: end // self.page_size]

    def path_pages(self, node: TreeNode) -> tuple[list[int], list[int]]:
        """The full pages and (window group) window pages from the root to the end of `node`, column by column."""
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        pages = [p for n in reversed(path) for p in n.pages]
        window = [p for n in reversed(path) for p in n.window_pages] if self.window is not None else []
        return pages, window

    def _touch(self, path: list[TreeNode]) -> None:
        for node in path:
            node.last_used = next(self._clock)

    # --- locks -----------------------------------------------------------------------------------------------
    def lock(self, node: TreeNode | None) -> None:
        """Protect the pages of `node` and all its ancestors (a request uses them)."""
        while node is not None and node is not self.root:
            node.lock_count += 1
            if node.lock_count == 1:
                self.num_locked_pages += len(node.pages)
            node = node.parent

    def unlock(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_count <= 0:
                raise RuntimeError("prefix-cache node unlocked more often than locked")
            node.lock_count -= 1
            if node.lock_count == 0:
                self.num_locked_pages -= len(node.pages)
            node = node.parent

    def lock_state(self, node: TreeNode) -> None:
        """Protect `node`'s checkpoint until the step restoring from it has run (its path must be locked too)."""
        node.state_locks += 1
        if node.state_locks == 1:
            self.num_locked_checkpoints += 1

    def unlock_state(self, node: TreeNode) -> None:
        node.state_locks -= 1
        if node.state_locks == 0:
            self.num_locked_checkpoints -= 1

    # --- insertion -------------------------------------------------------------------------------------------
    def insert(self, token_ids: list[int], pages: list[int], checkpoint: int | None = None,
               window_pages: list[int] | None = None) -> TreeNode:
        """Cache pages of `token_ids` (a whole number of pages), optionally with the state after the last token
        and (window group) the window pages the caller still holds (0 where released).

        Pages already cached under the same tokens are kept as they are (the caller's duplicates stay the
        caller's); a cached node adopts the caller's window page of a column only where it has none and the full
        page is the same (the same computation); a checkpoint is adopted when the end node has none, otherwise its
        slot is released.
        """
        size = self.page_size
        if len(token_ids) % size or len(pages) != len(token_ids) // size:
            raise ValueError("insert needs whole pages and one page id per page")
        if (self.window is None) != (window_pages is None) or (window_pages is not None
                                                               and len(window_pages) != len(pages)):
            raise ValueError("insert needs one window page entry per page exactly when there is a window group")
        node, pos = self.root, 0
        while pos < len(token_ids):
            key = tuple(token_ids[pos:pos + size])
            child = node.children.get(key)
            if child is None:
                window = list(window_pages[pos // size:]) if window_pages is not None else []
                child = TreeNode(tuple(token_ids[pos:]), list(pages[pos // size:]), node, len(token_ids), window)
                self.pages.share(child.pages)
                self.num_pages += len(child.pages)
                if window:
                    self._hold_window([p for p in window if p])
                node.children[key] = child
                node, pos = child, len(token_ids)
                break
            same = 0
            while (same < len(child.pages) and pos + (same + 1) * size <= len(token_ids)
                   and child.tokens[same * size:(same + 1) * size] == tuple(token_ids[pos + same * size:
                                                                                      pos + (same + 1) * size])):
                same += 1
            if same < len(child.pages):
                child = self._split(child, same)
            if window_pages is not None:
                self._adopt_window(child, pages[pos // size:], window_pages[pos // size:])
            node, pos = child, pos + same * size
        node.last_used = next(self._clock)
        if checkpoint is not None:
            if node.checkpoint is None and node is not self.root:
                node.checkpoint = checkpoint
                self.num_checkpoints += 1
            else:
                self.slots.release(checkpoint)
        return node

    def _hold_window(self, pages: list[int]) -> None:
        self.window_allocator.share(pages)
        self.num_window_pages += len(pages)

    def _adopt_window(self, node: TreeNode, pages: list[int], window_pages: list[int]) -> None:
        """Fill `node`'s missing window pages from an inserter whose full pages are the node's own."""
        for col, (page, window) in enumerate(zip(node.pages, node.window_pages)):
            if col < len(pages) and not window and window_pages[col] and pages[col] == page:
                node.window_pages[col] = window_pages[col]
                self._hold_window([window_pages[col]])

    def _split(self, node: TreeNode, pages: int) -> TreeNode:
        """Cut `node` after `pages` pages; the new upper part has no checkpoint (a state cannot be split)."""
        cut = pages * self.page_size
        upper = TreeNode(node.tokens[:cut], node.pages[:pages], node.parent, node.end - len(node.tokens) + cut,
                         node.window_pages[:pages], lock_count=node.lock_count, last_used=node.last_used)
        node.parent.children[node.tokens[:self.page_size]] = upper
        node.tokens, node.pages, node.parent = node.tokens[cut:], node.pages[pages:], upper
        node.window_pages = node.window_pages[pages:]
        upper.children[node.tokens[:self.page_size]] = node
        return upper

    # --- eviction --------------------------------------------------------------------------------------------
    def nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _remove_leaf(self, leaf: TreeNode) -> None:
        del leaf.parent.children[leaf.tokens[:self.page_size]]
        self.pages.release(leaf.pages)
        self.num_pages -= len(leaf.pages)
        self._drop_window(leaf, only_unshared=False)
        self._drop_checkpoint(leaf)

    def _drop_window(self, node: TreeNode, only_unshared: bool) -> int:
        """Release `node`'s window pages (with `only_unshared`, those no request holds too); returns pages freed."""
        freed = 0
        for col, page in enumerate(node.window_pages):
            if page and (not only_unshared or self.window_allocator.refcount(page) == 1):
                freed += self.window_allocator.refcount(page) == 1
                self.window_allocator.release([page])
                node.window_pages[col] = 0
                self.num_window_pages -= 1
        return freed

    def _drop_checkpoint(self, node: TreeNode) -> None:
        if node.checkpoint is not None:
            self.slots.release(node.checkpoint)
            node.checkpoint = None
            self.num_checkpoints -= 1

    @staticmethod
    def _evictable_leaf(node: TreeNode) -> bool:
        return not node.children and node.lock_count == 0 and node.state_locks == 0

    def evict_pages(self, needed: int) -> int:
        """Evict least-recently-used unlocked leaves until `needed` pages are free; returns pages freed."""
        freed = 0
        while freed < needed:
            leaves = [n for n in self.nodes() if self._evictable_leaf(n)]
            if not leaves:
                break
            leaf = min(leaves, key=lambda n: n.last_used)
            before = self.pages.num_free
            self._remove_leaf(leaf)
            freed += self.pages.num_free - before
            self._prune_tombstones(leaf.parent)
        return freed

    def evict_window_pages(self, needed: int) -> int:
        """Free `needed` window-group pages by dropping the tree's window pages that no request holds, least-
        recently-used nodes first (their full pages stay: later hits there are just shorter). Returns pages freed."""
        freed = 0
        for node in sorted(self.nodes(), key=lambda n: n.last_used):
            if freed >= needed:
                break
            freed += self._drop_window(node, only_unshared=True)
        return freed

    def evict_checkpoint(self) -> bool:
        """Free one state slot: drop the least-recently-used unlocked checkpoint (a leaf goes with it)."""
        owners = [n for n in self.nodes() if n.checkpoint is not None and n.state_locks == 0]
        if not owners:
            return False
        node = min(owners, key=lambda n: n.last_used)
        if self._evictable_leaf(node):
            self._remove_leaf(node)
            self._prune_tombstones(node.parent)
        else:
            self._drop_checkpoint(node)
            self._prune_tombstones(node)
        return True

    def _prune_tombstones(self, node: TreeNode) -> None:
        """Sparse-state trees keep no leaf without a checkpoint: its KV could never be used."""
        while (not self.per_page_state and node is not self.root and node.checkpoint is None
               and self._evictable_leaf(node)):
            parent = node.parent
            self._remove_leaf(node)
            node = parent

    # --- accounting (for invariant checks and metrics) -------------------------------------------------------
    def recount(self) -> tuple[set[int], set[int], int, int, list[int]]:
        """(pages held, pages locked, checkpoints owned, checkpoints locked, window pages held), recounted from
        the nodes: what the incremental counters must equal."""
        held, locked, checkpoints, locked_checkpoints, window = set(), set(), 0, 0, []
        for node in self.nodes():
            held.update(node.pages)
            window.extend(p for p in node.window_pages if p)
            if node.lock_count:
                locked.update(node.pages)
            if node.checkpoint is not None:
                checkpoints += 1
                locked_checkpoints += node.state_locks > 0
        return held, locked, checkpoints, locked_checkpoints, window

    def clear(self) -> None:
        """Drop every unlocked entry (e.g. when prefix caching is reset)."""
        while self.evict_pages(1) or self.evict_checkpoint():
            pass
