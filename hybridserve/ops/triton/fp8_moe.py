"""Routed SwiGLU experts with e4m3 weights on CUDA: `ops.reference.fp8.fp8_fused_experts`, in the two forms of
the 16-bit kernels and with their contract (`reduce=False`: the K weighted rows per token, each rounded to x's
dtype, whose fp32 sum rounded once is the reduced output; a pair of weight 0, ZAYA1's MOD skip, is an exact zero).

- Decode (at most `core.quant.WEIGHT_ONLY_MAX_PAIRS` pairs), weight-only: `ops.triton.moe_gemv`'s two launches with
  e4m3 weights widened to fp32 against x and the SwiGLU rows as they are.
- Otherwise W8A8, the grouped form of `ops.triton.moe`: its alignment (pairs sorted by expert, padded to BLOCK_M), x
  quantized once per token (`fp8_quant.quantize_activations`), the gate/up GEMM (`fp8_linear.scaled_dot` over
  the gate and up rows interleaved in one weight tile, so one K loop serves both; SiLU(gate) * up in fp32, rounded
  to x's dtype by pair), those rows quantized per row (per group), the down GEMM (the routing weight in fp32, by
  pair) and for K > 1 one torch sum: at most seven launches, no host sync, deterministic. No split-K (the decode form
  takes the batches whose grids are small); tiles from `moe_config` for the e4m3 dtype (its heuristic where no
  table is tuned).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.core.quant import FP8_DTYPE, Fp8Scales, Fp8Scheme, experts_weight_only
from hybridserve.ops.triton import moe_gemv
from hybridserve.ops.triton.fp8_linear import check_tiles, launch_args, scaled_dot
from hybridserve.ops.triton.fp8_quant import block_stride, check_scales, check_scheme, group_stride, \
    quantize_activations
from hybridserve.ops.triton.moe import align_pairs, block_rows, expert_shapes, expert_tile, reduce_pairs, swiglu, \
    weighted
from hybridserve.ops.triton.moe_config import check_config, moe_config
from hybridserve.ops.triton.pdl import wait_for_previous
from hybridserve.ops.triton.sizes import cdiv

@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _gate_up_kernel(xq, xs, stride_xs, w13, s13, stride_se, stride_ws, act, sorted_pairs, block_expert, num_pairs,
                    max_blocks, top_k, inter, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ACT: tl.constexpr, W_BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """SiLU(gate) * up of a block's pairs for BLOCK_N / 2 intermediate columns into `act` (by pair); columns 2j and
    2j + 1 of the weight tile are gate and up rows of intermediate column j."""
    wait_for_previous(USE_PDL)
    HALF: tl.constexpr = BLOCK_N // 2
    block, tile, expert = expert_tile(tl.program_id(0), block_expert, max_blocks, tl.cdiv(inter, HALF), GROUP_M)
    if expert >= 0:
        pair, row_ok = block_rows(sorted_pairs, block, num_pairs, BLOCK_M)
        lane = tl.arange(0, BLOCK_N)
        col = tile * HALF + lane // 2
        acc = scaled_dot(xq, pair // top_k, row_ok, xs, stride_xs, w13 + expert * 2 * inter * H,
                         col + (lane % 2) * inter, col < inter, s13 + expert * stride_se, stride_ws, H, BLOCK_M,
                         BLOCK_N, BLOCK_K, ACT, W_BLOCK)
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, HALF, 2)))
        half = tile * HALF + tl.arange(0, HALF)
        tl.store(act + pair.to(tl.int64)[:, None] * inter + half[None, :], swiglu(gate, up).to(act.dtype.element_ty),
                 mask=row_ok[:, None] & (half < inter)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _down_kernel(aq, a_scales, stride_as, w2, s2, stride_se, stride_ws, out, weights, sorted_pairs, block_expert,
                 num_pairs, max_blocks, hidden, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ACT: tl.constexpr, W_BLOCK: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """A block's quantized SwiGLU rows times w2[e]^T for BLOCK_N hidden columns, weighted, into `out` (by pair)."""
    wait_for_previous(USE_PDL)
    block, tile, expert = expert_tile(tl.program_id(0), block_expert, max_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if expert >= 0:
        pair, row_ok = block_rows(sorted_pairs, block, num_pairs, BLOCK_M)
        col = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = col < hidden
        acc = scaled_dot(aq, pair, row_ok, a_scales, stride_as, w2 + expert * hidden * I, col, col_ok,
                         s2 + expert * stride_se, stride_ws, I, BLOCK_M, BLOCK_N, BLOCK_K, ACT, W_BLOCK)
        weight = tl.load(weights + pair, mask=row_ok, other=0.0)
        tl.store(out + pair.to(tl.int64)[:, None] * hidden + col[None, :],
                 weighted(acc, weight[:, None]).to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fused_experts(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor, scheme: Fp8Scheme,
                  input_scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                  reduce: bool = True) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows first) and w2 [E, H, I] e4m3 with their scales s13 / s2 (per row or
    block); topk_ids / weights [T, K] -> [T, H] in x's dtype, or with `reduce=False` the K weighted rows [T, K, H]
    (see `ops.moe.fused_experts`). `input_scales`: the static scheme's scales of the two projections. Every id must
    lie in [0, E) (as `ops.triton.moe.fused_experts`)."""
    fp8 = (Fp8Scales(s13, scheme, input_scales[0]), Fp8Scales(s2, scheme, input_scales[1]))
    if experts_weight_only(topk_ids):
        return moe_gemv.fused_experts(x if x.stride(1) == 1 else x.contiguous(), w13, w2, topk_ids, topk_weights,
                                      reduce=reduce, fp8=fp8)
    return grouped_experts(x, w13, w2, topk_ids, topk_weights, fp8, reduce)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, fp8: tuple[Fp8Scales, Fp8Scales], reduce: bool = True,
                    config: dict[str, int] | None = None) -> torch.Tensor:
    """The grouped form of `fused_experts` for any number of pairs (`fp8`: the two stacks' scales); `config`
    overrides `moe_config`'s tiles (tests, tuning; its SPLIT_K keys are not used)."""
    tokens, hidden, experts, inter, top_k = expert_shapes(x, w13, w2, topk_ids, topk_weights)
    up, down = fp8
    scheme = up.scheme
    for weight, scales in ((w13, up), (w2, down)):
        check_scheme(scales.scheme, scales.input_scale)
        check_scales(weight, scales.scale, scheme)
    num_pairs = tokens * top_k
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    if num_pairs:
        tiles = check_tiles(check_config(config, "config") if config is not None else
                            moe_config(tokens, experts, inter, hidden, top_k, FP8_DTYPE, x.device), scheme)
        sorted_pairs, block_expert = align_pairs(topk_ids.contiguous(), experts, tiles["BLOCK_M"])
        blocks = block_expert.numel()
        weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
        launch = launch_args(tiles, scheme, x.device)
        xq, x_scales = quantize_activations(x, scheme, up.input_scale)
        act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
        _gate_up_kernel[(blocks * cdiv(inter, tiles["BLOCK_N"] // 2),)](
            xq, x_scales, group_stride(x_scales), w13, up.scale, up.scale.stride(0), block_stride(up.scale, scheme),
            act, sorted_pairs, block_expert, num_pairs, blocks, top_k, inter, H=hidden, **launch)
        aq, a_scales = quantize_activations(act, scheme, down.input_scale)
        _down_kernel[(blocks * cdiv(hidden, tiles["BLOCK_N"]),)](
            aq, a_scales, group_stride(a_scales), w2, down.scale, down.scale.stride(0),
            block_stride(down.scale, scheme), out, weights, sorted_pairs, block_expert, num_pairs, blocks, hidden,
            I=inter, **launch)
    return reduce_pairs(out, tokens, top_k, reduce)
