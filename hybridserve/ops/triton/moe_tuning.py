"""The search space of `python -m benchmarks.ops tune-moe` and the tables it writes (`ops.triton.moe_config`
reads them).

Candidates are pruned by the mean rows per expert: up to 16 the op streams weights (16-row blocks, several N / K
tiles and pipeline depths, and for 16-bit weights split-K where the grid is small); up to 64 mid tiles; beyond,
the compute-bound 64/128-row tiles. Tiles whose pipelined operands exceed SMEM_BUDGET are dropped. e4m3 weights
(the W8A8 grouped form, `ops.triton.fp8_moe`) take no split-K and K tiles of at most 128 columns, so that one
table serves per-row and 128x128 block scales alike.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridserve.core.quant import FP8_DTYPE
from hybridserve.ops.triton import moe_config

SMEM_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (H100/H200 have 227 KiB per SM)
SPLIT_TARGETS = (256, 512, 1024, 2048)  # split-K candidates: each GEMM split (power of 2, <= 8) to reach one
FP8_MAX_BLOCK_K = 128  # a K tile within one 128-column scale block


def config(block_m: int, block_n: int, block_k: int, group_m: int, warps: int, stages: int,
           splits: tuple[int, int] = (1, 1)) -> dict[str, int]:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=warps,
                num_stages=stages, SPLIT_K_UP=splits[0], SPLIT_K_DOWN=splits[1])


def _split_to(programs: int, target: int) -> int:
    split = 1
    while split < 8 and programs * split < target:
        split *= 2
    return split


def candidates(tokens: int, experts: int, top_k: int, inter: int, hidden: int, dtype: torch.dtype) -> list[dict]:
    """The configurations worth timing for this shape and token count (each passes `moe_config.check_config`)."""
    fp8 = dtype == FP8_DTYPE
    rows = tokens * top_k / experts
    if rows <= 16:
        pool = [config(16, n, k, 1, 4, s) for n in (32, 64, 128) for k in (64, 128, 256) for s in (3, 4, 5)]
        # more loads in flight per program: 8 warps, or short K tiles in deep pipelines
        pool += [config(16, 128, 128, 1, 8, 4), config(16, 64, 256, 1, 8, 3), config(16, 64, 64, 1, 4, 6),
                 config(16, 128, 64, 1, 4, 5)]
        used = min(experts, tokens * top_k)  # the most blocks with a real row
        for n in (32, 64) if not fp8 else ():
            grids = (used * -(-inter // (n // 2)), used * -(-hidden // n))  # gate/up, down
            splits = {tuple(_split_to(grid, target) for grid in grids) for target in SPLIT_TARGETS} - {(1, 1)}
            pool += [config(16, n, k, 1, 4, 3, s) for k in (64, 128, 256) for s in sorted(splits)]
    elif rows <= 64:
        pool = [config(m, n, k, 8, 4, s) for m in (32, 64) for n in (64, 128) for k in (64, 128) for s in (3, 4)]
    else:
        pool = [config(m, n, k, 8, w, s) for m, n, w, s in
                ((64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 3), (64, 256, 8, 3),
                 (128, 64, 4, 4)) for k in ((64, 128) if fp8 else (64,))]
    pool.append(moe_config.heuristic_config(tokens, experts, inter, hidden, top_k))
    if fp8:  # the FP8 grouped form has no split-K, and its K tiles stay within a scale block
        pool = [{**c, "SPLIT_K_UP": 1, "SPLIT_K_DOWN": 1, "BLOCK_K": min(c["BLOCK_K"], FP8_MAX_BLOCK_K)}
                for c in pool]
    unique = {tuple(c.values()): c for c in pool
              if c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * dtype.itemsize <= SMEM_BUDGET}
    return list(unique.values())


def write_table(out_dir: Path, file_name: str, comment: str, table: dict[str, dict], times: dict[str, float],
                committed: Path = moe_config.CONFIG_DIR) -> Path:
    """Writes out_dir/file_name: the tuned entries, and the previous table's (out_dir's, else `committed`'s)
    for token counts not tuned now, in token order."""
    previous = {}
    for path in (out_dir / file_name, committed / file_name):
        if path.is_file():
            previous = json.loads(path.read_text())
            break
    kept = {t: c for t, c in previous.items() if not t.startswith("_") and t not in table}
    if kept:
        print(f"  kept from the previous table: T = {', '.join(sorted(kept, key=int))}")
    times = {**{t: us for t, us in previous.get("_time_us", {}).items() if t in kept}, **times}
    path = out_dir / file_name
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"_comment": comment, "_time_us": _by_tokens(times), **_by_tokens({**kept, **table})},
                               indent=1) + "\n")
    return path


def _by_tokens(entries: dict) -> dict:
    return dict(sorted(entries.items(), key=lambda item: int(item[0])))
