"""Arrival counters: a kernel whose programs share a final step (writing a state window, a routing decision) has
each program bump its group's counter when done; the one that sees the others all arrived does the step and puts
the counter back to zero. The counters are one persistent int32 buffer per kernel and device, zero between calls,
so every call and every CUDA-graph replay starts from zero; calls on one device must not overlap in time (one
forward stream, as the engine runs)."""
from __future__ import annotations

import torch

_buffers: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(kernel: str, size: int, device: torch.device) -> torch.Tensor:
    """`kernel`'s `size` counters on `device` (allocated zero on first use)."""
    key = (kernel, device)
    if key not in _buffers:
        _buffers[key] = torch.zeros(size, device=device, dtype=torch.int32)
    return _buffers[key]
