"""Grid-wide barriers inside one launch: a persistent kernel runs a chain of dependent phases (a GEMV, then the
op that reads its whole output, ...) where a decode step would otherwise pay a kernel launch between each pair.
Used by benchmarks/ops/grid_sync.py (a kernel boundary against a barrier, docs/performance.md) only, so it lives
here: ZAYA1's MoE half in one launch was built on it, measured slower than the separate kernels it replaced and
removed (last in 0258cf6; the module was hybridserve/ops/triton/grid_sync.py until then).

Every program of the launch must be resident at once, or the first barrier waits forever: the caller sizes its grid
from the SM count and the programs an SM holds *beside whatever else runs there*. With PDL a launch starts while the
kernel before still holds SMs, so what fits on an idle GPU is not enough (the one-launch MoE kept a program per SM
for this reason). The counter is one int32 that only grows during a call: barrier b (1, 2, ...) waits until
b * programs arrivals; `finish` adds each program's last arrival, and the last program to arrive puts the counter
back to zero for the next call or CUDA-graph replay. With PDL the next kernel can only launch once every program
here has passed `wait_for_previous` (and so is resident), so it never takes an SM a waiting program needs.

The Triton interpreter runs programs one after another, where a barrier of several programs cannot work (one
program passes its barriers alone): barriers among many programs need the GPU."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.ops.triton.counters import arrival_counters


@triton.jit
def grid_barrier(counter_ptr, index):
    """Barrier number `index` (from 1) of this launch: every program's stores before it are visible to every
    program's loads after it (loads of other programs' data must bypass L1: `.cg`)."""
    tl.debug_barrier()  # the whole program's stores precede the release
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    target = index * tl.num_programs(0)
    while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def finish(counter_ptr, barriers):
    """The last statement of a kernel that passed `barriers` barriers: the last program out resets the counter."""
    arrived = tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
    if arrived == (barriers + 1) * tl.num_programs(0) - 1:
        tl.store(counter_ptr, 0)


def barrier_counter(kernel: str, device: torch.device) -> torch.Tensor:
    """`kernel`'s barrier counter on `device` (zero between calls)."""
    return arrival_counters(f"{kernel}:barrier", 1, device)

