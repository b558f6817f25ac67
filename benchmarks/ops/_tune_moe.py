"""Tune the fused-MoE launch configurations on this GPU and write the tables `ops/triton/moe_config.py` reads.

For each shape and token count (1, 2, 4, ..., 16384 by default) it times a pruned set of candidates (by the mean
rows per expert: 16-row blocks with several N/K tiles, and split-K where the grid is small, when the op streams
weights; mid tiles; then 64/128-row tiles when it is compute bound; shared-memory hogs dropped) on uniform random
routing, each candidate as a CUDA graph of back-to-back calls (launch overhead excluded, as in decode), and keeps
the fastest. All candidates are first compiled in parallel worker processes, which fill Triton's on-disk cache for
the timing process. A table already in --out-dir (else the committed one) keeps its entries for the token counts
not tuned in this run, so a run over a few token counts updates those alone.

    python -m benchmarks.ops tune-moe                   # ZAYA1-8B and Ling-2.6-flash, bf16, TP=1
    python -m benchmarks.ops tune-moe --shape 256,8,4096,512 --tokens 1 64 4096   # E,K,H,I (e.g. Ling at TP=2)
    python -m benchmarks.ops tune-moe --dtype float8_e4m3fn --tokens 2 4 8 16 ...  # FP8 grouped form (from 9 pairs)

The search space and the table format live in `hybridserve/ops/triton/moe_tuning.py`.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from pathlib import Path

import torch

from hybridserve.core.quant import FP8_DTYPE, Fp8Scales, Fp8Scheme
from hybridserve.ops.triton import moe_config
from hybridserve.ops.triton.moe_tuning import candidates, write_table

SHAPES = {"zaya1-8b": (16, 1, 2048, 2048), "ling-2.6-flash": (256, 8, 4096, 1024)}  # E, K, H, I
DTYPES = ("bfloat16", "float16", "float8_e4m3fn")  # e4m3: the W8A8 grouped form (ops.triton.fp8_moe)
FP8_SCHEMES = {"block": Fp8Scheme("block", "group", (128, 128)), "channel": Fp8Scheme("channel", "token")}


def _short(config: dict[str, int]) -> str:
    return ("M{BLOCK_M} N{BLOCK_N} K{BLOCK_K} G{GROUP_M} w{num_warps} s{num_stages} split{SPLIT_K_UP}/{SPLIT_K_DOWN}"
            .format(**config))


def _inputs(tokens: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16 if dtype == FP8_DTYPE else dtype)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices
    return x, ids, torch.rand(tokens, top_k, device="cuda", generator=gen)


def _weights(experts: int, hidden: int, inter: int, dtype: torch.dtype, fp8_scales: str):
    """(w13, w2, their FP8 scales or None): random values (timing does not depend on them), unit scales."""
    stacks = [torch.randn(experts, rows, cols, device="cuda", dtype=torch.bfloat16) / cols**0.5
              for rows, cols in ((2 * inter, hidden), (hidden, inter))]
    if dtype != FP8_DTYPE:
        return stacks[0].to(dtype), stacks[1].to(dtype), None
    scheme = FP8_SCHEMES[fp8_scales]
    scales = []
    for stack in stacks:
        rows, cols = stack.shape[1:]
        shape = (experts, -(-rows // 128), -(-cols // 128)) if scheme.weight == "block" else (experts, rows)
        scales.append(Fp8Scales(torch.ones(shape, device="cuda"), scheme))
    return stacks[0].to(FP8_DTYPE), stacks[1].to(FP8_DTYPE), tuple(scales)


def _call(x, w13, w2, ids, weights, fp8, config):
    """One fused-MoE call with `config`: the 16-bit kernels, or the FP8 grouped form (`fp8`: its scales)."""
    if fp8 is None:
        from hybridserve.ops.triton import moe as kernel
        return kernel.fused_experts(x, w13, w2, ids, weights, config=config)
    from hybridserve.ops.triton import fp8_moe
    return fp8_moe.grouped_experts(x, w13, w2, ids, weights, fp8, config=config)


def _compile(job: tuple) -> str | None:
    """Worker: one call per config with the real H, I, K and strides (what the GEMM kernels specialise on) on a
    stack of K (at least 2) experts, so the compiled kernels land in Triton's disk cache. Returns an error or None."""
    (_, top_k, hidden, inter), dtype_name, fp8_scales, config = job
    dtype = getattr(torch, dtype_name)
    experts = max(2, top_k)
    w13, w2, fp8 = _weights(experts, hidden, inter, dtype, fp8_scales)
    x, ids, weights = _inputs(4, experts, top_k, hidden, dtype)
    try:
        _call(x, w13, w2, ids, weights, fp8, config)
        torch.cuda.synchronize()
    except Exception as error:  # out of resources etc.: the timing pass skips it too
        return f"{config}: {type(error).__name__}: {str(error)[:120]}"
    return None


