"""Routed SwiGLU experts for a few (token, choice) pairs: the decode form of `ops.triton.moe` (same contract).

At one to a few tokens the grouped-GEMM form spends a launch sorting the pairs by expert and pads each pair to a
16-row tl.dot block, and its output tiles are too few to keep the weight stream busy (ZAYA1-8B, one token: 25 MB of
expert weights at ~1.4 TB/s). Here each program reads its pair's expert id straight from topk_ids and streams only
its rows of that expert's weights (`gemv.dot_rows`: fp32 products, no padding), two launches in all:
1. gate/up, grid (pair, intermediate block): the block's gate rows and up rows interleaved in one tile, so one
   pipelined loop reads both; SiLU(gate) * up in fp32 (as `ops.triton.moe`), rounded to x's dtype into [T*K, I].
2. down, grid (output row, hidden block): times the routing weight in fp32, each pair's row rounded once to x's
   dtype. With `reduce` an output row is a token and its program adds its K rows in choice order in fp32 and rounds
   once: the sum `ops.ling_norm.add_rms_norm` makes of the unreduced rows, bit for bit in 16-bit dtypes (in fp32
   nothing rounds a row before the sum, and the compiler may fuse its product into it), with no atomics and no
   third launch. Unreduced, an output row is a pair.
The pair index is the fastest grid axis, so pairs that share an expert (more tokens than experts) read the same
weight block at about the same time, the second from L2. Tiles depend on the weight shapes only (enough programs
for one pair; more pairs only add programs), so a pair's row is the same bits whatever else is in the batch: a
decode step padded to its CUDA-graph size computes what the eager step does. A pair with weight 0 (ZAYA1's MOD
skip) or an expert id outside [0, E) reads no weights: its row is an exact zero. Grids come from T, K and the weight
shapes only: CUDA-graph capturable, no host sync, deterministic.

e4m3 experts (`fp8`: weight-only, as `ops.reference.fp8.fp8_fused_experts` defines decode sizes; the decode form
of `ops.triton.fp8_moe`) run the same two launches on half the weight bytes (`gemv.dot_rows`).

With a deferred selection (ZAYA1's decode steps: `ops.triton.zaya_router.normed_route`), the pairs' experts are
not in topk_ids yet: both launches choose them from the router's partial class logits themselves (the gate/up launch
after its wait, the down launch before it, the logits being two launches back there), bit for bit alike
(`zaya_router.deferred_choice`), and the gate/up launch stores the routing's outputs.

With a `ResidualNorm` (ZAYA1: the post-MoE residual update and the next layer's input norm) the down launch also
runs the norm, row by row: a program bumps its row's arrival counter after storing its columns (acq_rel), and the
last of the row's programs normalises it, read back through L2, and puts the counter back to zero
(ops/triton/counters.py): the norm's own launch saved. Where the norm's reader takes it (`h_pending`: the next
layer's q|k|v|v GEMV), there is no last program: each stores its columns of x and their sum of squares, and the
launch returns an `ops.norm.PendingNorm` in h's place, which the reader's launch finishes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.core.quant import Fp8Scales
from hybridserve.ops.norm import PendingNorm, ResidualNorm
from hybridserve.ops.reference.zaya_router import DeferredSelection
from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.counters import arrival_counters
from hybridserve.ops.triton.fp8_quant import SCALE_BLOCK
from hybridserve.ops.triton.gemv import (Tiles, consecutive_row_blocks, dot_rows, fp8_args, min_chunk, pipeline_stages,
                                         tiles)
from hybridserve.ops.triton.moe import expert_shapes
from hybridserve.ops.triton.norm import (epilogue_args, prefetch_row_inputs, residual_norm_row, residual_terms,
                                         updated_residual)
from hybridserve.ops.triton.pdl import prefetch_rows, wait_for_previous
from hybridserve.ops.triton.sizes import cdiv
from hybridserve.ops.triton.zaya_router import class_biases, deferred_choice, routed, store_routing

# The most (token, choice) pairs ops.moe gives this form; beyond, the grouped-GEMM form (`ops.triton.moe`), whose
# expert blocks share each weight tile among their rows. benchmarks/ops/moe.py times both forms at decode sizes; on
# an H200 this form is 1.6x / 1.4x faster at ZAYA1's 1 / 2 pairs, level at 4, 8 (and Ling's 8 at one token), 0.9x at 16.
MAX_PAIRS = 8


@triton.jit
def _pair(ids_ptr, weights_ptr, pair, EXPERTS: tl.constexpr):
    """(expert id as int64, routing weight, whether the pair contributes: a nonzero weight and a valid id)."""
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    weight = tl.load(weights_ptr + pair)
    return expert, weight, (weight != 0.0) & (expert >= 0) & (expert < EXPERTS)


@triton.jit
def _selected_pair(partials_ptr, balancing, pair, PARTS: tl.constexpr, EXPERTS: tl.constexpr, BC: tl.constexpr):
    """`_pair` of a deferred ZAYA1 selection (`zaya_router.deferred_choice`; one choice a token, E + 1 classes,
    the last the MOD skip: `zaya_router.routed`), then the choice and its probability."""
    choice, prob = deferred_choice(partials_ptr, balancing, pair, PARTS, EXPERTS + 1, BC)
    expert, weight, _ = routed(choice, prob, EXPERTS + 1)
    return expert, weight, weight != 0.0, choice, prob


@triton.jit
def _pairs(ids_ptr, weights_ptr, row, CHOICES: tl.constexpr, EXPERTS: tl.constexpr):
    """The `_pair`s of output row `row`'s CHOICES pairs, a tuple."""
    pairs = ()
    for choice in tl.static_range(CHOICES):
        pairs = pairs + (_pair(ids_ptr, weights_ptr, row * CHOICES + choice, EXPERTS),)
    return pairs


