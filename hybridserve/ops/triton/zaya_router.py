"""ZAYA1's EDA router, down-projection included, in fp32 Triton kernels (contract: ops/reference/zaya_router.py).

Decode (at most `FUSED_MAX_TOKENS` tokens, the CUDA-graph batch sizes): three launches of `_dense_kernel` (launch 1
`_normed_down_kernel` where it runs the norm; two launches where fc1 is folded into it, under 2.).
    1. z = x32 @ Wd^T + bd (+ carry * scale)         the EDA carry handed to the next layer's router; where a
                                                      program's rows are whole in one K chunk (1-2 tokens at
                                                      ZAYA1-8B's widths), `normed_route` runs it on the update
                                                      of o_proj instead, x32 the post-attention residual norm of
                                                      it, computed by every program for its rows
                                                      (`_normed_down_kernel`): o_proj's launch then ends without a
                                                      last-arriving program's norm on the step's critical path
    2. u1 = GELU(fc1(RMSNorm(z)))                     every program recomputes its rows' rstd (RMSNorm needs all
                                                      of z, which only exists after launch 1). Where launch 1
                                                      runs the norm and launch 3 takes its rows whole (1-2
                                                      tokens at ZAYA1-8B's widths, `takes_folded_fc1`), fc1 is
                                                      folded into launch 1 instead (`FoldedFc1`: it computes
                                                      y' beside z) and launch 3 makes GELU(rstd(z) y' + b1) on
                                                      the way in: two launches
    3. u2 = GELU(fc2(u1)), then per token block the last program to finish it computes the E + 1 class logits,
       softmax, the biased argmax and the routing outputs. Or, with a deferred selection (`normed_route`'s
       defer_selection, for the GEMV experts that consume it), each of at most DEFERRED_PARTS programs stores its
       columns' share of the logits, and the experts' two launches each make the selection from those partial
       logits (`deferred_choice`): the last-arriving program, its counter and its reads back leave the critical
       path of a decode step.
At a few tokens a step what costs is reading the weights (the down-projection's is 2 MB of fp32) and the launches,
not arithmetic. So each launch is split over output columns and tokens into about `PROGRAMS` programs (one per SM
of an H200), each reading only its slice of the weight, and no program pads its rows to tl.dot's 16: products are
broadcast multiply-adds into a [tokens, columns, K chunk] fp32 register tile, reduced over K once at the end (a
reduction per chunk would cost more shuffles than multiply-adds). One token (the commonest decode) reads its whole
K in a single chunk, every load in flight at once; larger buckets loop over K with the chunks' loads pipelined
(cp.async, PIPELINE_STAGES deep), since a loop of plain loads waits one memory round trip per chunk. The
class selection rides on launch 3 instead of a launch of its own: each program stores its u2 columns, then bumps
its token block's arrival counter (acq_rel: the stores before it are visible to whoever acquires it later); the
program that arrives last reads the whole u2 rows back through L2 and resets the counter to 0, so the next call (and
every CUDA-graph replay) starts from zero (ops/triton/counters.py).

Prefill (more tokens): the three matmuls become FLOP-bound (8192 tokens: 8.6 GFLOP in the down-projection; at
512 tokens 0.54 GFLOP), and plain fp32 FMAs are slow: cuBLAS's fp32 GEMM ran the 8192-token down-projection in
0.19 ms (44 TFLOPS), and the router's three GEMMs took 10 of a 56 ms prefill chunk's kernel time. So the prefill
form runs them on the tensor cores in 3xTF32 (`_gemm_kernel`, tl.dot's input_precision "tf32x3"): each fp32
operand is split into a TF32 part and a TF32 remainder, and the three products that matter are summed in fp32;
the dropped remainder x remainder term is about 2^-22 of each product, the size of fp32's own rounding, so the
result keeps fp32 accuracy (tests: 1e-5 at ZAYA1-8B widths on the GPU) where one TF32 pass (2^-11) would not.
Tiles are chosen per token-count bucket to fill the SMs; at a few hundred tokens (one wave of the smallest tiles)
a GEMM with a long K is cut into K splits that a second launch sums (`gemm_splits`). Around the GEMMs one ops.norm
kernel adds the carry and normalises, the GELUs ride in the GEMMs' epilogues (or the sum's), and `_select_kernel`
selects: five or six launches where the torch reference takes about fifteen. The switch between the forms depends
only on the host-known token count.

Numerics are fp32 end to end (a top-1 choice flips on a near-tie, and a flip changes a token by a whole expert);
only summation orders (and, in the prefill form, 3xTF32's remainder rounding) differ from the reference.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from hybridserve.ops.reference.zaya_router import DeferredSelection, FoldedFc1, Routing
from hybridserve.ops.residual_norm_args import ResidualNormArgs
from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.counters import arrival_counters
from hybridserve.ops.triton.norm import epilogue_args, prefetch_row_inputs, residual_norm_rows, residual_rms_norm
from hybridserve.ops.triton.pdl import prefetch_rows, prefetch_share, wait_for_previous
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2

# The largest decode batch captured in a CUDA graph (and the last tile bucket the launch constants below were sized
# for); beyond it the prefill form (cuBLAS matmuls) runs. benchmarks/ops/zaya_router.py times both forms on each side.
FUSED_MAX_TOKENS = 256
PROGRAMS = 128  # programs per fused launch to aim for: about one per SM of an H200 (132 SMs)
TILE_ELEMENTS = 8192  # a program's [tokens, columns, K chunk] product tile: 64 fp32 registers a thread at 4 warps
WARPS = 4
PIPELINE_STAGES = 6  # K chunks in flight (cp.async) per program when its loop has several: latency, not FLOPs
SELECT_TOKENS = 16  # tokens per program of the prefill form's selection at most (fewer where PROGRAMS need them)
GEMM_BK = 32  # K chunk of the prefill form's GEMM tiles (fp32: [128, 32] + [32, 128] is 32 KB a stage)
GEMM_STAGES = 3
# The prefill form's K splits (`gemm_splits`): up to this many tokens, into about SPLIT_WAVES x PROGRAMS programs,
# each at least SPLIT_CHUNKS chunks of K.
SPLIT_MAX_TOKENS = 1024
SPLIT_WAVES = 4
SPLIT_CHUNKS = 16
SUM_BLOCK = 1024  # elements a program of the split sum adds
# `deferred_choice`'s fixed point: the exponentials (at most 1 each) times 2^57, so that a sum of up to 32 classes
# (2^62 at most) fits an int64; a part below 2^-57 of the largest is dropped, far below fp32's 2^-24 of the sum.
FIXED_POINT = tl.constexpr(2.0 ** 57)
DEFERRED_PARTS = 16  # partial logit rows a token of a deferred selection (fc2's programs): what each selector reads
MAX_DEFERRED_CLASSES = 32  # the classes `FIXED_POINT` leaves room for


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _rows_times_cols(x_ptr, w_ptr, vec_ptr, rows, row_ok, cols, col_ok, K: tl.constexpr, BT: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, X_VEC: tl.constexpr,
                     X_GELU: tl.constexpr, CACHE: tl.constexpr, WAIT: tl.constexpr = False, z_ptr=None, eps=0.0,
                     X_FOLD: tl.constexpr = False):
    """([BT, BN] fp32: sum over k of x'[rows, k] * w[cols, k] (both row-major with K columns), [BT]: sum over k of
    x[rows, k]^2), where x' is x (times vec[k], with X_VEC) (GELU'd, with X_GELU). Products are accumulated per K
    lane, summed once at the end (no shuffles inside the loop); STAGES > 1 pipelines the chunks' loads (cp.async),
    so that more than one chunk is in flight. The squares cost nothing where unused (dead code).
    WAIT: x is the kernel before's output, w no kernel's, so `pdl.wait_for_previous` comes after the weights' loads
    are issued: one chunk (every decode bucket up to a few tokens) is loaded whole into registers, streaming in while
    the kernel before finishes; a loop has its first bytes asked of L2.
    X_FOLD (one chunk): x is fc1's folded product y' of a folded launch 1 (`FoldedFc1`) and z_ptr its z, so
    x' = GELU(y' * rstd(z) + vec), vec fc1's bias: fc1's output u1 made on the way in."""
    tl.static_assert(not X_FOLD or BK >= K, "a folded fc1 takes its rows whole: one chunk")
    PRELOAD: tl.constexpr = WAIT and BK >= K
    if PRELOAD:
        first = tl.load(w_ptr + cols[:, None] * K + tl.arange(0, BK)[None, :],
                        mask=col_ok[:, None] & (tl.arange(0, BK) < K)[None, :], other=0.0)
    elif WAIT:
        prefetch_rows(w_ptr, cols, col_ok, K, K)
    if X_FOLD:  # fc1's bias: a weight, loaded with the weights
        fold_bias = tl.load(vec_ptr + tl.arange(0, BK), mask=tl.arange(0, BK) < K, other=0.0)
    wait_for_previous(WAIT)
    acc = tl.zeros((BT, BN, BK), dtype=tl.float32)
    squares = tl.zeros((BT, BK), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                    cache_modifier=CACHE)
        if X_FOLD:  # masked lanes: GELU(0 * rstd + 0) = 0
            z = tl.load(z_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                        cache_modifier=CACHE)
            x = _gelu(x * tl.rsqrt(tl.sum(z * z, axis=1) / K + eps)[:, None] + fold_bias[None, :])
        squares += x * x
        if X_VEC:
            x *= tl.load(vec_ptr + k, mask=k_ok, other=0.0)[None, :]
        if X_GELU:
            x = _gelu(x)  # GELU(0) = 0: masked lanes stay out of the sum
        if PRELOAD:
            w = first
        else:
            w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x[:, None, :] * w[None, :, :]
    return tl.sum(acc, axis=2), tl.sum(squares, axis=1)


@triton.jit
def _select(u_ptr, wo_ptr, bias_ptr, choice_ptr, weight_ptr, ids_ptr, expert_w_ptr, skip_w_ptr, rows, row_ok,
            K: tl.constexpr, CLASSES: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
            U_GELU: tl.constexpr, CACHE: tl.constexpr):
    """Class logits of u's `rows` (GELU'd on load with U_GELU), softmax, argmax over p + balancing biases (the
    first of equal maxima, as torch's argmax), and the routing outputs."""
    c = tl.arange(0, BC)
    c_valid = c < CLASSES
    balancing = class_biases(bias_ptr, CLASSES, BC)  # with the products' loads, not a round trip after
    logits, _ = _rows_times_cols(u_ptr, wo_ptr, u_ptr, rows, row_ok, c, c_valid, K, BT, BC, BK, 1, False, U_GELU,
                                 CACHE)
    c_ok = c_valid[None, :]
    logits = tl.where(c_ok, logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = e / tl.sum(e, axis=1)[:, None]
    biased = tl.where(c_ok, probs + balancing[None, :], float("-inf"))
    choice = tl.argmax(biased, axis=1, tie_break_left=True)
    weight = tl.sum(tl.where(c[None, :] == choice[:, None], probs, 0.0), axis=1)
    store_routing(choice, weight, rows, row_ok, choice_ptr, weight_ptr, ids_ptr, expert_w_ptr, skip_w_ptr, CLASSES)


@triton.jit
def class_biases(bias_ptr, CLASSES: tl.constexpr, BC: tl.constexpr):
    """The balancing biases as [BC] (0 past CLASSES): a weight, loadable before any wait."""
    c = tl.arange(0, BC)
    return tl.load(bias_ptr + c, mask=c < CLASSES, other=0.0)


@triton.jit
def routed(choice, weight, CLASSES: tl.constexpr):
    """(expert id int64, expert weight, skip weight) of a class choice and its probability: the last class is the MOD
    skip, which runs expert 0 at weight 0 and carries its probability as the skip weight."""
    skip = choice == CLASSES - 1
    return tl.where(skip, 0, choice).to(tl.int64), tl.where(skip, 0.0, weight), tl.where(skip, weight, 0.0)


@triton.jit
def store_routing(choice, weight, rows, row_ok, choice_ptr, weight_ptr, ids_ptr, expert_w_ptr, skip_w_ptr,
                  CLASSES: tl.constexpr):
    """Store the Routing's outputs of `rows` (`routed`'s mapping of their choices)."""
    expert, expert_weight, skip_weight = routed(choice, weight, CLASSES)
    tl.store(choice_ptr + rows, choice.to(tl.int64), mask=row_ok)
    tl.store(weight_ptr + rows, weight, mask=row_ok)
    tl.store(ids_ptr + rows, expert, mask=row_ok)
    tl.store(expert_w_ptr + rows, expert_weight, mask=row_ok)
    tl.store(skip_w_ptr + rows, skip_weight, mask=row_ok)


@triton.jit
def deferred_choice(partials_ptr, balancing, row, PARTS: tl.constexpr, CLASSES: tl.constexpr, BC: tl.constexpr):
    """(class index, its probability) of token `row` of a deferred selection: the class logits summed from the
    PARTS partial rows `_dense_kernel` stored with DEFER (partials[row, p, :BC]), softmax, argmax over p +
    `balancing` ([BC], the balancing biases) as `_select` does. The gate/up and the down launch each select for
    themselves, so both must get the same bits whatever layout their compiler picks: the parts are added one by one
    in part order (elementwise), and the softmax's one cross-lane sum is an integer sum (exact, so in any order) of
    the exponentials in fixed point; max and argmax are exact."""
    c = tl.arange(0, BC)
    ok = c < CLASSES
    base = partials_ptr + row.to(tl.int64) * (PARTS * BC)
    logits = tl.load(base + c, mask=ok, other=0.0)
    for part in tl.static_range(1, PARTS):
        logits += tl.load(base + part * BC + c, mask=ok, other=0.0)
    logits = tl.where(ok, logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=0))  # in (0, 1], the largest 1
    total = tl.sum((e * FIXED_POINT).to(tl.int64), axis=0).to(tl.float32) / FIXED_POINT
    probs = e / total
    choice = tl.argmax(tl.where(ok, probs + balancing, float("-inf")), axis=0, tie_break_left=True)
    return choice, tl.sum(tl.where(c == choice, probs, 0.0), axis=0)


@triton.jit
def _block_inputs(b_ptr, carry_ptr, scale_ptr, tile, ok, cols, col_ok, CARRY: tl.constexpr):
    """(bias [BN], carry [BT, BN], scale [BN]; carry and scale 0 without CARRY) of a block, loaded before the wait:
    the bias and scale are weights, the carry the layer before's router output (launches back). After the products
    they would be an L2 round trip of their own (no load moves across the sum's barrier)."""
    bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
    carry, scale = 0.0, 0.0
    if CARRY:
        carry = tl.load(carry_ptr + tile, mask=ok, other=0.0)
        scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
    return bias, carry, scale


@triton.jit
def _block_output(acc, bias, carry, scale, out_ptr, tile, ok, CARRY: tl.constexpr, GELU: tl.constexpr):
    """Store act(acc + bias (+ carry * scale)) of a block; -> it."""
    acc += bias[None, :]
    if CARRY:
        acc += carry * scale[None, :]
    if GELU:
        acc = _gelu(acc)
    tl.store(out_ptr + tile, acc, mask=ok)
    return acc


@triton.jit
def _dense_block(x_ptr, w_ptr, b_ptr, out_ptr, num_tokens, carry_ptr, scale_ptr, norm_ptr, eps, token_block, col_block,
                 K: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 STAGES: tl.constexpr, CARRY: tl.constexpr, NORM: tl.constexpr, GELU: tl.constexpr,
                 WAIT: tl.constexpr = False, z_ptr=None, X_FOLD: tl.constexpr = False):
    """out[rows, cols] = act(x'[rows] @ w[cols]^T + b[cols]) (+ carry[rows, cols] * scale[cols], with CARRY) for
    BT tokens and BN columns (blocks `token_block`, `col_block`); x' = norm_weight * x * rstd(x) with NORM (or, with
    X_FOLD, fc1's output from its folded product x and z: `_rows_times_cols`, norm_ptr fc1's bias), act = GELU with
    GELU. WAIT: the PDL wait comes inside, after the weights' loads (`_rows_times_cols`).
    -> (rows, row_ok, the stored block)."""
    rows = token_block * BT + tl.arange(0, BT)
    row_ok = rows < num_tokens
    cols = col_block * BN + tl.arange(0, BN)
    col_ok = cols < N
    tile = rows[:, None] * N + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    bias, carry, scale = _block_inputs(b_ptr, carry_ptr, scale_ptr, tile, ok, cols, col_ok, CARRY)
    acc, squares = _rows_times_cols(x_ptr, w_ptr, norm_ptr, rows, row_ok, cols, col_ok, K, BT, BN, BK, STAGES, NORM,
                                    False, "", WAIT, z_ptr, eps, X_FOLD)
    if NORM:  # rstd after the product: (x * w_norm) @ W^T * rstd = (w_norm * x * rstd) @ W^T
        acc *= tl.rsqrt(squares / K + eps)[:, None]
    return rows, row_ok, _block_output(acc, bias, carry, scale, out_ptr, tile, ok, CARRY, GELU)


@triton.jit(do_not_specialize=["num_tokens"])  # one variant for every token count of a tile bucket
def _dense_kernel(x_ptr, w_ptr, b_ptr, out_ptr, num_tokens, carry_ptr, scale_ptr, norm_ptr, eps,
                  counter_ptr, wo_ptr, bias_ptr, choice_ptr, weight_ptr, ids_ptr, expert_w_ptr, skip_w_ptr,
                  partials_ptr, z_ptr, K: tl.constexpr, N: tl.constexpr, CLASSES: tl.constexpr, BT: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, BC: tl.constexpr, BKC: tl.constexpr,
                  CARRY: tl.constexpr, NORM: tl.constexpr, GELU: tl.constexpr, SELECT: tl.constexpr,
                  DEFER: tl.constexpr, X_FOLD: tl.constexpr, USE_PDL: tl.constexpr):
    """`_dense_block` of this program's BT tokens and BN columns (X_FOLD: fc2 on a folded launch 1's y' and z,
    z_ptr). With SELECT, the token block's last program to
    finish then selects its classes from the whole out rows; the class weights and balancing biases it reads are
    asked of L2 before the wait, two lines a program (weights last read a step ago: HBM, on the critical path).
    With DEFER instead, each program stores its columns' share of the class logits, [BT, BC] at partials[rows,
    program], out_proj's columns loaded before the wait, and leaves the selection to the experts' launches
    (`deferred_choice`): no arrival counter, no last program."""
    if SELECT and USE_PDL:
        program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        prefetch_share(wo_ptr, CLASSES * N, program, LINES=2)
        prefetch_share(bias_ptr, CLASSES, program)
    if DEFER:
        c = tl.arange(0, BC)
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        wo = tl.load(wo_ptr + c[:, None] * N + cols[None, :], mask=(c < CLASSES)[:, None] & (cols < N)[None, :],
                     other=0.0)
    rows, row_ok, out = _dense_block(x_ptr, w_ptr, b_ptr, out_ptr, num_tokens, carry_ptr, scale_ptr, norm_ptr, eps,
                                     tl.program_id(1), tl.program_id(0), K, N, BT, BN, BK, STAGES, CARRY, NORM,
                                     GELU, USE_PDL, z_ptr, X_FOLD)  # (the PDL wait, after the weights' loads)
    if DEFER:
        part = tl.sum(out[:, None, :] * wo[None, :, :], axis=2)  # masked columns: GELU(0) = 0, wo 0
        slots = (rows[:, None] * tl.num_programs(0) + tl.program_id(0)) * BC + c[None, :]
        tl.store(partials_ptr + slots, part, mask=row_ok[:, None])
    if SELECT:
        tl.debug_barrier()  # every thread's stores precede the release below
        arrived = tl.atomic_add(counter_ptr + tl.program_id(1), 1, sem="acq_rel")
        if arrived == tl.num_programs(0) - 1:
            _select(out_ptr, wo_ptr, bias_ptr, choice_ptr, weight_ptr, ids_ptr, expert_w_ptr, skip_w_ptr, rows,
                    row_ok, N, CLASSES, BT, BC, BKC, False, ".cg")  # .cg: the other programs' u2, from L2
            tl.store(counter_ptr + tl.program_id(1), 0)


@triton.jit
def _folded_inputs(fb_ptr, fc_ptr, carry_ptr, rows, row_ok, cols, col_ok, N: tl.constexpr, BW: tl.constexpr,
                   CARRY: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
    """(bias [BN], carry term [BT, BN]) of a block of fc1's folded product y' (`FoldedFc1`): its folded bias and,
    with CARRY, carry[rows] @ carry_weight[cols]^T, all loaded (and the term summed) before the wait."""
    bias = tl.load(fb_ptr + cols, mask=col_ok, other=0.0)
    term = tl.zeros((BT, BN), dtype=tl.float32)
    if CARRY:
        j = tl.arange(0, BW)  # the carry's N columns, padded
        carry = tl.load(carry_ptr + rows[:, None] * N + j[None, :], mask=row_ok[:, None] & (j < N)[None, :],
                        other=0.0)
        weight = tl.load(fc_ptr + cols[:, None] * N + j[None, :], mask=col_ok[:, None] & (j < N)[None, :],
                         other=0.0)
        term = tl.sum(carry[:, None, :] * weight[None, :, :], axis=2)
    return bias, term


@triton.jit(do_not_specialize=["num_tokens"])
def _normed_down_kernel(u_ptr, u_s0, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0, nw_ptr,
                        x_out_ptr, h_ptr, h32_ptr, width, eps, w_ptr, b_ptr, out_ptr, num_tokens, carry_ptr,
                        scale_ptr, fw_ptr, fb_ptr, fc_ptr, y_ptr, K: tl.constexpr, N: tl.constexpr,
                        BW: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, HAS_UB: tl.constexpr, HAS_US: tl.constexpr, HAS_RB: tl.constexpr,
                        HAS_RS: tl.constexpr, HAS_SKIP: tl.constexpr, FP32_COPY: tl.constexpr, CARRY: tl.constexpr,
                        FOLD: tl.constexpr, USE_PDL: tl.constexpr):
    """Launch 1 with the residual norm that makes its input as a prologue (`normed_route`): z[rows, cols] = h[rows]
    @ w[cols]^T + b (+ carry * scale), h = the residual norm of the update u (its arguments are `norm.
    residual_norm_row`'s). Every program normalises its BT rows itself (all of K, one chunk: the weight tile is in
    registers before the wait) and the token block's first column block stores x and h for the launches after.
    FOLD: as many programs again compute fc1's folded product y'[rows, cols] = h @ fw[cols]^T + fb (+ carry @
    fc[cols]^T) into y (`FoldedFc1`), so that no launch of its own runs fc1."""
    Z_BLOCKS: tl.constexpr = (N + BN - 1) // BN
    block = tl.program_id(0)
    rows = tl.program_id(1) * BT + tl.arange(0, BT)
    row_ok = rows < num_tokens
    k = tl.arange(0, BLOCK)
    if FOLD and block >= Z_BLOCKS:
        cols = (block - Z_BLOCKS) * BN + tl.arange(0, BN)
        col_ok = cols < N
        w = tl.load(fw_ptr + cols[:, None] * K + k[None, :], mask=col_ok[:, None] & (k < K)[None, :], other=0.0)
        bias, term = _folded_inputs(fb_ptr, fc_ptr, carry_ptr, rows, row_ok, cols, col_ok, N, BW, CARRY, BT, BN)
        out = y_ptr + rows[:, None] * N + cols[None, :]
    else:
        cols = block * BN + tl.arange(0, BN)
        col_ok = cols < N
        w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=col_ok[:, None] & (k < K)[None, :], other=0.0)
        tile = rows[:, None] * N + cols[None, :]
        bias, carry, scale = _block_inputs(b_ptr, carry_ptr, scale_ptr, tile, row_ok[:, None] & col_ok[None, :],
                                           cols, col_ok, CARRY)
        term = tl.zeros((BT, BN), dtype=tl.float32)
        if CARRY:
            term = carry * scale[None, :]
        out = out_ptr + tile
    if USE_PDL:  # the norm's vectors and residual rows (weights, and a residual written launches back) into L2
        for t in tl.static_range(BT):
            row = tl.program_id(1) * BT + t
            if row < num_tokens:
                prefetch_row_inputs(row, block, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0,
                                    nw_ptr, width, HAS_RESIDUAL, HAS_UB, HAS_US, HAS_RB, HAS_RS, HAS_SKIP)
    wait_for_previous(USE_PDL)
    h = residual_norm_rows(rows, row_ok, block == 0, u_ptr, u_s0, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr,
                           rs_ptr, sw_ptr, sx_ptr, sx_s0, nw_ptr, x_out_ptr, h_ptr, h32_ptr, width, eps, BLOCK,
                           HAS_RESIDUAL, HAS_UB, HAS_US, HAS_RB, HAS_RS, HAS_SKIP, FP32_COPY, "")
    acc = tl.sum(h[:, None, :] * w[None, :, :], axis=2)  # one chunk, as `_rows_times_cols` with BK >= K
    acc += bias[None, :]
    acc += term  # + 0 without CARRY: the same bits as `_block_output`'s
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, num_tokens, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, GELU: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    """out[rows, cols] = act(x[rows] @ w[cols]^T + b[cols]) for this program's BM x BN tile, x [num_tokens, K] and
    w [N, K] fp32 row-major; the product in 3xTF32 on the tensor cores (module docstring). With SPLIT_K < K this
    program takes K columns [split * SPLIT_K, (split + 1) * SPLIT_K) (split: program_id 2) and stores its partial
    product, without bias or activation, into out [splits, num_tokens, N] for `_split_sum_kernel`."""
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok, col_ok = rows < num_tokens, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_lo = tl.program_id(2) * SPLIT_K  # SPLIT_K is a multiple of BK: no chunk crosses into the next split
    for k0 in tl.range(k_lo, k_lo + SPLIT_K, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * K + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision="tf32x3")
    if SPLIT_K < K:
        part = tl.program_id(2).to(tl.int64) * num_tokens + rows
        tl.store(out_ptr + part[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if GELU:
            acc = _gelu(acc)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["elements"])
def _split_sum_kernel(part_ptr, b_ptr, out_ptr, elements, N: tl.constexpr, SPLITS: tl.constexpr,
                      BLOCK: tl.constexpr, GELU: tl.constexpr):
    """out = act(sum of the SPLITS partial products in split order + b), `elements` = tokens x N of each."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < elements
    acc = tl.load(part_ptr + offsets, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + split * elements + offsets, mask=ok, other=0.0)
    acc += tl.load(b_ptr + offsets % N, mask=ok, other=0.0)
    if GELU:
        acc = _gelu(acc)
    tl.store(out_ptr + offsets, acc, mask=ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _select_kernel(u_ptr, wo_ptr, bias_ptr, choice_ptr, weight_ptr, ids_ptr, expert_w_ptr, skip_w_ptr, num_tokens,
                   K: tl.constexpr, CLASSES: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_ok = rows < num_tokens
    _select(u_ptr, wo_ptr, bias_ptr, choice_ptr, weight_ptr, ids_ptr, expert_w_ptr, skip_w_ptr, rows, row_ok, K,
            CLASSES, BT, BC, BK, False, "")


def _arrival_counters(device: torch.device) -> torch.Tensor:
    """The per-token-block arrival counters of launch 3 (a block holds at least one token)."""
    return arrival_counters("zaya_router", FUSED_MAX_TOKENS, device)


def _loop(rows: int, cols: int, k: int) -> dict:
    """BK and STAGES of a fused launch's K loop: pipelined when it has more than one chunk."""
    chunk = _chunk(rows, cols, k)
    return dict(BK=chunk, STAGES=PIPELINE_STAGES if chunk < k else 1)


def _chunk(rows: int, cols: int, k: int) -> int:
    """K chunk of a [rows, cols, chunk] product tile of about TILE_ELEMENTS (at least 8 lanes, one 32-byte sector
    of a row; at most K)."""
    return min(max(8, TILE_ELEMENTS // (rows * cols)), next_power_of_2(k))


def fused_tiles(tokens: int, n: int) -> tuple[int, int]:
    """(tokens, columns) per program of a fused launch with N output columns: about PROGRAMS programs, as square
    as powers of two allow (a program reads (BT + BN) * K inputs for BT * BN * K products). Bucketed by the next
    power of two of the token count, as the warm-up ladder is."""
    area = max(1, next_power_of_2(tokens) * n // PROGRAMS)
    bt = min(next_power_of_2(tokens), 1 << ((area.bit_length() - 1) // 2))
    return bt, min(next_power_of_2(n), next_power_of_2(-(-area // bt)))


def _outputs(tokens: int, planes: int, width: int, device: torch.device):
    """(choice [T], ids [T, 1], weight, expert weight, skip weight [T, 1], `planes` fp32 [T, width] buffers) in two
    allocations (each a few us of host time, 40 layers a step). Every piece starts on a 16-byte boundary (rows padded
    to `padded`): Triton specialises pointers on that, so every token count shares the same variants."""
    padded = -(-tokens // 4) * 4
    choice, ids = torch.empty(2, padded, 1, device=device, dtype=torch.int64)[:, :tokens]
    buffer = torch.empty(padded * (3 + planes * width), device=device, dtype=torch.float32)
    weight, expert_w, skip_w = buffer[:3 * padded].view(3, padded, 1)[:, :tokens]
    return choice[:, 0], ids, weight, expert_w, skip_w, buffer[3 * padded:].view(planes, padded, width)[:, :tokens]


def _check_router_tensors(*tensors: torch.Tensor) -> None:
    """What the router kernels read: contiguous fp32 tensors."""
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        raise ValueError("the router kernels take contiguous fp32 tensors")


def _checked_carry(carry: torch.Tensor | None, states_scale: torch.Tensor | None, *weights: torch.Tensor) -> tuple:
    """(carry, states_scale), both None unless both are given (the EDA carry is added only with its scale), after
    `_check_router_tensors` of them and the router's weights."""
    if carry is None or states_scale is None:
        carry = states_scale = None
    _check_router_tensors(*weights, *((carry, states_scale) if carry is not None else ()))
    return carry, states_scale


def eda_route(x32: torch.Tensor, down_weight: torch.Tensor, down_bias: torch.Tensor, carry: torch.Tensor | None,
              states_scale: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, fc1_weight: torch.Tensor,
              fc1_bias: torch.Tensor, fc2_weight: torch.Tensor, fc2_bias: torch.Tensor, out_weight: torch.Tensor,
              balancing_biases: torch.Tensor) -> Routing:
    carry, states_scale = _checked_carry(carry, states_scale, x32, down_weight, down_bias, norm_weight, fc1_weight,
                                         fc1_bias, fc2_weight, fc2_bias, out_weight, balancing_biases)
    route = fused_route if x32.shape[0] <= FUSED_MAX_TOKENS else gemm_route
    return route(x32, down_weight, down_bias, carry, states_scale, norm_weight, eps, fc1_weight, fc1_bias, fc2_weight,
                 fc2_bias, out_weight, balancing_biases)


def fused_route(x32, down_weight, down_bias, carry, states_scale, norm_weight, eps, fc1_weight, fc1_bias, fc2_weight,
                fc2_bias, out_weight, balancing_biases) -> Routing:
    """The decode form: three `_dense_kernel` launches (module docstring). Arguments as `eda_route`'s, checked."""
    tokens, hidden = x32.shape
    width, classes = down_weight.shape[0], out_weight.shape[0]
    choice, ids, weight, expert_w, skip_w, (z, u1, u2) = _outputs(tokens, 3, width, x32.device)
    if tokens:
        grid, common = _fused_launch(tokens, width, classes, x32.device)
        dummy = x32
        _dense_kernel[grid](x32, down_weight, down_bias, z, tokens, carry if carry is not None else dummy,
                            states_scale if carry is not None else dummy, dummy, eps, *(dummy,) * 10,
                            K=hidden, **_loop(common["BT"], common["BN"], hidden), CARRY=carry is not None,
                            NORM=False, GELU=False, SELECT=False, DEFER=False, X_FOLD=False, **common)
        _mlp_launches(grid, common, z, u1, u2, tokens, norm_weight, eps, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                      (out_weight, balancing_biases, choice, weight, ids, expert_w, skip_w))
    return Routing(choice, weight, ids, expert_w, skip_w, z)


def takes_residual_norm(tokens: int, hidden: int, width: int) -> bool:
    """Whether `normed_route` runs the residual norm in launch 1: a decode bucket whose launch-1 tile holds all of
    K in one chunk (at ZAYA1-8B's widths, 1 and 2 tokens), where every program has its rows whole anyway."""
    if not 0 < tokens <= FUSED_MAX_TOKENS:
        return False
    bt, bn = fused_tiles(tokens, width)
    return _chunk(bt, bn, hidden) >= hidden


def normed_route(update: torch.Tensor, norm: ResidualNormArgs, down_weight, down_bias, carry, states_scale,
                 norm_weight, eps, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight, balancing_biases,
                 defer_selection: bool = False, folded: FoldedFc1 | None = None):
    """`norm` of `update` [T, H] and the decode form's routing of its output, the norm as launch 1's prologue
    (`_normed_down_kernel`): the launch that computes the update (o_proj) no longer ends in a last-arriving
    program's norm. Only where `takes_residual_norm`; the other arguments as `eda_route`'s (the carry added only
    with states_scale). `defer_selection`: launch 3 stores partial class logits instead of selecting, and the
    Routing's `selection` hands them to the experts' launches (`ops.triton.moe_gemv`), which select for themselves
    and write its choice, weight, expert_ids, expert_weights and skip_weight: one last-arriving program fewer.
    `folded` (`fold_fc1` of these weights): launch 1 also computes fc1's folded product and launch 3 makes fc1's
    output from it, two launches in all (where launch 3's tile takes fc1's rows whole).
    -> ((x fp32, h in the norm weight's dtype), Routing)."""
    tokens, hidden = update.shape
    width, classes = down_weight.shape[0], out_weight.shape[0]
    carry, states_scale = _checked_carry(carry, states_scale, down_weight, down_bias, norm_weight, fc1_weight,
                                         fc1_bias, fc2_weight, fc2_bias, out_weight, balancing_biases)
    if not takes_residual_norm(tokens, hidden, width) or update.stride(1) != 1:
        raise ValueError(f"normed_route: the norm prologue takes 1 to {FUSED_MAX_TOKENS} tokens of unit column "
                         f"stride whose rows fit launch 1's one chunk; got {tuple(update.shape)}")
    if folded is not None:
        _check_folded(folded, tokens, hidden, width, carry is not None, defer_selection)
    choice, ids, weight, expert_w, skip_w, (z, u1, u2) = _outputs(tokens, 3, width, update.device)
    prologue, flags, (x, h, _) = epilogue_args(replace(norm, fp32_copy=False), tokens, hidden, update)
    grid, common = _fused_launch(tokens, width, classes, update.device)
    fold = folded if folded is not None else FoldedFc1(update, update, update)
    _normed_down_kernel[(grid[0] * (1 if folded is None else 2), grid[1])](
        update, update.stride(0), *prologue, down_weight, down_bias, z, tokens,
        carry if carry is not None else update, states_scale if carry is not None else update, fold.weight,
        fold.bias, fold.carry_weight if carry is not None else update, u1, K=hidden, N=width,
        BW=next_power_of_2(width), BT=common["BT"], BN=common["BN"], CARRY=carry is not None,
        FOLD=folded is not None, **flags, num_warps=WARPS, **pdl.launch(update.device))
    select = (out_weight, balancing_biases, choice, weight, ids, expert_w, skip_w)
    selection = None
    if defer_selection:
        if classes > MAX_DEFERRED_CLASSES:
            raise ValueError(f"normed_route: a deferred selection takes at most {MAX_DEFERRED_CLASSES} classes; "
                             f"got {classes}")
        parts, _ = _deferred_tiles(tokens, width)
        partials = torch.empty(tokens, parts, common["BC"], device=update.device, dtype=torch.float32)
        selection = DeferredSelection(partials, balancing_biases, choice, weight, skip_w)
    _mlp_launches(grid, common, z, u1, u2, tokens, norm_weight, eps, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                  select, None if selection is None else selection.partials, folded is not None)
    return (x, h), Routing(choice, weight, ids, expert_w, skip_w, z, selection)


def _check_folded(folded: FoldedFc1, tokens: int, hidden: int, width: int, carry: bool, deferred: bool) -> None:
    """A folded fc1 for `normed_route`: its tensors' shapes, and launch 3's tile taking fc1's rows whole."""
    if folded.weight.shape != (width, hidden) or folded.bias.shape != (width,) or \
            (carry and (folded.carry_weight is None or folded.carry_weight.shape != (width, width))):
        raise ValueError(f"normed_route: a folded fc1 of a [{width}, {hidden}] down-projection takes a "
                         f"[{width}, {hidden}] weight, a [{width}] bias and, with the carry, a [{width}, {width}] "
                         f"carry weight")
    _check_router_tensors(folded.weight, folded.bias, *((folded.carry_weight,) if carry else ()))
    if not takes_folded_fc1(tokens, width, deferred):
        raise ValueError(f"normed_route: a folded fc1 needs fc2's launch to take rows of {width} whole; at {tokens} "
                         f"tokens its tile does not")


def takes_folded_fc1(tokens: int, width: int, deferred: bool) -> bool:
    """Whether fc2's launch of `normed_route` (deferred: the deferred selection's) takes rows of the router's width
    whole at `tokens` tokens, as a folded fc1 needs (ZAYA1-8B's widths: at 1 and 2 tokens)."""
    tiles = _deferred_tiles(tokens, width)[1] if deferred else fused_tiles(tokens, width)
    return _chunk(*tiles, width) >= width


def _deferred_tiles(tokens: int, width: int) -> tuple[int, tuple[int, int]]:
    """(parts, (BT, BN)) of launch 3 with a deferred selection: all tokens in one block, the columns in at most
    DEFERRED_PARTS blocks, since every selecting program reads all of a token's parts."""
    bn = next_power_of_2(cdiv(width, DEFERRED_PARTS))
    return cdiv(width, bn), (next_power_of_2(tokens), bn)


def _fused_launch(tokens: int, width: int, classes: int, device: torch.device) -> tuple[tuple[int, int], dict]:
    """(grid, the constexprs and launch options every decode-form launch shares)."""
    bt, bn = fused_tiles(tokens, width)
    bc = next_power_of_2(classes)
    return (cdiv(width, bn), cdiv(tokens, bt)), dict(N=width, CLASSES=classes, BT=bt, BN=bn, BC=bc,
                                                     BKC=_chunk(bt, bc, width), num_warps=WARPS, **pdl.launch(device))


def _mlp_launches(grid, common: dict, z, u1, u2, tokens, norm_weight, eps, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                  select: tuple, partials: torch.Tensor | None = None, folded: bool = False) -> None:
    """Launches 2 and 3 of the decode form on launch 1's z: u1 = GELU(fc1(RMSNorm(z))), then u2 = GELU(fc2(u1))
    and the selection (`select`: out_proj's weight, the balancing biases, then the routing outputs), or with
    `partials` [T, parts, BC] the partial class logits of a deferred one (`_deferred_tiles`). `folded`: launch 1
    left fc1's folded product in u1 (`FoldedFc1`), and launch 3 makes fc1's output from it and z: no launch 2."""
    dummy, width = z, z.shape[1]
    loop = _loop(common["BT"], common["BN"], width)
    if not folded:
        _dense_kernel[grid](z, fc1_weight, fc1_bias, u1, tokens, dummy, dummy, norm_weight, eps, *(dummy,) * 10,
                            K=width, **loop, CARRY=False, NORM=True, GELU=True, SELECT=False, DEFER=False,
                            X_FOLD=False, **common)
    # fc2 on u1; folded: u1 holds y', and its x' is GELU(y' * rstd(z) + fc1's bias) (the bias in norm_ptr's place)
    if partials is None:
        _dense_kernel[grid](u1, fc2_weight, fc2_bias, u2, tokens, dummy, dummy, fc1_bias, eps,
                            _arrival_counters(z.device), *select, dummy, z, K=width, **loop, CARRY=False, NORM=False,
                            GELU=True, SELECT=True, DEFER=False, X_FOLD=folded, **common)
        return
    parts, (bt, bn) = _deferred_tiles(tokens, width)
    _dense_kernel[(parts, cdiv(tokens, bt))](u1, fc2_weight, fc2_bias, u2, tokens, dummy, dummy, fc1_bias, eps,
                                             dummy, *select, partials, z, K=width, **_loop(bt, bn, width),
                                             CARRY=False, NORM=False, GELU=True, SELECT=False, DEFER=True,
                                             X_FOLD=folded, **(common | dict(BT=bt, BN=bn)))


def gemm_tiles(tokens: int, n: int) -> tuple[int, int]:
    """(BM, BN) of the prefill form's GEMM: the largest tiles that still give about PROGRAMS programs (BM at least
    16, tl.dot's smallest), for the next power of two of the token count, as the warm-up ladder buckets them."""
    bucket = next_power_of_2(tokens)
    bn = min(next_power_of_2(n), 128 if bucket >= 4096 else 64)
    bm = 128
    while bm > 16 and cdiv(bucket, bm) * cdiv(n, bn) < PROGRAMS:
        bm //= 2
    return bm, bn


def gemm_splits(tokens: int, n: int, k: int) -> int:
    """K splits of the prefill form's GEMM (1: none). A program's K loop is a chain of dependent tensor-core
    products (3xTF32: three a chunk); at a few hundred tokens the tiles are at their smallest and there is one wave
    of programs, so that chain is the GEMM's time (the down-projection at 512 tokens, 64 chunks a program: 33 us a
    layer on an H100, against 6 for fc1's and fc2's 8). Up to SPLIT_MAX_TOKENS tokens K is cut into splits of at
    least SPLIT_CHUNKS chunks, for about SPLIT_WAVES x PROGRAMS programs; `_split_sum_kernel` then sums them."""
    if next_power_of_2(tokens) > SPLIT_MAX_TOKENS:
        return 1
    bm, bn = gemm_tiles(tokens, n)
    programs = cdiv(next_power_of_2(tokens), bm) * cdiv(n, bn)
    return max(1, min(cdiv(k, _gemm_bk(k)) // SPLIT_CHUNKS, SPLIT_WAVES * PROGRAMS // programs))


def _gemm_bk(k: int) -> int:
    return min(GEMM_BK, next_power_of_2(k))


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, gelu: bool) -> None:
    tokens, k = x.shape
    n = weight.shape[0]
    bm, bn = gemm_tiles(tokens, n)
    bk = _gemm_bk(k)
    splits = gemm_splits(tokens, n, k)
    split_k = cdiv(cdiv(k, bk), splits) * bk
    splits = cdiv(k, split_k)  # (rounding up to whole chunks may leave fewer)
    part = out if splits == 1 else torch.empty(splits, tokens, n, device=x.device, dtype=torch.float32)
    _gemm_kernel[(cdiv(n, bn), cdiv(tokens, bm), splits)](
        x, weight, bias, part, tokens, K=k, N=n, BM=bm, BN=bn, BK=bk, STAGES=GEMM_STAGES, GELU=gelu,
        SPLIT_K=split_k if splits > 1 else k, num_warps=8 if bm * bn >= 128 * 64 else 4)
    if splits > 1:
        elements = tokens * n
        _split_sum_kernel[(cdiv(elements, SUM_BLOCK),)](part, bias, out, elements, N=n, SPLITS=splits,
                                                        BLOCK=SUM_BLOCK, GELU=gelu, num_warps=4)


def select_tokens(tokens: int) -> int:
    """Tokens per program of the prefill form's selection: SELECT_TOKENS, fewer where that leaves fewer than
    PROGRAMS programs (512 tokens: 4 a program, 128 programs; 16 a program took 10.6 us a layer on an H100)."""
    return max(1, min(SELECT_TOKENS, next_power_of_2(tokens) // PROGRAMS))


def gemm_route(x32, down_weight, down_bias, carry, states_scale, norm_weight, eps, fc1_weight, fc1_bias, fc2_weight,
               fc2_bias, out_weight, balancing_biases) -> Routing:
    """The prefill form: 3xTF32 GEMMs (`_gemm_kernel`, fc1's and fc2's GELUs in their epilogues), ops.norm's kernel
    for carry + RMSNorm, `_select_kernel` for the selection. Arguments as `eda_route`'s, checked."""
    tokens = x32.shape[0]
    width, classes = down_weight.shape[0], out_weight.shape[0]
    choice, ids, weight, expert_w, skip_w, (z, u1, u2) = _outputs(tokens, 3, width, x32.device)
    _gemm(x32, down_weight, down_bias, z, gelu=False)
    if carry is None:
        new_carry, normed, _ = residual_rms_norm(z, norm_weight, eps)
    else:
        new_carry, normed, _ = residual_rms_norm(carry, norm_weight, eps, residual=z, update_scale=states_scale)
    _gemm(normed, fc1_weight, fc1_bias, u1, gelu=True)
    _gemm(u1, fc2_weight, fc2_bias, u2, gelu=True)
    bc = next_power_of_2(classes)
    bt = select_tokens(tokens)
    _select_kernel[(cdiv(tokens, bt),)](
        u2, out_weight, balancing_biases, choice, weight, ids, expert_w, skip_w, tokens, K=width, CLASSES=classes,
        BT=bt, BC=bc, BK=_chunk(bt, bc, width), num_warps=4)
    return Routing(choice, weight, ids, expert_w, skip_w, new_carry)
