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


PREFETCH_BYTES = tl.constexpr(16 << 10)  # weight bytes a program asks L2 for before it waits (2-8 MB a launch)
LINE = tl.constexpr(128)  # bytes of an L2 line request


@triton.jit
def _prefetch_l2(ptrs, mask):
    """Ask L2 for the line of each pointer where `mask` (fire and forget: no register waits on it)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(w_ptr, rows, row_ok, stride_w, ROW_LENGTH: tl.constexpr, BYTES: tl.constexpr = PREFETCH_BYTES):
    """Ask L2 for the first bytes of each of `rows` of w (rows `stride_w` elements apart, ROW_LENGTH elements
    long): BYTES over all of them, at least a line a row."""
    BN: tl.constexpr = rows.shape[0]
    SIZE: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    SPAN: tl.constexpr = _span(ROW_LENGTH * SIZE, BYTES // BN)
    LINES: tl.constexpr = _power_of_two_at_least((SPAN + LINE - 1) // LINE)
    line = tl.arange(0, LINES) * LINE
    starts = w_ptr.to(tl.pointer_type(tl.int8), bitcast=True) + rows.to(tl.int64) * stride_w * SIZE
    _prefetch_l2(starts[:, None] + line[None, :], row_ok[:, None] & (line < SPAN)[None, :])


@triton.jit
def prefetch_share(ptr, elements, program, LINES: tl.constexpr = 1):
    """Ask L2 for lines [program * LINES, (program + 1) * LINES) of the `elements` contiguous elements at ptr
    (none past them). Spread over a launch's programs, a few lines each, a small tensor that only one program will
    read after the wait (a last-arriving program's epilogue) arrives in L2 while the kernel before still runs."""
    SIZE: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    line = tl.cast(program, tl.int64) * LINES + tl.arange(0, LINES)
    offsets = line * (LINE // SIZE)
    _prefetch_l2(ptr.to(tl.pointer_type(tl.int8), bitcast=True) + offsets * SIZE, offsets < elements)


@triton.constexpr_function
def _span(row_bytes: int, share: int) -> int:
    """Bytes of a row to prefetch: its share of the budget, at least a line, at most the row."""
    return min(row_bytes, max(LINE.value, share))


@triton.constexpr_function
def _power_of_two_at_least(n: int) -> int:
    return triton.next_power_of_2(n)


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