@triton.jit
def _gate_up_block(x_ptr, stride_x, w13_ptr, act_ptr, inter, ws_ptr, stride_se, stride_ws, pair, block, expert,
                   TOP_K: tl.constexpr, H: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                   W_SCALES: tl.constexpr, ROW_BLOCKS: tl.constexpr):
    """act[pair, cols] = SiLU(gate) * up of the BN / 2 intermediate columns of block `block` of a live pair with
    expert `expert`; w13 rows 2j (gate) and 2j + 1 (up) of the tile are column j's (W_SCALES: e4m3 weights with
    scales `stride_se` apart per expert, `gemv.dot_rows`)."""
    lane = tl.arange(0, BN)
    col = block * (BN // 2) + lane // 2
    one = tl.arange(0, 1)
    dots = dot_rows(x_ptr + tl.cast(pair // TOP_K, tl.int64) * stride_x, 0, one, one == 0,
                    w13_ptr + expert * 2 * inter * H, H, col + (lane % 2) * inter, col < inter,
                    ws_ptr + expert * stride_se, stride_ws, H, 1, BN, BK, STAGES, W_SCALES, ROW_BLOCKS)
    gate, up = tl.split(tl.reshape(dots, (BN // 2, 2)))
    out = (gate / (1.0 + tl.exp(-gate)) * up).to(act_ptr.dtype.element_ty)  # the grouped form's SiLU(gate)*up
    half = block * (BN // 2) + tl.arange(0, BN // 2)
    tl.store(act_ptr + tl.cast(pair, tl.int64) * inter + half, out, mask=half < inter)


@triton.jit
def _gemv_gate_up_kernel(x_ptr, w13_ptr, ids_ptr, weights_ptr, act_ptr, stride_x, inter, ws_ptr, stride_se,
                         stride_ws, partials_ptr, balancing_ptr, choice_ptr, prob_ptr, skip_ptr, TOP_K: tl.constexpr,
                         EXPERTS: tl.constexpr, H: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         STAGES: tl.constexpr, W_SCALES: tl.constexpr, ROW_BLOCKS: tl.constexpr, PARTS: tl.constexpr,
                         BC: tl.constexpr, USE_PDL: tl.constexpr):
    """`_gate_up_block` of pair program_id(0), block program_id(1). PARTS > 0: the pair's routing is a deferred
    selection (`_selected_pair`; partials from the launch just before, so after the wait); the pair's block-0
    program stores its outputs: ids, weights and the selection's choice, probability and skip weight."""
    pair = tl.program_id(0)
    if PARTS > 0:
        balancing = class_biases(balancing_ptr, EXPERTS + 1, BC)  # a weight: before the wait
    wait_for_previous(USE_PDL)
    if PARTS > 0:
        expert, _, live, choice, prob = _selected_pair(partials_ptr, balancing, pair, PARTS, EXPERTS, BC)
        store_routing(choice, prob, pair, tl.program_id(1) == 0, choice_ptr, prob_ptr, ids_ptr, weights_ptr,
                      skip_ptr, EXPERTS + 1)
    else:
        expert, _, live = _pair(ids_ptr, weights_ptr, pair, EXPERTS)
    if live:  # else the down launch skips the pair too: its act row is never read
        _gate_up_block(x_ptr, stride_x, w13_ptr, act_ptr, inter, ws_ptr, stride_se, stride_ws, pair, tl.program_id(1),
                       expert, TOP_K, H, BN, BK, STAGES, W_SCALES, ROW_BLOCKS)


@triton.jit
def _down_block(act_ptr, w2_ptr, pairs, out_ptr, hidden, counter_ptr, ws_ptr, stride_se, stride_ws,
                r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0, nw_ptr, x_out_ptr, h_ptr, h32_ptr,
                width, eps, sums_ptr, terms, row, block, blocks, CHOICES: tl.constexpr, I: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, W_SCALES: tl.constexpr,
                ROW_BLOCKS: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                HAS_UB: tl.constexpr, HAS_US: tl.constexpr, HAS_RB: tl.constexpr, HAS_RS: tl.constexpr,
                HAS_SKIP: tl.constexpr, FP32_COPY: tl.constexpr, PENDING: tl.constexpr, WAIT: tl.constexpr = False):
    """out[row, cols] of column block `block` (of `blocks`) = the sum over the row's CHOICES `_pairs`, in order, of
    (act[pair] @ w2[e]^T * weight) rounded to out's dtype, summed in fp32 and rounded once (one pair: its weighted
    row); with NORM, then the row's residual norm by the last of its `blocks` programs (module docstring; the
    arguments are `norm.residual_norm_row`'s). PENDING instead: the updated residual x of these columns (from
    `terms`, their `norm.residual_terms`) and its sum of squares, at sums[row, block]; out is not stored.

    WAIT (one choice a row, PDL): the pair's expert was chosen two launches back, so `gemv.dot_rows` loads its
    weights before the wait; a pair that reads nothing (a skip, weight 0) masks its loads off instead of branching
    around them, so that every program waits (none may store before the kernel before has finished)."""
    col = block * BN + tl.arange(0, BN)
    col_ok = col < hidden
    total = tl.zeros([BN], dtype=tl.float32)
    for choice in tl.static_range(CHOICES):
        pair = row * CHOICES + choice
        expert, weight, live = pairs[choice]
        if WAIT:
            tl.static_assert(CHOICES == 1, "the down weights load before the wait for one choice a row")
            total += _weighted_down(act_ptr, w2_ptr, ws_ptr, stride_se, stride_ws, out_ptr, pair, expert, weight, live,
                                    col, col_ok, hidden, I, BN, BK, STAGES, W_SCALES, ROW_BLOCKS, True)
        elif live:
            total += _weighted_down(act_ptr, w2_ptr, ws_ptr, stride_se, stride_ws, out_ptr, pair, expert, weight, live,
                                    col, col_ok, hidden, I, BN, BK, STAGES, W_SCALES, ROW_BLOCKS, False)
    update = total.to(out_ptr.dtype.element_ty)
    if PENDING:
        x = updated_residual(update.to(tl.float32)[None, :], terms, HAS_RESIDUAL, HAS_UB, HAS_US, HAS_SKIP)
        x = tl.where(col_ok[None, :], x, 0.0)
        tl.store(x_out_ptr + tl.cast(row, tl.int64) * width + col[None, :], x, mask=col_ok[None, :])
        tl.store(sums_ptr + tl.cast(row, tl.int64) * blocks + block + tl.arange(0, 1), tl.sum(x * x, axis=1))
    else:
        tl.store(out_ptr + tl.cast(row, tl.int64) * hidden + col, update, mask=col_ok)
    if NORM and not PENDING:
        tl.debug_barrier()  # every thread's stores precede the release below
        if tl.atomic_add(counter_ptr + row, 1, sem="acq_rel") == blocks - 1:
            residual_norm_row(row, out_ptr, hidden, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr,
                              sx_s0, nw_ptr, x_out_ptr, h_ptr, h32_ptr, width, eps, BLOCK, HAS_RESIDUAL, HAS_UB,
                              HAS_US, HAS_RB, HAS_RS, HAS_SKIP, FP32_COPY, ".cg")
            tl.store(counter_ptr + row, 0)


@triton.jit
def _weighted_down(act_ptr, w2_ptr, ws_ptr, stride_se, stride_ws, out_ptr, pair, expert, weight, live, col, col_ok,
                   hidden, I: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                   W_SCALES: tl.constexpr, ROW_BLOCKS: tl.constexpr, WAIT: tl.constexpr):
    """[BN] fp32: the pair's row of columns `col`, act[pair] @ w2[expert]^T times its weight, rounded to out's dtype
    (exact zeros where not `live`: its loads masked off; tl.where, not &, as the interpreter cannot AND a mask with
    a scalar)."""
    one = tl.arange(0, 1)
    dots = dot_rows(act_ptr + tl.cast(pair, tl.int64) * I, 0, one, tl.where(live, one == 0, False),
                    w2_ptr + expert * hidden * I, I, col, tl.where(live, col_ok, False), ws_ptr + expert * stride_se,
                    stride_ws, I, 1, BN, BK, STAGES, W_SCALES, ROW_BLOCKS, WAIT)
    return tl.reshape(dots * weight, (BN,)).to(out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _gemv_down_kernel(act_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr, hidden, counter_ptr, ws_ptr, stride_se,
                      stride_ws, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0, nw_ptr, x_out_ptr,
                      h_ptr, h32_ptr, width, eps, sums_ptr, partials_ptr, balancing_ptr, CHOICES: tl.constexpr,
                      EXPERTS: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      STAGES: tl.constexpr, W_SCALES: tl.constexpr, ROW_BLOCKS: tl.constexpr, NORM: tl.constexpr,
                      BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_UB: tl.constexpr, HAS_US: tl.constexpr,
                      HAS_RB: tl.constexpr, HAS_RS: tl.constexpr, HAS_SKIP: tl.constexpr, FP32_COPY: tl.constexpr,
                      PENDING: tl.constexpr, PARTS: tl.constexpr, BC: tl.constexpr, USE_PDL: tl.constexpr):
    """`_down_block` of output row program_id(0), column block program_id(1). The pairs' experts were chosen two
    launches back, before the gate/up launch could start: their weights' stream starts before the PDL wait
    (ops/triton/pdl.py), loaded whole by `_down_block` for one choice a row, else asked of L2. PARTS > 0: the
    choice is a deferred selection, made here from the partials (also two launches back) as the gate/up launch
    makes it (`_selected_pair`: the same bits). PENDING: each program's columns of x and their sum of squares
    (`_down_block`); what x adds to the update is loaded before the wait, none of it the kernel before's output (the
    skip weight of a deferred selection is this program's own, as the gate/up launch stores it)."""
    PRELOAD: tl.constexpr = USE_PDL and CHOICES == 1
    if NORM and USE_PDL and not PENDING:
        prefetch_row_inputs(tl.program_id(0), tl.program_id(1), r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr,
                            sx_ptr, sx_s0, nw_ptr, width, HAS_RESIDUAL, HAS_UB, HAS_US, HAS_RB, HAS_RS, HAS_SKIP)
    # Before the wait, once: in the choice loop each pair loaded after the choice before's sum (no load crosses it).
    if PARTS > 0:
        tl.static_assert(CHOICES == 1, "a deferred selection chooses one expert a token")
        balancing = class_biases(balancing_ptr, EXPERTS + 1, BC)
        expert, weight, live, choice, prob = _selected_pair(partials_ptr, balancing, tl.program_id(0), PARTS,
                                                            EXPERTS, BC)
        pairs = ((expert, weight, live),)
    else:
        pairs = _pairs(ids_ptr, weights_ptr, tl.program_id(0), CHOICES, EXPERTS)
    terms = None
    if PENDING:
        row = tl.cast(tl.program_id(0), tl.int64) + tl.arange(0, 1)
        col = tl.program_id(1) * BN + tl.arange(0, BN)
        if PARTS > 0:
            skip_weight = routed(choice, prob, EXPERTS + 1)[2] + tl.zeros([1], tl.float32)
        elif HAS_SKIP:
            skip_weight = tl.load(sw_ptr + row)
        else:
            skip_weight = 0.0
        terms = residual_terms(row, row == row, col, col < hidden, skip_weight, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr,
                               rs_ptr, sx_ptr, sx_s0, HAS_RESIDUAL, HAS_UB, HAS_US, HAS_RB, HAS_RS, HAS_SKIP)
    if USE_PDL and not PRELOAD:
        col = tl.program_id(1) * BN + tl.arange(0, BN)
        for choice in tl.static_range(CHOICES):
            expert, _, live = pairs[choice]
            prefetch_rows(w2_ptr + expert * hidden * I, col, (col < hidden) & live, I, I)
    if not PRELOAD:
        wait_for_previous(USE_PDL)
    _down_block(act_ptr, w2_ptr, pairs, out_ptr, hidden, counter_ptr, ws_ptr, stride_se, stride_ws,
                r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0, nw_ptr, x_out_ptr, h_ptr, h32_ptr,
                width, eps, sums_ptr, terms, tl.program_id(0), tl.program_id(1), tl.num_programs(1), CHOICES, I, BN,
                BK, STAGES, W_SCALES, ROW_BLOCKS, NORM, BLOCK, HAS_RESIDUAL, HAS_UB, HAS_US, HAS_RB, HAS_RS,
                HAS_SKIP, FP32_COPY, PENDING, PRELOAD)


def _rows_streamed(rows: int, top_k: int, fp8: Fp8Scales | None) -> int:
    """The weight rows the tiles are cut for: one pair's (16-bit), or a token's top_k pairs' together (e4m3: at
    half the bytes a program, a decode token's 8 Ling experts already give programs enough). Shapes and top_k only,
    never the batch: a pair's row keeps its bits whatever else is in the step."""
    return rows * top_k if fp8 is not None else rows


def gate_up_tiles(inter: int, hidden: int, fp8: Fp8Scales | None = None, top_k: int = 1) -> Tiles:
    """BN interleaved gate|up rows (BN / 2 intermediate columns) per program; at least one column. One choice a
    token of 16-bit experts (ZAYA1): a K of one chunk, every load of a program in flight at once (the expert is
    known only after the PDL wait, so nothing loads before it). On an H100, ZAYA1-8B's batch 1 decoded 7% faster
    with these (4 rows of 2048, 1024 programs) than with 16 rows in 4 pipelined chunks of 512 (256 programs);
    8 rows in 2 chunks gave +4%, 32 rows in 4 chunks -2% (docs/performance.md)."""
    return tiles(1, _rows_streamed(2 * inter, top_k, fp8), hidden, min_rows=2, min_chunk=min_chunk(fp8),
                 one_chunk=top_k == 1 and fp8 is None, stages=pipeline_stages(fp8))


def down_tiles(hidden: int, inter: int, fp8: Fp8Scales | None = None, top_k: int = 1) -> Tiles:
    """One choice a token of 16-bit experts (ZAYA1): each program's rows in one K chunk, loaded before the PDL wait
    (`_down_block`'s WAIT); the same tiles reduced or not, so both forms' rows keep the same bits."""
    return tiles(1, _rows_streamed(hidden, top_k, fp8), inter, min_chunk=min_chunk(fp8),
                 one_chunk=top_k == 1 and fp8 is None, stages=pipeline_stages(fp8))


def _check_selection(selection: DeferredSelection, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     experts: int, reduce: bool) -> None:
    """What the kernels write and read of a deferred selection: one choice a token over E + 1 classes; topk_ids
    int64 and topk_weights fp32 contiguous (the gate/up launch stores into them)."""
    tokens, parts, classes = selection.partials.shape
    ok = (reduce and topk_ids.shape == (tokens, 1) and topk_ids.dtype == torch.int64 and topk_ids.is_contiguous()
          and topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
          and selection.balancing_biases.shape == (experts + 1,) and classes >= experts + 1
          and selection.partials.is_contiguous())
    if not ok:
        raise ValueError(f"a deferred selection needs one choice a token over {experts} experts + skip, reduced, "
                         f"with contiguous int64 ids and fp32 weights; got partials {tuple(selection.partials.shape)}, "
                         f"ids {tuple(topk_ids.shape)} {topk_ids.dtype}, weights {topk_weights.dtype}")


def takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether ops.moe gives these pairs this form: at most MAX_PAIRS of them (decode), x rows of unit column
    stride, contiguous weights. A host-size test."""
    return topk_ids.numel() <= MAX_PAIRS and x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()


def _expert_scales(scales: tuple) -> tuple:
    """`gemv.fp8_args`' scale arguments for a stack: the scales' stride between experts after their base."""
    scale, stride_ws = scales
    return scale, scale.stride(0), stride_ws


def _gate_up_row_blocks(inter: int, rows: int) -> int:
    """`gemv.fp8_args`' ROW_BLOCKS of a gate/up program: its rows pair BN / 2 consecutive gate rows with the up rows
    `inter` below them, a scale block each where `inter` is a whole number of blocks (else unknown, 0)."""
    return 2 if inter % SCALE_BLOCK == 0 and rows // 2 <= SCALE_BLOCK else 0


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, reduce: bool = True,
                  config: tuple[Tiles, Tiles] | None = None, norm: ResidualNorm | None = None,
                  fp8: tuple[Fp8Scales, Fp8Scales] | None = None, selection: DeferredSelection | None = None):
    """x [T, H]; w13 [E, 2I, H] (gate rows first); w2 [E, H, I]; topk_ids/weights [T, K] -> [T, H] in x's dtype,
    or with `reduce=False` the K weighted rows [T, K, H] (see `ops.moe.fused_experts`); with `norm` (reduced
    only), `norm` applied to the [T, H] result in the down launch: -> its (x, h, h32). Any T*K works (ops.moe
    takes this form up to MAX_PAIRS; the norm epilogue up to MAX_PAIRS tokens). `fp8`: the e4m3 stacks' (gate/up,
    down) scales. `config`: (gate/up, down) tiles instead of `gate_up_tiles` / `down_tiles` (tests, tuning).
    `selection`: ZAYA1's deferred class selection (one choice a token, E + 1 classes): both launches select from
    its partial logits, and the gate/up launch writes topk_ids, topk_weights (fp32) and the selection's outputs."""
    tokens, hidden, experts, inter, top_k = expert_shapes(x, w13, w2, topk_ids, topk_weights)
    if x.stride(1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("the GEMV experts need contiguous weights and x rows of unit column stride")
    if selection is not None:
        _check_selection(selection, topk_ids, topk_weights, experts, reduce)
    if norm is not None and (not reduce or tokens > MAX_PAIRS or norm.norm_weight.shape != (hidden,)):
        raise ValueError(f"the experts' norm epilogue needs reduced rows, at most {MAX_PAIRS} tokens and a norm "
                         f"over the {hidden} outputs")
    pairs = tokens * top_k
    out = torch.empty(tokens if reduce else pairs, hidden, dtype=x.dtype, device=x.device)
    pending = norm is not None and norm.h_pending
    epilogue, flags, normed = epilogue_args(norm, tokens, hidden, out, pending)
    up_fp8, down_fp8 = fp8 if fp8 is not None else (None, None)
    up_tiles, down = config or (gate_up_tiles(inter, hidden, up_fp8, top_k), down_tiles(hidden, inter, down_fp8, top_k))
    if pending:  # x and each down program's sum of squares: the reader of h finishes the norm
        sums = torch.empty(tokens, cdiv(hidden, down.BN), dtype=torch.float32, device=x.device)
        normed = (normed[0], PendingNorm(normed[0], sums, norm.norm_weight, norm.eps), None)
    if pairs:
        if up_tiles.BN < 2 or up_tiles.BT != 1 or down.BT != 1:
            raise ValueError(f"GEMV expert tiles need BT = 1 and at least 2 gate/up rows; got {up_tiles}, {down}")
        up_scales, up_kinds = fp8_args(up_fp8, w13, up_tiles, _gate_up_row_blocks(inter, up_tiles.BN))
        down_scales, down_kinds = fp8_args(down_fp8, w2, down, consecutive_row_blocks(down.BN))
        ids = topk_ids.reshape(-1).contiguous()
        weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
        act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
        if selection is None:
            deferred, parts, bc = (x,) * 5, 0, 1
        else:
            deferred = (selection.partials, selection.balancing_biases, selection.choice, selection.weight,
                        selection.skip_weight)
            _, parts, bc = selection.partials.shape
        _gemv_gate_up_kernel[(pairs, cdiv(2 * inter, up_tiles.BN))](
            x, w13, ids, weights, act, x.stride(0), inter, *_expert_scales(up_scales), *deferred, TOP_K=top_k,
            EXPERTS=experts, H=hidden, BN=up_tiles.BN, BK=up_tiles.BK, STAGES=up_tiles.STAGES, **up_kinds,
            PARTS=parts, BC=bc, num_warps=up_tiles.num_warps, **pdl.launch(x.device))
        counter = arrival_counters("moe_down_norm", MAX_PAIRS, x.device) if norm is not None and not pending else out
        _gemv_down_kernel[(out.shape[0], cdiv(hidden, down.BN))](
            act, w2, ids, weights, out, hidden, counter, *_expert_scales(down_scales), *epilogue,
            sums if pending else out, *deferred[:2], CHOICES=top_k if reduce else 1, EXPERTS=experts, I=inter,
            BN=down.BN, BK=down.BK, STAGES=down.STAGES, **down_kinds, NORM=norm is not None, **flags,
            PENDING=pending, PARTS=parts, BC=bc, num_warps=down.num_warps, **pdl.launch(x.device))
    if norm is not None:
        return normed
    return out if reduce else out.view(tokens, top_k, hidden)
