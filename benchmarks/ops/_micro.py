"""Per-op micro-benchmark on the GPU: each kernel vs its pure-torch reference vs the floor its bytes and FLOPs set.

Cases come from `benchmarks/ops/<op>.py` modules (`cases(device) -> list[OpCase]`). Each case is timed with CUDA
events (median of many runs, warmed up); the floor is max(bytes / bandwidth, flops / matmul rate) with the H200
ceilings measured in the same run (a device-to-device copy and a bf16 GEMM), never datasheet numbers.

    python -m benchmarks.ops micro [--ops moe attention ...] [--out results.json]

`OpCase`, `time_ms` and `graphed` are shared with the case modules and the other modes.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class OpCase:
    """One shape of one op: the kernel call, the reference call, and the fewest bytes / FLOPs the op needs."""

    op: str
    name: str
    kernel: Callable[[], object]
    reference: Callable[[], object] | None
    bytes: int
    flops: int = 0


def time_ms(fn: Callable[[], object], warmup: int = 5, repeat: int = 50) -> float:
    """Median milliseconds of `fn` over `repeat` runs (CUDA events around each run)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graphed(calls: list[Callable[[], object]]) -> Callable[[], None]:
    """The replay of one CUDA graph of `calls` in order (each run once eagerly first: compiles and allocates
    outside the capture). Decode-sized calls launched one by one from Python would time the host."""
    for call in calls:
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return lambda kept=calls: graph.replay()  # `kept` holds the tensors the graph reads alive


def measure_ceilings(device: torch.device) -> tuple[float, float]:
    """(bytes/s of a device copy counting read + write, bf16 GEMM FLOP/s) on random data."""
    src = torch.randn(512 * 2**20 // 4, device=device)  # 512 MiB, far beyond L2
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), repeat=20)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    gemm_ms = time_ms(lambda: a @ b, repeat=10)
    return 2 * src.numel() * 4 / (copy_ms * 1e-3), 2 * 8192**3 / (gemm_ms * 1e-3)


def load_cases(ops: list[str] | None, device: torch.device) -> list[OpCase]:
    import benchmarks.ops as package
    cases = []
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_") and (ops is None or info.name in ops):
            cases.extend(importlib.import_module(f"benchmarks.ops.{info.name}").cases(device))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="*", default=None, help="modules of benchmarks/ops to run (default: all)")
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth, matmul_rate = measure_ceilings(device)
    print(f"ceilings: copy {bandwidth / 1e12:.2f} TB/s, bf16 GEMM {matmul_rate / 1e12:.0f} TFLOP/s")
    rows = []
    header = f"{'op':<10} {'case':<44} {'kernel ms':>10} {'ref ms':>9} {'floor ms':>9} {'of floor':>8} {'vs ref':>7}"
    print(header)
    for case in load_cases(args.ops, device):
        kernel_ms = time_ms(case.kernel)
        ref_ms = time_ms(case.reference, repeat=10) if case.reference is not None else float("nan")
        floor_ms = max(case.bytes / bandwidth, case.flops / matmul_rate) * 1e3
        rows.append({"op": case.op, "case": case.name, "kernel_ms": kernel_ms, "reference_ms": ref_ms,
                     "floor_ms": floor_ms, "bytes": case.bytes, "flops": case.flops})
        print(f"{case.op:<10} {case.name:<44} {kernel_ms:>10.4f} {ref_ms:>9.4f} {floor_ms:>9.4f} "
              f"{floor_ms / kernel_ms:>7.0%} {ref_ms / kernel_ms:>6.1f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"bandwidth_Bps": bandwidth, "bf16_flops": matmul_rate,
                                              "cases": rows}, indent=1))
