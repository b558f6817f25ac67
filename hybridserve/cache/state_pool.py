"""Fixed-slot per-request recurrent state, and the host-side slot allocator.

Each recurrent layer owns one row per slot in every state field. Slot 0 is a dummy that is never handed out:
padded rows point at it, so they can never overwrite a live request's state. A fresh request never reads its slot
(layers start from zero unless `has_initial_state`), so slots need no clearing; copies run on the device from index
tensors, in the order the step plan gives them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.cache.buffers import zeroed


@dataclass(frozen=True)
class StateField:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class StateSpec:
    """The per-request state of one model: fields shared by all its recurrent layers."""

    num_layers: int
    fields: dict[str, StateField]

    def bytes_per_slot(self) -> int:
        return self.num_layers * sum(torch.Size(f.shape).numel() * f.dtype.itemsize for f in self.fields.values())


class SlotAllocator:
    def __init__(self, num_slots: int):
        """`num_slots` usable slots, numbered 1..num_slots (0 is the dummy)."""
        if num_slots < 1:
            raise ValueError("the state pool needs at least one usable slot")
        self.capacity = num_slots
        self._free = list(range(num_slots, 0, -1))
        self._used = [False] * (num_slots + 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used[slot] = True
        return slot

    def release(self, slot: int) -> None:
        if slot <= 0 or not self._used[slot]:
            raise RuntimeError(f"state slot {slot} released but not allocated")
        self._used[slot] = False
        self._free.append(slot)


class StatePool:
    """Device tensors [layers, 1 + num_slots, *shape] per field."""

    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device):
        self.spec = spec
        self.buffers = {
            name: zeroed((spec.num_layers, num_slots + 1, *f.shape), f.dtype, device)
            for name, f in spec.fields.items()
        }

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        return {name: buf[index] for name, buf in self.buffers.items()}

    def clear_slot(self, slot: int) -> None:
        """Zero `slot` in every layer and field (the dummy slot after warm-up writes)."""
        for buf in self.buffers.values():
            buf[:, slot] = 0

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """state[dst[i]] = state[src[i]] for every layer and field."""
        for buf in self.buffers.values():
            buf[:, dst] = buf[:, src]

    def copy_from(self, source: StatePool, src: torch.Tensor, dst: torch.Tensor) -> None:
        """state[dst[i]] = source[src[i]] (e.g. from per-page footers, which share this pool's fields)."""
        for name, buf in self.buffers.items():
            buf[:, dst] = source.buffers[name][:, src]
