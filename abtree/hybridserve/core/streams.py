"""Two independent computations overlapped on two CUDA streams (Ling's shared expert beside its routed experts).

`run_beside` forks a side stream from the current one (the side waits for everything queued so far, so it sees
its inputs written) and joins it back before returning (the current stream waits for the side, so whatever reads
the side's result comes after it). Both are stream-ordered waits, so the pattern records correctly inside a CUDA
graph capture: the side stream joins the capture at the fork and leaves it at the join.

Memory: inputs allocated on the current stream stay alive in the caller until after the join is queued, so the
allocator cannot hand their blocks to later work that could run before the side stream has read them. The side's
result is allocated from the side stream's pool and consumed on the current stream, hence `record_stream`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


def run_beside(side: Callable[[], torch.Tensor], main: Callable[[], torch.Tensor],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(side(), main()): on CUDA, side() runs on a second stream while main() runs on the current one."""
    if device.type != "cuda":
        return side(), main()
    current = torch.cuda.current_stream(device)
    stream = _side_stream(device.index if device.index is not None else torch.cuda.current_device())
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        side_out = side()
    main_out = main()
    current.wait_stream(stream)
    side_out.record_stream(current)
    return side_out, main_out
