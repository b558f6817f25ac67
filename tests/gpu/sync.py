"""The no-host-sync check the GPU tests share (docs/architecture.md, "Ops and kernels": no device->host syncs in a
step)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside, any device->host synchronisation raises (torch's sync debug mode "error"). Pending work is drained
    first, so only the block's own calls count."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