def _time_us(fn, calls: int) -> float:
    """Microseconds per call: `calls` back-to-back calls captured in one CUDA graph, median of 3 replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return sorted(times)[1]


def tune(shape: tuple[int, int, int, int], tokens_list: list[int], dtype: torch.dtype, fp8_scales: str,
         out_dir: Path) -> Path:
    experts, top_k, hidden, inter = shape
    w13, w2, fp8 = _weights(experts, hidden, inter, dtype, fp8_scales)
    table: dict[str, object] = {}
    times: dict[str, float] = {}
    for tokens in tokens_list:
        x, ids, weights = _inputs(tokens, experts, top_k, hidden, dtype, seed=tokens)
        calls = 10 if tokens * top_k <= 8192 else 3
        results = []
        for config in candidates(tokens, experts, top_k, inter, hidden, dtype):
            try:
                us = _time_us(lambda: _call(x, w13, w2, ids, weights, fp8, config), calls)
            except Exception as error:
                print(f"  skip {config}: {type(error).__name__}")
                continue
            results.append((us, config))
        best_us, best = min(results, key=lambda r: r[0])
        heuristic = moe_config.heuristic_config(tokens, experts, inter, hidden, top_k)
        heuristic_us = next((us for us, c in results if c == heuristic), float("nan"))
        unsplit_us = min((us for us, c in results if c["SPLIT_K_UP"] == c["SPLIT_K_DOWN"] == 1),
                         default=float("nan"))
        print(f"E={experts} K={top_k} H={hidden} I={inter} T={tokens:>5}: {best_us:8.1f} us "
              f"(unsplit {unsplit_us:.1f}, heuristic {heuristic_us:.1f}, {len(results)} tried) {_short(best)}",
              flush=True)
        table[str(tokens)], times[str(tokens)] = best, round(best_us, 2)
    name = torch.cuda.get_device_name()
    comment = (f"Tuned by python -m benchmarks.ops tune-moe on {name} (torch {torch.__version__}, triton "
               f"{__import__('triton').__version__}): fastest candidate per token count, uniform random top-{top_k} "
               f"routing, CUDA-graph timing{f', {fp8_scales} FP8 scales' if fp8 is not None else ''}.")
    return write_table(out_dir, moe_config.config_file_name(experts, inter, hidden, dtype, name), comment, table,
                       times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=None, metavar="E,K,H,I",
                        help="experts, top-k, hidden, local intermediate (repeatable; default: ZAYA1-8B and "
                             "Ling-2.6-flash at TP=1)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2**i for i in range(15)])
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                        help="the weights' dtype; float8_e4m3fn tunes the W8A8 grouped form (bf16 activations)")
    parser.add_argument("--fp8-scales", default="block", choices=sorted(FP8_SCHEMES),
                        help="the e4m3 weights' scales while tuning (the table serves both: K tiles <= 128)")
    parser.add_argument("--out-dir", type=Path, default=moe_config.CONFIG_DIR)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                        help="processes compiling the candidates in parallel")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape] if args.shape else list(SHAPES.values())
    if any(len(s) != 4 for s in shapes):
        parser.error("--shape takes E,K,H,I")
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    jobs = {(shape, tuple(c.values())): (shape, args.dtype, args.fp8_scales, c) for shape in shapes
            for tokens in args.tokens for c in candidates(tokens, shape[0], shape[1], shape[3], shape[2], dtype)}
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        for error in pool.imap_unordered(_compile, jobs.values()):
            if error:
                print(f"  compile failed: {error}")
    print(f"compiled {len(jobs)} configurations in {time.perf_counter() - start:.0f} s", flush=True)
    for shape in shapes:
        print(f"wrote {tune(shape, args.tokens, dtype, args.fp8_scales, args.out_dir)}", flush=True)
        torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - start:.0f} s")

