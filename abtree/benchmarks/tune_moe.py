"""Tune the fused-MoE launch configurations on this GPU and write the tables `ops/triton/moe_config.py` reads.

For each shape and token count (1, 2, 4, ..., 16384 by default) it times a pruned set of candidates (by the mean
rows per expert: 16-row blocks with several N/K tiles, and split-K where the grid is small, when the op streams
weights; mid tiles; then 64/128-row tiles when it is compute bound; shared-memory hogs dropped) on uniform random
routing, each candidate as a CUDA graph of back-to-back calls (launch overhead excluded, as in decode), and keeps
the fastest. All candidates are first compiled in parallel worker processes, which fill Triton's on-disk cache for
the timing process. A table already in --out-dir (else the committed one) keeps its entries for the token counts
not tuned in this run, so a run over a few token counts updates those alone.

    python benchmarks/tune_moe.py                       # ZAYA1-8B and Ling-2.6-flash, bf16, TP=1
    python benchmarks/tune_moe.py --shape 256,8,4096,512 --tokens 1 64 4096   # E,K,H,I (e.g. Ling at TP=2)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridserve.ops.triton import moe_config  # noqa: E402

SHAPES = {"zaya1-8b": (16, 1, 2048, 2048), "ling-2.6-flash": (256, 8, 4096, 1024)}  # E, K, H, I
SMEM_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (H100/H200 have 227 KiB per SM)
SPLIT_TARGETS = (256, 512, 1024, 2048)  # split-K candidates: each GEMM split (power of 2, <= 8) to reach one


def _config(block_m: int, block_n: int, block_k: int, group_m: int, warps: int, stages: int,
            splits: tuple[int, int] = (1, 1)) -> dict[str, int]:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=warps,
                num_stages=stages, SPLIT_K_UP=splits[0], SPLIT_K_DOWN=splits[1])


def _split_to(programs: int, target: int) -> int:
    split = 1
    while split < 8 and programs * split < target:
        split *= 2
    return split


def candidates(tokens: int, experts: int, top_k: int, inter: int, hidden: int, itemsize: int) -> list[dict]:
    rows = tokens * top_k / experts
    if rows <= 16:
        pool = [_config(16, n, k, 1, 4, s) for n in (32, 64, 128) for k in (128, 256) for s in (3, 4)]
        # more loads in flight per program: 8 warps, or short K tiles in deep pipelines
        pool += [_config(16, 128, 128, 1, 8, 4), _config(16, 64, 256, 1, 8, 3), _config(16, 64, 64, 1, 4, 6),
                 _config(16, 128, 64, 1, 4, 5)]
        used = min(experts, tokens * top_k)  # the most blocks with a real row
        for n in (32, 64):
            grids = (used * -(-inter // (n // 2)), used * -(-hidden // n))  # gate/up, down
            splits = {tuple(_split_to(grid, target) for grid in grids) for target in SPLIT_TARGETS} - {(1, 1)}
            pool += [_config(16, n, k, 1, 4, 3, s) for k in (64, 128, 256) for s in sorted(splits)]
    elif rows <= 64:
        pool = [_config(m, n, k, 8, 4, 3) for m in (32, 64) for n in (64, 128) for k in (64, 128)]
    else:
        pool = [_config(m, n, 64, 8, w, s) for m, n, w, s in
                ((64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 3), (64, 256, 8, 3),
                 (128, 64, 4, 4))]
    pool.append(moe_config.heuristic_config(tokens, experts, inter, hidden, top_k))
    unique = {tuple(c.values()): c for c in pool
              if c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * itemsize <= SMEM_BUDGET}
    return list(unique.values())


def _short(config: dict[str, int]) -> str:
    return ("M{BLOCK_M} N{BLOCK_N} K{BLOCK_K} G{GROUP_M} w{num_warps} s{num_stages} split{SPLIT_K_UP}/{SPLIT_K_DOWN}"
            .format(**config))


def _inputs(tokens: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices
    return x, ids, torch.rand(tokens, top_k, device="cuda", generator=gen)


def _weights(experts: int, hidden: int, inter: int, dtype: torch.dtype):
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dtype) / hidden**0.5
    return w13, torch.randn(experts, hidden, inter, device="cuda", dtype=dtype) / inter**0.5


def _compile(job: tuple) -> str | None:
    """Worker: one call per config with the real H, I, K and strides (what the GEMM kernels specialise on) on a
    stack of K (at least 2) experts, so the compiled kernels land in Triton's disk cache. Returns an error or None."""
    (_, top_k, hidden, inter), dtype_name, config = job
    from hybridserve.ops.triton import moe as kernel
    dtype = getattr(torch, dtype_name)
    experts = max(2, top_k)
    w13, w2 = _weights(experts, hidden, inter, dtype)
    x, ids, weights = _inputs(4, experts, top_k, hidden, dtype)
    try:
        kernel.fused_experts(x, w13, w2, ids, weights, config=config)
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


