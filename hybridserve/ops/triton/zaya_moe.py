"""ZAYA1's MoE half of a decode layer in one persistent launch: the EDA router, the top-1 expert's SwiGLU and the
residual norm after it (contract: `ops.zaya_moe.routed_experts_residual_norm`; off unless asked for, see there).

At batch 1 the separate kernels (`ops.triton.zaya_router`'s three, `ops.triton.moe_gemv`'s two) each pay a launch
and a ramp: they add 28 us a layer to an H100's batch-1 step against an 8.3 us bytes floor (docs/performance.md).
Here one launch of a program per SM runs the same five steps as phases, with a grid barrier
(ops/triton/grid_sync.py) where a kernel boundary was:
    0. z = x32 @ Wd^T + bd (+ carry * scale)       column blocks of the router width (`zaya_router.dense_block`)
    1. u1 = GELU(fc1(RMSNorm(z)))                   the same blocks
    2. u2 = GELU(fc2(u1))                           the same blocks
    3. every program selects every token's class itself, in the router's token blocks (17 x 256 fp32 weights:
       cheaper than one more barrier), program 0 stores the routing; L2 is asked for the down rows the program
       reads in phase 4, so that their stream overlaps the gate|up one; the gate|up rows of each live pair
       (`moe_gemv.gate_up_block`)
    4. the down rows (`moe_gemv.down_block`), each token's last program running its residual norm.
Each program takes the work items of a phase in turn (item = pid, pid + programs, ...), on the tiles of the
separate kernels, with the same block functions: a token's numbers are the separate kernels' bits (tests compare
them).

Before the PDL wait each program asks L2 for its rows of the router weights. The grid is at most a program per SM,
so all are resident at once: as a cooperative launch the driver refuses two per SM ("too many blocks"), and a grid
of two per SM, which ran alone in the GPU test, stalled the engine, where with PDL the launch starts beside the
kernel before it (docs/performance.md). In Triton's interpreter (programs run one after another, where a barrier
cannot work) each phase is a launch of its own: the same code, the kernel boundary in place of the barrier.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from hybridserve.ops.norm import ResidualNorm
from hybridserve.ops.reference.zaya_router import EDARouterWeights, Routing
from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.counters import arrival_counters
from hybridserve.ops.triton.grid_sync import barrier_counter, barriers_work, finish, grid_barrier, sm_count
from hybridserve.ops.triton.moe_gemv import down_block, down_tiles, gate_up_block, gate_up_tiles
from hybridserve.ops.triton.norm import epilogue_args
from hybridserve.ops.triton.pdl import prefetch_rows, wait_for_previous
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2
from hybridserve.ops.triton.zaya_router import (
    check_router_tensors,
    dense_block,
    fused_tiles,
    k_chunk,
    k_loop,
    outputs,
    select,
)

MAX_TOKENS = 8  # tokens a step this form takes (the decode graphs' smallest buckets); more: the separate kernels
PHASES = 5
CPU_PROGRAMS = 8  # programs of an interpreted launch (tests): any count gives the same numbers


@triton.jit
def _router_layer(x_ptr, w_ptr, b_ptr, out_ptr, num_tokens, carry_ptr, scale_ptr, norm_ptr, eps, items,
                  K: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  STAGES: tl.constexpr, CARRY: tl.constexpr, NORM: tl.constexpr, GELU: tl.constexpr,
                  X_CACHE: tl.constexpr):
    """One router layer (`zaya_router.dense_block`) on this program's share of its `items` blocks."""
    cols: tl.constexpr = (N + BN - 1) // BN
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        dense_block(x_ptr, w_ptr, b_ptr, out_ptr, num_tokens, carry_ptr, scale_ptr, norm_ptr, eps, item // cols,
                    item % cols, K, N, BT, BN, BK, STAGES, CARRY, NORM, GELU, X_CACHE)


@triton.jit
def _choice_of(token, tokens, ids, expert_w):
    """(expert id, whether it runs) of `token` from the [TS] selection vectors."""
    here = tokens == token
    return tl.sum(tl.where(here, ids, 0)), tl.sum(tl.where(here, expert_w, 0.0)) != 0.0


