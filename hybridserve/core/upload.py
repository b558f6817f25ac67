"""Host values to device tensors without a device->host synchronisation, for use inside a step.

`torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the stream to drain: in the
middle of a step that stalls the host until the queued forward has finished, which ends the overlap of host and
device work. A pinned staging tensor copied with `non_blocking=True` is queued on the stream instead (torch's
pinned-memory allocator keeps the staging block until the copy is done), and a scalar is a fill kernel.
"""
from __future__ import annotations

import torch


def upload(values: list, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """`values` (a list, possibly nested) as a tensor on `device`, in one queued copy."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def device_scalar(value: float | bool, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 0-d tensor on `device` holding `value` (e.g. the value of an index_put_)."""
    return torch.full((), value, dtype=dtype, device=device)
