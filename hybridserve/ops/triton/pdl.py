"""Programmatic dependent launch (Hopper and later): a kernel launched with it may be scheduled while the kernel
before it in the stream is still running, and waits (`wait_for_previous`, griddepcontrol.wait) before its first
read of anything that kernel wrote. A decode step is a chain of ~500 small kernels with a launch gap between each
pair; with PDL the gap overlaps the previous kernel's body instead of following it (in CUDA graphs too, whose
edges keep the attribute).

Each kernel that opts in calls `wait_for_previous(USE_PDL)` as its first statement, so whatever the previous kernel
was (ours, cuBLAS, a copy) everything it wrote is complete before any load; only then does it let the next kernel
launch, so at most one kernel waits ahead of the running one. On by default on sm90+ (the offline A/B that made it the
default is in commit c6f626b's message); HYBRIDSERVE_PDL=0 turns it off; always off on the CPU (the interpreter)."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Until the kernel before this one in the stream has finished and its writes are visible, then let the next
    kernel launch (no-op without PDL)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("HYBRIDSERVE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def launch(device: torch.device) -> dict:
    """The launch arguments of a kernel with a `USE_PDL` constexpr, for a launch on `device`."""
    return {"USE_PDL": True, "launch_pdl": True} if _enabled(device) else {"USE_PDL": False}
