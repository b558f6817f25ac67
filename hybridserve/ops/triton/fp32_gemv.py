"""fp32 products of a few tokens against an fp32 weight, spread over about `PROGRAMS` programs: the decode form of
the routers (ZAYA1's EDA router, `ops.triton.zaya_router`; Ling's logits, `ops.triton.router`).

At a few tokens a step what costs is reading the weights and the launch, not arithmetic. So a launch is split over
output columns and tokens into about PROGRAMS programs (one per SM of an H200), each reading only its slice of the
weight, and no program pads its rows to tl.dot's 16: products are broadcast multiply-adds into a [tokens, columns,
K chunk] fp32 register tile, reduced over K once at the end (a reduction per chunk would cost more shuffles than
multiply-adds). One token (the commonest decode) reads its whole K in a single chunk, every load in flight at once;
larger buckets loop over K with the chunks' loads pipelined (cp.async, PIPELINE_STAGES deep), since a loop of plain
loads waits one memory round trip per chunk."""
from __future__ import annotations

import triton
import triton.language as tl

from hybridserve.ops.triton.sizes import next_power_of_2

PROGRAMS = 128  # programs per launch to aim for: about one per SM of an H200 (132 SMs)
TILE_ELEMENTS = 8192  # a program's [tokens, columns, K chunk] product tile: 64 fp32 registers a thread at 4 warps
PIPELINE_STAGES = 6  # K chunks in flight (cp.async) per program when its loop has several: latency, not FLOPs


@triton.jit
def gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def rows_times_cols(x_ptr, w_ptr, vec_ptr, rows, row_ok, cols, col_ok, K: tl.constexpr, BT: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, X_VEC: tl.constexpr,
                    X_GELU: tl.constexpr, CACHE: tl.constexpr):
    """([BT, BN] fp32: sum over k of x'[rows, k] * w[cols, k] (both row-major with K columns), [BT]: sum over k of
    x[rows, k]^2), where x' is x (times vec[k], with X_VEC) (GELU'd, with X_GELU). Products are accumulated per K
    lane, summed once at the end (no shuffles inside the loop); STAGES > 1 pipelines the chunks' loads (cp.async),
    so that more than one chunk is in flight. The squares cost nothing where unused (dead code)."""
    acc = tl.zeros((BT, BN, BK), dtype=tl.float32)
    squares = tl.zeros((BT, BK), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                    cache_modifier=CACHE)
        squares += x * x
        if X_VEC:
            x *= tl.load(vec_ptr + k, mask=k_ok, other=0.0)[None, :]
        if X_GELU:
            x = gelu(x)  # GELU(0) = 0: masked lanes stay out of the sum
        w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x[:, None, :] * w[None, :, :]
    return tl.sum(acc, axis=2), tl.sum(squares, axis=1)


def k_chunk(rows: int, cols: int, k: int) -> int:
    """K chunk of a [rows, cols, chunk] product tile of about TILE_ELEMENTS (at least 8 lanes, one 32-byte sector
    of a row; at most K)."""
    return min(max(8, TILE_ELEMENTS // (rows * cols)), next_power_of_2(k))


def k_loop(rows: int, cols: int, k: int) -> dict:
    """BK and STAGES of a launch's K loop: pipelined when it has more than one chunk."""
    chunk = k_chunk(rows, cols, k)
    return dict(BK=chunk, STAGES=PIPELINE_STAGES if chunk < k else 1)


def fused_tiles(tokens: int, n: int) -> tuple[int, int]:
    """(tokens, columns) per program of a launch with N output columns: about PROGRAMS programs, as square as
    powers of two allow (a program reads (BT + BN) * K inputs for BT * BN * K products). Bucketed by the next power
    of two of the token count, as the warm-up ladder is."""
    area = max(1, next_power_of_2(tokens) * n // PROGRAMS)
    bt = min(next_power_of_2(tokens), 1 << ((area.bit_length() - 1) // 2))
    return bt, min(next_power_of_2(n), next_power_of_2(-(-area // bt)))
