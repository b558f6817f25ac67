"""Dense linear layers at decode sizes: out = x @ W^T (+ bias) for at most `MAX_TOKENS` tokens, 16-bit or e4m3
weights.

cuBLAS picks GEMM tiles for a 1-16 row problem that leave most of the H200's memory system idle (ZAYA1's fused
q|k|v|v projection, 6.3 MB of bf16, streamed at ~1 TB/s). Here every program takes all the tokens and a few weight
rows (`gemv.tiles`: about `gemv.PROGRAMS` programs), so each weight byte is read once, by one program, with its loads
in flight together (`gemv.dot_rows`). fp32 accumulation; bias added in fp32; the result rounded once to x's dtype.
No split-K: the shapes served (ZAYA1 and Ling-2.6 projections, 1536 to 16384 columns) give enough programs by
columns alone, and a sum never leaves its program (deterministic, no second launch).

e4m3 weights (`fp8`: weight-only, as `ops.reference.fp8.fp8_linear` defines decode sizes) take the same launch,
reading half the weight bytes (`gemv.dot_rows`; ops.triton.fp8_linear's decode form).

With a `ResidualNorm` (ZAYA1's o_proj: its residual update and the post-attention norm) the launch also runs the
norm: each program bumps the launch's arrival counter after storing its columns (acq_rel), and the last to
arrive normalises every token's row, read back through L2, then puts the counter back to zero
(ops/triton/counters.py). A decode step saves the norm's own launch, 40 a step for ZAYA1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.core.quant import Fp8Scales
from hybridserve.ops.norm import PendingNorm, ResidualNorm
from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.counters import arrival_counters
from hybridserve.ops.triton.gemv import (TILE_ELEMENTS, Tiles, consecutive_row_blocks, dot_rows, fp8_args, min_chunk,
                                         pipeline_stages, tiles)
from hybridserve.ops.triton.norm import epilogue_args, prefetch_row_inputs, residual_norm_row
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2

MAX_TOKENS = 16  # the most tokens the kernel takes (its register tiles)
# One token's e4m3 rows, pipelined: half gemv.TILE_ELEMENTS, twice the programs, 8 stages (`linear_tiles`). On an
# H100 every Ling-2.6-flash linear streamed fastest so among 12 tilings (docs/performance.md): Q|K|V|G 26.8 us against
# 28.7, the dense layer's gate|up 29.0 against 39.6; several tokens, or rows of one chunk (ZAYA1-8B), ran slower.
E4M3_TILE_ELEMENTS = TILE_ELEMENTS // 2
# The most tokens of e4m3 weights the GEMV takes; ops.triton.fp8_linear's weight-only tl.dot GEMM takes more, up to
# core.quant.WEIGHT_ONLY_MAX_ROWS (the GEMV's product tile holds every token: fewer rows a program as they grow). On an
# H100 (tune-fp8-linear, Ling-2.6-flash's linears) the GEMM won from 3 tokens on all but the shared expert's gate|up.
E4M3_GEMV_MAX_TOKENS = 2
# Where ops.linear runs it rather than cuBLAS's tensor-core GEMM (the reference, F.linear), placed from
# benchmarks/ops/linear.py on an H200: ZAYA1's projections (4-6 MB) run 1.1-1.9x faster at 1-4 tokens and slower
# from 8; Ling-2.6-flash's 134 MB q|k|v|g already streams at 84% of the floor in cuBLAS and lost 10% at one token.
FASTER_UP_TO_TOKENS = 4
FASTER_UP_TO_WEIGHT_BYTES = 64 << 20


@triton.jit(do_not_specialize=["num_tokens"])  # one variant per token bucket (BT), not per token count
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, num_tokens, n, stride_x, stride_o, counter_ptr, ws_ptr, stride_ws,
                   r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0, nw_ptr, x_out_ptr,
                   h_ptr, h32_ptr, width, eps, sums_ptr, sums_s0, parts, xn_ptr, x_eps, K: tl.constexpr,
                   BT: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, STAGES: tl.constexpr, W_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
                   NORM: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_RESIDUAL: tl.constexpr, HAS_UB: tl.constexpr, HAS_US: tl.constexpr, HAS_RB: tl.constexpr,
                   HAS_RS: tl.constexpr, HAS_SKIP: tl.constexpr, FP32_COPY: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                   X_NORM_BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """out = x @ w^T (+ b) for this program's BN columns of every token (W_SCALES: w e4m3, `gemv.dot_rows`); with
    NORM, then the residual norm of every row by the last program (module docstring; its arguments are
    `norm.residual_norm_row`'s). X_NORM_BLOCK > 0: x is a PendingNorm's residual, the product taken with its h
    (`dot_rows`' pending: sums, their row stride and count, the norm weight xn, x_eps)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < n
    tokens = tl.arange(0, BT)
    token_ok = tokens < num_tokens
    if HAS_BIAS:  # a weight, loaded before the wait (after the sum it would be an L2 round trip of its own)
        bias = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
    if NORM and USE_PDL:
        for token in range(num_tokens):
            prefetch_row_inputs(token, tl.program_id(0), r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr,
                                sx_s0, nw_ptr, width, HAS_RESIDUAL, HAS_UB, HAS_US, HAS_RB, HAS_RS, HAS_SKIP)
    acc = dot_rows(x_ptr, stride_x, tokens, token_ok, w_ptr, K, rows, row_ok, ws_ptr, stride_ws, K, BT, BN, BK,
                   STAGES, W_SCALES, ROW_BLOCKS, USE_PDL, (sums_ptr, sums_s0, parts, xn_ptr, x_eps),
                   X_NORM_BLOCK)  # (the PDL wait, after the weights' loads)
    if HAS_BIAS:
        acc += bias.to(tl.float32)[None, :]
    tl.store(out_ptr + tokens[:, None] * stride_o + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=token_ok[:, None] & row_ok[None, :])
    if NORM:
        tl.debug_barrier()  # every thread's stores precede the release below
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            for token in range(num_tokens):
                residual_norm_row(token, out_ptr, stride_o, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr,
                                  sx_ptr, sx_s0, nw_ptr, x_out_ptr, h_ptr, h32_ptr, width, eps, BLOCK, HAS_RESIDUAL,
                                  HAS_UB, HAS_US, HAS_RB, HAS_RS, HAS_SKIP, FP32_COPY, ".cg")
            tl.store(counter_ptr, 0)


def linear_tiles(tokens: int, n: int, k: int, fp8: Fp8Scales | None = None) -> Tiles:
    """`gemv.tiles` for `tokens` tokens against an [n, k] weight of these FP8 scales (None: 16-bit), e4m3 chunks of
    whole scale blocks. One token of e4m3 rows whose K loop pipelines: product tiles of E4M3_TILE_ELEMENTS, as deep
    as the experts' (`gemv.pipeline_stages`). Elsewhere (one-chunk tiles, several tokens) those lost."""
    chunk = min_chunk(fp8)
    chosen = tiles(tokens, n, k, min_chunk=chunk)
    if fp8 is None or chosen.BT > 1 or chosen.STAGES == 1:
        return chosen
    return tiles(tokens, n, k, min_chunk=chunk, stages=pipeline_stages(fp8), tile_elements=E4M3_TILE_ELEMENTS)


def linear(x: torch.Tensor | PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: Tiles | None = None, norm: ResidualNorm | None = None, fp8: Fp8Scales | None = None):
    """x [..., K] (at most MAX_TOKENS rows; unit last stride) @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's
    dtype; with `norm`, x [T, K] and `norm` applied to the [T, N] result in the same launch: -> its (x, h, h32).
    x may be a PendingNorm (ops/norm.py): the product is then taken with its h, made in this launch (h's dtype).
    `fp8`: the e4m3 weight's scales and scheme (weight-only). `config` overrides `gemv.tiles`' choice (tests,
    tuning)."""
    pending = x if isinstance(x, PendingNorm) else None
    if pending is not None:
        x = pending.x
        if x.dim() != 2 or x.dtype != torch.float32 or pending.norm_weight.shape != x.shape[1:] \
                or pending.sum_squares.shape[0] != x.shape[0] or pending.sum_squares.stride(1) != 1:
            raise ValueError("linear: a pending norm needs x [T, K] fp32, a norm weight [K] and sums [T, P]")
    dtype = x.dtype if pending is None else pending.norm_weight.dtype
    n, k = weight.shape
    if x.shape[-1] != k or weight.stride(1) != 1 or weight.stride(0) != k:
        raise ValueError(f"linear: x {tuple(x.shape)} and a contiguous weight [N, {x.shape[-1]}] needed; got "
                         f"weight {tuple(weight.shape)} strides {weight.stride()}")
    if fp8 is None and dtype != weight.dtype:  # e4m3 weights: checked with their scales (gemv.fp8_args)
        raise ValueError(f"linear: x is {dtype}, weight {weight.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear: bias {tuple(bias.shape)} does not match {n} outputs")
    flat = x.reshape(-1, k)
    tokens = flat.shape[0]
    if tokens > MAX_TOKENS:
        raise ValueError(f"linear: the GEMV kernel takes at most {MAX_TOKENS} tokens; got {tokens}")
    if flat.stride(1) != 1:
        raise ValueError(f"linear: x needs a unit last stride; got strides {x.stride()}")
    if norm is not None and (x.dim() != 2 or norm.norm_weight.shape != (n,)):
        raise ValueError(f"linear: a norm epilogue needs x [T, K] and a norm over the {n} outputs")
    out = torch.empty(tokens, n, device=x.device, dtype=dtype)
    epilogue, flags, normed = epilogue_args(norm, tokens, n, out)
    if pending is None:
        prologue, block = (out, 0, 0, out, 0.0), 0  # placeholders: x is h itself
    else:
        sums = pending.sum_squares
        prologue = (sums, sums.stride(0), sums.shape[1], pending.norm_weight, pending.eps)
        block = next_power_of_2(sums.shape[1])
    if tokens:
        t = config or linear_tiles(tokens, n, k, fp8)
        if t.BT < tokens:
            raise ValueError(f"linear: tiles {t} take fewer than {tokens} tokens")
        scales, kinds = fp8_args(fp8, weight, t, consecutive_row_blocks(t.BN))
        counter = arrival_counters("linear_norm", 1, x.device) if norm is not None else out
        _linear_kernel[(cdiv(n, t.BN),)](
            flat, weight, bias if bias is not None else weight, out, tokens, n, flat.stride(0), out.stride(0),
            counter, *scales, *epilogue, *prologue, K=k, BT=t.BT, BN=t.BN, BK=t.BK, STAGES=t.STAGES, **kinds,
            HAS_BIAS=bias is not None, NORM=norm is not None, **flags, X_NORM_BLOCK=block, num_warps=t.num_warps,
            **pdl.launch(x.device))
    return out.view(*x.shape[:-1], n) if norm is None else normed
