"""What a kernel boundary costs at batch 1, against a grid barrier inside one persistent launch.

A chain of PHASES dependent GEMVs (y_{p+1} = W_p y_p, W_p [N, N] bf16, a different matrix each phase, so every
phase streams its weight from HBM as a decode layer does), run three ways and replayed from a CUDA graph:
  launches        one kernel a phase, no PDL
  launches+pdl    one kernel a phase with PDL, each program's weight tile loaded before griddepcontrol.wait
  ops.linear      the engine's decode GEMV (ops/triton/linear.py: PDL, an L2 prefetch of the weight's first bytes)
  persistent      one launch, a grid barrier between phases, each phase's weight tile loaded before the barrier
  persistent+l2-ahead  the same, each phase's tile asked of L2 a phase ahead and loaded after the barrier
and a persistent launch of barriers alone. The three chains must agree (a barrier that let a program read a stale
y would not). Prints and writes (--out) the microseconds a phase against the bytes floor of the weight."""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from benchmarks.ops._grid_barrier import barrier_counter, finish, grid_barrier
from hybridserve.ops.triton.pdl import prefetch_rows, wait_for_previous


@triton.jit
def _phase_kernel(w_ptr, x_ptr, y_ptr, N: tl.constexpr, BN: tl.constexpr, USE_PDL: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.arange(0, N)
    w = tl.load(w_ptr + rows[:, None] * N + k[None, :])
    wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + k).to(tl.float32)
    tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(tl.bfloat16))


@triton.jit
def _persistent_kernel(w_ptr, buf_ptr, counter_ptr, PHASES: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
                       GEMV: tl.constexpr, AHEAD: tl.constexpr):
    """PHASES dependent GEMVs with a grid barrier between two. The weight tile of a phase is loaded into registers
    before the barrier, or with AHEAD asked of L2 a phase ahead (before the previous barrier, no register waiting
    on it) and loaded after the barrier."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.arange(0, N)
    if GEMV and AHEAD:
        prefetch_rows(w_ptr, rows, rows < N, N, N, BN * N * 2)
    for p in range(PHASES):
        if GEMV and AHEAD and p + 1 < PHASES:
            prefetch_rows(w_ptr + (p + 1) * N * N, rows, rows < N, N, N, BN * N * 2)
        if GEMV and not AHEAD:
            w = tl.load(w_ptr + p * N * N + rows[:, None] * N + k[None, :])
        if p > 0:
            grid_barrier(counter_ptr, p)
        if GEMV:
            if AHEAD:
                w = tl.load(w_ptr + p * N * N + rows[:, None] * N + k[None, :])
            x = tl.load(buf_ptr + p * N + k, cache_modifier=".cg").to(tl.float32)
            tl.store(buf_ptr + (p + 1) * N + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(tl.bfloat16))
    finish(counter_ptr, PHASES - 1)


def _graph_us(fn, phases: int, replays: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays / phases  # ops.linear's final copy counts in its first phase


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", type=int, default=40)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--rows-per-program", type=int, default=16)
    parser.add_argument("--bandwidth-tbs", type=float, default=4.3, help="the copy bandwidth of the floor")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    n, bn, phases = args.n, args.rows_per_program, args.phases
    weights = (torch.randn(phases, n, n, device=device) / n ** 0.5).to(torch.bfloat16)
    buf = torch.zeros(phases + 1, n, device=device, dtype=torch.bfloat16)
    buf[0] = torch.randn(n, device=device)
    grid = (n // bn,)
    counter = barrier_counter("benchmark", device)

    def chain(pdl: bool):
        for p in range(phases):
            _phase_kernel[grid](weights[p], buf[p], buf[p + 1], N=n, BN=bn, USE_PDL=pdl, launch_pdl=pdl,
                                num_warps=8)

    def engine_chain():
        from hybridserve.ops.triton.linear import linear
        x = buf[:1]
        for p in range(phases):
            x = linear(x, weights[p])
        buf[-1].copy_(x[0])  # one copy at the end: a copy between phases would break the PDL chain

    def persistent(gemv: bool = True, ahead: bool = False):
        _persistent_kernel[grid](weights, buf, counter, PHASES=phases, N=n, BN=bn, GEMV=gemv, AHEAD=ahead,
                                 num_warps=8)

    results = {}
    for name, fn in (("launches", lambda: chain(False)), ("launches+pdl", lambda: chain(True)),
                     ("ops.linear", engine_chain),
                     ("persistent", persistent), ("persistent+l2-ahead", lambda: persistent(ahead=True)),
                     ("barriers only", lambda: persistent(False))):
        buf[1:].zero_()
        results[name] = {"us_per_phase": _graph_us(fn, phases)}
        if name != "barriers only":
            results[name]["last"] = buf[-1].float().clone()
    reference = results["launches"].pop("last")
    for name in ("launches+pdl", "ops.linear", "persistent", "persistent+l2-ahead"):
        got = results[name].pop("last")
        results[name]["max_abs_diff_vs_launches"] = float((got - reference).abs().max())
        if name != "ops.linear":  # the same sum order as the launch chain; ops.linear's may differ
            assert torch.equal(got, reference), f"{name} differs from the launch chain"
    floor_us = n * n * 2 / (args.bandwidth_tbs * 1e12) * 1e6
    report = {"device": torch.cuda.get_device_name(device), "phases": phases, "n": n, "programs": grid[0],
              "floor_us_per_phase": floor_us, "results": results}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