def tune(shape: tuple[int, int, int, int], tokens_list: list[int], dtype: torch.dtype, out_dir: Path) -> Path:
    from hybridserve.ops.triton import moe as kernel
    experts, top_k, hidden, inter = shape
    w13, w2 = _weights(experts, hidden, inter, dtype)
    table: dict[str, object] = {}
    times: dict[str, float] = {}
    for tokens in tokens_list:
        x, ids, weights = _inputs(tokens, experts, top_k, hidden, dtype, seed=tokens)
        calls = 10 if tokens * top_k <= 8192 else 3
        results = []
        for config in candidates(tokens, experts, top_k, inter, hidden, dtype.itemsize):
            try:
                us = _time_us(lambda: kernel.fused_experts(x, w13, w2, ids, weights, config=config), calls)
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
    comment = (f"Tuned by benchmarks/tune_moe.py on {name} (torch {torch.__version__}, triton "
               f"{__import__('triton').__version__}): fastest candidate per token count, uniform random top-{top_k} "
               f"routing, CUDA-graph timing.")
    return write_table(out_dir, moe_config.config_file_name(experts, inter, hidden, dtype, name), comment, table,
                       times)


def write_table(out_dir: Path, file_name: str, comment: str, table: dict[str, dict], times: dict[str, float]) -> Path:
    """Writes out_dir/file_name: the tuned entries, and the previous table's (out_dir's, else the committed one)
    for token counts not tuned now, in token order."""
    previous = {}
    for path in (out_dir / file_name, moe_config.CONFIG_DIR / file_name):
        if path.is_file():
            previous = json.loads(path.read_text())
            break
    kept = {t: c for t, c in previous.items() if not t.startswith("_") and t not in table}
    if kept:
        print(f"  kept from the previous table: T = {', '.join(sorted(kept, key=int))}")
    times = {**{t: us for t, us in previous.get("_time_us", {}).items() if t in kept}, **times}
    path = out_dir / file_name
    path.write_text(json.dumps({"_comment": comment, "_time_us": _by_tokens(times), **_by_tokens({**kept, **table})},
                               indent=1) + "\n")
    return path


def _by_tokens(entries: dict) -> dict:
    return dict(sorted(entries.items(), key=lambda item: int(item[0])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=None, metavar="E,K,H,I",
                        help="experts, top-k, hidden, local intermediate (repeatable; default: ZAYA1-8B and "
                             "Ling-2.6-flash at TP=1)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2**i for i in range(15)])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--out-dir", type=Path, default=moe_config.CONFIG_DIR)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                        help="processes compiling the candidates in parallel")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape] if args.shape else list(SHAPES.values())
    if any(len(s) != 4 for s in shapes):
        parser.error("--shape takes E,K,H,I")
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    jobs = {(shape, tuple(c.values())): (shape, args.dtype, c) for shape in shapes for tokens in args.tokens
            for c in candidates(tokens, shape[0], shape[1], shape[3], shape[2], dtype.itemsize)}
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        for error in pool.imap_unordered(_compile, jobs.values()):
            if error:
                print(f"  compile failed: {error}")
    print(f"compiled {len(jobs)} configurations in {time.perf_counter() - start:.0f} s", flush=True)
    for shape in shapes:
        print(f"wrote {tune(shape, args.tokens, dtype, args.out_dir)}", flush=True)
        torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
