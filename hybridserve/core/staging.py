"""Pinned host buffers that feed the CUDA graphs' static inputs: filled on the host, moved by one non-blocking copy.

A non-blocking copy from pinned memory reads its source when the stream reaches it, not when it is queued, so the
host must not write that buffer again before then. Steps that draw tokens bound how far the host runs ahead (the
engine waits for step N's draws before it launches step N + 2), but steps that draw nothing do not: the chunks of
a long prompt before its last one are queued back to back, many of them before the device has run the first. Two
buffers used in turn were not enough then: the fill of chunk N + 2 overwrote chunk N's inputs before their copy
ran, and chunk N ran with chunk N + 2's tokens, positions and KV rows (issue 32).

So each buffer carries the event recorded after the copy that last read it, and is handed out again only once
that event has completed: a host wait that returns at once while the host is less than `count` copies ahead of the
device, and otherwise holds the host back only until the device reaches that copy (it still has the steps queued
behind it to run, so it does not idle).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class CopyEvent(Protocol):
    def record(self, stream=None) -> None: ...

    def synchronize(self) -> None: ...


class StagingBuffers:
    """`count` pinned host buffers of `nbytes` bytes, handed out in turn (`take`) and copied to the device
    (`copy_to`); a buffer is handed out again only after the copy that last read it has run.

    `new_event` makes the event that guards a buffer (default: a CUDA event on CUDA; none on CPU, where the copy
    is done when `copy_to` returns). Tests pass a stand-in to check the bookkeeping without a GPU."""

    def __init__(self, nbytes: int, device: torch.device, count: int = 2,
                 new_event: Callable[[], CopyEvent] | None = None):
        if count < 2:
            raise ValueError("staging needs at least two buffers: a step's copy may be queued while the next fills")
        cuda = device.type == "cuda"
        self.device = device
        self.buffers = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(count)]
        if new_event is None and cuda:
            new_event = torch.cuda.Event
        self._events = [new_event() for _ in range(count)] if new_event is not None else None
        self._recorded = [False] * count  # whether the buffer's event guards a copy (else it was never copied)
        self._current = count - 1  # the buffer handed out last

    def take(self) -> torch.Tensor:
        """The next buffer to fill, once the device has run the copy that last read it."""
        self._current = (self._current + 1) % len(self.buffers)
        if self._recorded[self._current]:
            self._events[self._current].synchronize()
            self._recorded[self._current] = False
        return self.buffers[self._current]

    def copy_to(self, target: torch.Tensor) -> None:
        """Queue the copy of the buffer `take` handed out last into `target` (on the current stream), and record
        the event that guards the buffer until that copy has run."""
        target.copy_(self.buffers[self._current], non_blocking=True)
        if self._events is not None:
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            self._events[self._current].record(stream)
            self._recorded[self._current] = True
