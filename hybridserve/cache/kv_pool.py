"""Paged KV cache for the softmax-attention layers, and the host-side page allocator.

The allocator (scheduler side) hands out page ids; the pool (runner side) owns the tensors. Page 0 is never
handed out: padding rows write there, so a padded row can never touch a live page.

KV groups: sliding-window layers keep only the pages their window can still see, so they live in a group of their
own (the "window" group: its own pool, page ids, allocator and page table) beside the "full" group of the other
attention layers. A model without sliding layers has the full group only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.cache.buffers import zeroed


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer stores per token: named entries of fixed shape, all in one dtype."""

    num_layers: int
    fields: dict[str, tuple[int, ...]]
    dtype: torch.dtype
    window_layers: tuple[int, ...] = ()  # KV layers with a sliding window (the window group)
    sliding_window: int | None = None  # W: key j is visible to query i iff i - W < j <= i

    def __post_init__(self) -> None:
        if self.window_layers and not (self.sliding_window and self.sliding_window >= 1):
            raise ValueError("window layers need a sliding_window >= 1")

    def bytes_per_token(self) -> int:
        per_layer = sum(torch.Size(shape).numel() for shape in self.fields.values())
        return self.num_layers * per_layer * self.dtype.itemsize

    def groups(self) -> tuple[KVCacheSpec, KVCacheSpec | None]:
        """(full group, window group or None): the same fields, split by layer."""
        if not self.window_layers:
            return self, None
        window = len(self.window_layers)
        return (KVCacheSpec(self.num_layers - window, self.fields, self.dtype),
                KVCacheSpec(window, self.fields, self.dtype))

    def layer_groups(self) -> list[tuple[bool, int]]:
        """Per KV layer: (in the window group, index inside its group)."""
        counts, out = [0, 0], []
        for layer in range(self.num_layers):
            window = layer in self.window_layers
            out.append((window, counts[window]))
            counts[window] += 1
        return out


def window_first_page(end: int, window: int, page_size: int) -> int:
    """The first page a query at position `end` still sees under a sliding window of `window` keys (its keys are
    > end - window): every page before it can be released once `end` tokens are in the cache."""
    return max(0, end - window + 1) // page_size


class PageAllocator:
    """Reference-counted KV pages. A page returns to the free list when its last holder releases it."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is a reserved dummy)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the dummy)."""
        return self.num_pages - 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh pages, or None (and nothing taken) when there are not enough."""
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Another holder starts using these pages."""
        for page in pages:
            if self._refs[page] <= 0:
                raise RuntimeError(f"page {page} is not allocated")
            self._refs[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            if self._refs[page] <= 0:
                raise RuntimeError(f"page {page} released more often than allocated")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refs[page]


class KVPool:
    """Device tensors [layers, pages * page_size, *field_shape] per field; a layer sees its own slice."""

    def __init__(self, spec: KVCacheSpec, num_pages: int, page_size: int, device: torch.device):
        self.spec = spec
        self.page_size = page_size
        rows = num_pages * page_size
        self.buffers = {
            name: zeroed((spec.num_layers, rows, *shape), spec.dtype, device)
            for name, shape in spec.fields.items()
        }

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        return {name: buf[index] for name, buf in self.buffers.items()}

    def clear_page(self, page: int) -> None:
        """Zero every layer's rows of `page` (the dummy page after warm-up writes)."""
        for buf in self.buffers.values():
            buf[:, page * self.page_size:(page + 1) * self.page_size] = 0

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's rows of page dst[i] = those of page src[i] (a fork's copy of a partly filled page)."""
        offsets = torch.arange(self.page_size, device=src.device)
        src_rows = (src[:, None] * self.page_size + offsets).flatten()
        dst_rows = (dst[:, None] * self.page_size + offsets).flatten()
        for buf in self.buffers.values():
            buf[:, dst_rows] = buf[:, src_rows]