@triton.jit
def _boundary(barrier_ptr, AFTER: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr):
    """The grid barrier between phase AFTER and the next, if this launch runs both."""
    if FIRST <= AFTER and LAST > AFTER:
        grid_barrier(barrier_ptr, AFTER + 1 - FIRST)


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_step_kernel(
        x32_ptr, wd_ptr, bd_ptr, carry_ptr, scale_ptr, rn_ptr, r_eps, w1_ptr, b1_ptr, w2r_ptr, b2_ptr, wo_ptr,
        bias_ptr, z_ptr, u1_ptr, u2_ptr, choice_ptr, weight_ptr, ids_ptr, expert_w_ptr, skip_w_ptr,
        x_ptr, stride_x, w13_ptr, w2_ptr, act_ptr, out_ptr, counter_ptr, barrier_ptr, r_ptr, r_s0, ub_ptr, us_ptr,
        rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0, nw_ptr, x_out_ptr, h_ptr, h32_ptr, width, eps, num_tokens,
        FIRST: tl.constexpr, LAST: tl.constexpr, H: tl.constexpr, R: tl.constexpr, I: tl.constexpr,
        CLASSES: tl.constexpr, EXPERTS: tl.constexpr, CARRY: tl.constexpr,
        BT: tl.constexpr, BN: tl.constexpr, BK0: tl.constexpr, STAGES0: tl.constexpr, BKR: tl.constexpr,
        STAGESR: tl.constexpr, TS: tl.constexpr, BC: tl.constexpr, BKC: tl.constexpr,
        BN_U: tl.constexpr, BK_U: tl.constexpr, STAGES_U: tl.constexpr, BLOCKS_U: tl.constexpr, BN_D: tl.constexpr,
        BK_D: tl.constexpr, STAGES_D: tl.constexpr, BLOCKS_D: tl.constexpr,
        BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_UB: tl.constexpr, HAS_US: tl.constexpr,
        HAS_RB: tl.constexpr, HAS_RS: tl.constexpr, HAS_SKIP: tl.constexpr, FP32_COPY: tl.constexpr,
        PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
    """Phases FIRST..LAST of the module docstring, a grid barrier between two (router blocks: BT tokens x BN
    columns; gate|up blocks of BN_U rows, down blocks of BN_D columns; PREFETCH: L2 prefetches, which only the GPU
    has)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    router_items = tl.cdiv(R, BN) * tl.cdiv(num_tokens, BT)
    if USE_PDL:  # no kernel writes the weights: their stream starts before the wait (ops/triton/pdl.py)
        router_rows = pid * BN + tl.arange(0, BN)
        prefetch_rows(wd_ptr, router_rows, router_rows < R, H, H)
        prefetch_rows(w1_ptr, router_rows, router_rows < R, R, R)
        prefetch_rows(w2r_ptr, router_rows, router_rows < R, R, R)
        classes = tl.arange(0, BC)
        prefetch_rows(wo_ptr, classes, classes < CLASSES, R, R)
    wait_for_previous(USE_PDL)
    if FIRST <= 0 and LAST >= 0:
        _router_layer(x32_ptr, wd_ptr, bd_ptr, z_ptr, num_tokens, carry_ptr, scale_ptr, rn_ptr, r_eps, router_items,
                      H, R, BT, BN, BK0, STAGES0, CARRY, False, False, "")
    _boundary(barrier_ptr, 0, FIRST, LAST)
    if FIRST <= 1 and LAST >= 1:
        _router_layer(z_ptr, w1_ptr, b1_ptr, u1_ptr, num_tokens, carry_ptr, scale_ptr, rn_ptr, r_eps, router_items,
                      R, R, BT, BN, BKR, STAGESR, False, True, True, ".cg")
    _boundary(barrier_ptr, 1, FIRST, LAST)
    if FIRST <= 2 and LAST >= 2:
        _router_layer(u1_ptr, w2r_ptr, b2_ptr, u2_ptr, num_tokens, carry_ptr, scale_ptr, rn_ptr, r_eps, router_items,
                      R, R, BT, BN, BKR, STAGESR, False, False, True, ".cg")
    _boundary(barrier_ptr, 2, FIRST, LAST)
    if FIRST <= 3 and LAST >= 3:
        tokens = tl.arange(0, TS)
        ids = tl.zeros([TS], dtype=tl.int64)
        expert_w = tl.zeros([TS], dtype=tl.float32)
        for token_block in tl.static_range((TS + BT - 1) // BT):  # the router's token blocks: its selection's bits
            rows = token_block * BT + tl.arange(0, BT)
            row_ok = rows < num_tokens
            block_ids, block_w = select(u2_ptr, wo_ptr, bias_ptr, choice_ptr, weight_ptr, ids_ptr, expert_w_ptr,
                                        skip_w_ptr, rows, row_ok, row_ok & (pid == 0), R, CLASSES, BT, BC, BKC, False,
                                        ".cg")
            here = tokens[:, None] == rows[None, :]
            ids += tl.sum(tl.where(here, block_ids[None, :], 0), axis=1)
            expert_w += tl.sum(tl.where(here, block_w[None, :], 0.0), axis=1)
        if PREFETCH:  # phase 4's down rows, for this phase's choices (its stores are not visible to all yet)
            for item in range(pid, num_tokens * BLOCKS_D, programs):
                expert, live = _choice_of(item // BLOCKS_D, tokens, ids, expert_w)
                down_cols = (item % BLOCKS_D) * BN_D + tl.arange(0, BN_D)
                prefetch_rows(w2_ptr + expert * H * I, down_cols, (down_cols < H) & live, I, I)
        for item in range(pid, num_tokens * BLOCKS_U, programs):
            pair = item // BLOCKS_U
            expert, live = _choice_of(pair, tokens, ids, expert_w)
            if live:  # else phase 4 skips the pair too
                gate_up_block(x_ptr, stride_x, w13_ptr, act_ptr, I, w13_ptr, 0, 0, pair, item % BLOCKS_U, expert, 1, H,
                              BN_U, BK_U, STAGES_U, "", 0)
    _boundary(barrier_ptr, 3, FIRST, LAST)
    if FIRST <= 4 and LAST >= 4:
        for item in range(pid, num_tokens * BLOCKS_D, programs):
            down_block(act_ptr, w2_ptr, ids_ptr, expert_w_ptr, out_ptr, H, counter_ptr, w2_ptr, 0, 0, r_ptr, r_s0,
                       ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0, nw_ptr, x_out_ptr, h_ptr, h32_ptr, width,
                       eps, item // BLOCKS_D, item % BLOCKS_D, BLOCKS_D, 1, EXPERTS, I, BN_D, BK_D, STAGES_D, "", 0,
                       True, BLOCK, HAS_RESIDUAL, HAS_UB, HAS_US, HAS_RB, HAS_RS, HAS_SKIP, FP32_COPY)
    if LAST > FIRST:
        finish(barrier_ptr, LAST - FIRST)


def takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether this form runs a step of x's tokens (host sizes only): at most MAX_TOKENS, 16-bit experts of x's dtype
    in contiguous stacks, x rows of unit column stride."""
    return (x.shape[0] <= MAX_TOKENS and x.stride(1) == 1 and w13.dtype == w2.dtype == x.dtype
            and w13.is_contiguous() and w2.is_contiguous())


def programs_for(device: torch.device, items: int) -> int:
    """Programs of a launch with at most `items` work items in a phase: a program per SM at most, so that all are
    resident at once (module docstring)."""
    return max(1, min(items, sm_count(device) if barriers_work(device) else CPU_PROGRAMS))


def routed_experts_residual_norm(x: torch.Tensor, x32: torch.Tensor, carry: torch.Tensor | None,
                                 router: EDARouterWeights, w13: torch.Tensor, w2: torch.Tensor, norm: ResidualNorm,
                                 scaled_identity: bool, programs: int | None = None, one_launch: bool | None = None):
    """`ops.zaya_moe.routed_experts_residual_norm` in one launch (its arguments, 16-bit experts; `takes`).
    `programs` (tests): the grid instead of a program per SM; `one_launch` False: a launch per phase (what the
    interpreter does, except for one program, which passes its barriers alone; on the GPU a test compares the two).
    -> (x, h, h32 of `norm`, Routing)."""
    tokens, hidden = x.shape
    width, classes = router.down_weight.shape[0], router.out_weight.shape[0]
    experts, inter = w13.shape[0], w2.shape[2]
    if not takes(x, w13, w2):
        raise ValueError(f"the one-launch MoE step takes at most {MAX_TOKENS} tokens, 16-bit experts of x's dtype "
                         "in contiguous stacks and x rows of unit column stride")
    if x32.shape != (tokens, hidden) or x32.dtype != torch.float32 or not x32.is_contiguous():
        raise ValueError("x32 must be the contiguous fp32 [T, H] copy of x")
    has_carry = carry is not None and router.states_scale is not None
    check_router_tensors(*(t for t in router.route_args(x32, carry if has_carry else None)
                           if isinstance(t, torch.Tensor)))
    device = x.device
    choice, ids, weight, expert_w, skip_w, (z, u1, u2) = outputs(tokens, 3, width, device)
    if scaled_identity:
        norm = replace(norm, skip_weight=skip_w, skip_input=x)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=device)
    epilogue, flags, normed = epilogue_args(norm, tokens, hidden, out)
    routing = Routing(choice, weight, ids, expert_w, skip_w, z)
    if not tokens:
        return normed, routing
    bt, bn = fused_tiles(tokens, width)  # the router's decode-form tiles, the experts' GEMV tiles: their bits
    up, down = gate_up_tiles(inter, hidden), down_tiles(hidden, inter)
    blocks_up, blocks_down = cdiv(2 * inter, up.BN), cdiv(hidden, down.BN)
    items = max(cdiv(width, bn) * cdiv(tokens, bt), tokens * blocks_up, tokens * blocks_down)
    grid = (programs or programs_for(device, items),)
    act = torch.empty(tokens, inter, dtype=x.dtype, device=device)
    bc = next_power_of_2(classes)
    first_k, router_k = k_loop(bt, bn, hidden), k_loop(bt, bn, width)
    args = (x32, router.down_weight, router.down_bias, carry if has_carry else x32,
            router.states_scale if has_carry else x32, router.norm_weight, router.eps, router.fc1_weight,
            router.fc1_bias, router.fc2_weight, router.fc2_bias, router.out_weight, router.balancing_biases, z, u1, u2,
            choice, weight, ids, expert_w, skip_w, x, x.stride(0), w13, w2, act, out,
            arrival_counters("zaya_moe_norm", MAX_TOKENS, device), barrier_counter("zaya_moe", device), *epilogue,
            tokens)
    constexprs = dict(
        H=hidden, R=width, I=inter, CLASSES=classes, EXPERTS=experts, CARRY=has_carry, BT=bt, BN=bn,
        BK0=first_k["BK"], STAGES0=first_k["STAGES"], BKR=router_k["BK"], STAGESR=router_k["STAGES"],
        TS=next_power_of_2(tokens), BC=bc, BKC=k_chunk(bt, bc, width), BN_U=up.BN, BK_U=up.BK, STAGES_U=up.STAGES,
        BLOCKS_U=blocks_up, BN_D=down.BN, BK_D=down.BK, STAGES_D=down.STAGES, BLOCKS_D=blocks_down, **flags,
        PREFETCH=barriers_work(device), num_warps=up.num_warps)
    together = barriers_work(device) if one_launch is None else one_launch
    if together and not barriers_work(device) and grid[0] != 1:  # one program passes its barriers alone
        raise ValueError("one launch of several programs needs grid barriers: a CUDA device, not the interpreter")
    spans = [(0, PHASES - 1)] if together else [(phase, phase) for phase in range(PHASES)]
    for first, last in spans:
        _moe_step_kernel[grid](*args, FIRST=first, LAST=last, **constexprs,
                               **(pdl.launch(device) if first == 0 else {"USE_PDL": False}))
    return normed, routing
