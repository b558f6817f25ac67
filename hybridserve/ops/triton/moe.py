"""Fused MoE on CUDA: routed SwiGLU experts as two grouped GEMMs over expert-sorted (token, choice) pairs.

1. Alignment (two small kernels, one for small batches; no host sync): the T*K pairs are ordered by expert (pair
   order kept inside an expert), and each expert's run is padded to a multiple of BLOCK_M with the sentinel T*K.
   `block_expert[b]` is
   the expert of block b, -1 past the last used block. Sizes come from T, K, E and BLOCK_M only: at most
   `max_blocks = (T*K + min(E, T*K) * (BLOCK_M - 1)) // BLOCK_M` blocks. Grids are sized by that bound and
   programs of unused blocks return at once, so a decode batch never reads the weights of an expert nobody chose.
2. Gate/up GEMM: x rows of a block times the expert's gate and up rows, fp32 accumulation, SiLU(gate) * up in the
   epilogue, stored by pair index into [T*K, I] in x's dtype (the down GEMM reads it back in that dtype, as the
   reference's F.linear does).
3. Down GEMM: times w2[e]^T, scaled by the pair's routing weight in fp32 (a zero weight, ZAYA1's MOD skip,
   writes an exact zero), stored by pair index into [T*K, H]. For K = 1 that is the output; for K > 1 one sum
   over each token's K rows follows. No atomics: the result is deterministic.
Split-K (config SPLIT_K_UP / SPLIT_K_DOWN > 1, for decode batches whose output tiles are too few to keep the GPU's
memory system busy): a split GEMM's program also takes one of SPLIT_K contiguous ranges of whole BLOCK_K tiles of
the reduction dimension and stores its fp32 partial tile by pair into a [SPLIT_K, T*K, width] workspace; one reduce
launch for that GEMM then sums each pair's partial rows in split order (fixed: deterministic) and applies its epilogue
(SiLU(gate) * up; the routing weight). The partial rows are small next to the weights they replace in flight.
Launch configurations: `moe_config` (tuned JSON tables, else a heuristic).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.ops.triton.moe_config import check_config, moe_config
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2

_MAX_CHUNKS = 128  # alignment programs: each counts and places a contiguous chunk of pairs
# Up to this many pairs (a decode batch of 16 tokens at top-8) one program counts and places them all: one launch
# instead of two. Its two passes walk the pairs serially (SUB at a time), so the bound keeps that to a few steps;
# larger batches spread the work over chunk programs.
_SINGLE_PROGRAM_PAIRS = 128


@triton.jit
def _ranks(e, expert, seen):
    """Each of a step's pairs' rank among the earlier pairs of its expert (expert ids `e`, [SUB]), given the counts
    `seen` [E_P2] before the step; and the counts after it."""
    hit = (e[:, None] == expert[None, :]).to(tl.int32)  # [SUB, E_P2] one-hot
    rank = tl.sum(hit * (tl.cumsum(hit, axis=0) - 1 + seen[None, :]), axis=1)
    return rank, seen + tl.sum(hit, axis=0)


@triton.jit(do_not_specialize=["num_pairs", "chunk"])
def _count_kernel(ids, ranks, counts, num_pairs, chunk, EXPERTS: tl.constexpr, E_P2: tl.constexpr,
                  SUB: tl.constexpr):
    """Per chunk of pairs: each pair's rank among the earlier pairs of its expert in the chunk, and the chunk's
    per-expert counts [num_chunks, E]."""
    c = tl.program_id(0)
    expert = tl.arange(0, E_P2)
    seen = tl.zeros([E_P2], dtype=tl.int32)
    for start in range(0, chunk, SUB):
        pair = c * chunk + start + tl.arange(0, SUB)  # chunk is a multiple of SUB
        mine = pair < num_pairs
        rank, seen = _ranks(tl.load(ids + pair, mask=mine, other=-1), expert, seen)
        tl.store(ranks + pair, rank, mask=mine)
    tl.store(counts + c * EXPERTS + expert, seen, mask=expert < EXPERTS)


@triton.jit(do_not_specialize=["num_pairs", "chunk", "num_chunks", "max_blocks", "blocks_per_program"])
def _place_kernel(ids, ranks, counts, sorted_pairs, block_expert, num_pairs, chunk, num_chunks, max_blocks,
                  blocks_per_program, EXPERTS: tl.constexpr, E_P2: tl.constexpr, SUB: tl.constexpr,
                  CHUNK_TILE: tl.constexpr, BLOCK_M: tl.constexpr, COUNT: tl.constexpr):
    """Every program rebuilds the padded expert offsets from all chunk counts, places its chunk's pairs, writes
    the sentinel padding of the experts e with e % num_chunks == c, and `block_expert` for its share of blocks.
    With COUNT (a single chunk, one program: small batches) it counts and ranks the pairs itself instead, and no
    count kernel runs before it."""
    c = tl.program_id(0)
    expert = tl.arange(0, E_P2)
    real = expert < EXPERTS
    total = tl.zeros([E_P2], dtype=tl.int32)
    before = tl.zeros([E_P2], dtype=tl.int32)  # pairs of each expert in the chunks before this one
    if COUNT:
        for start in range(0, chunk, SUB):
            pair = start + tl.arange(0, SUB)
            e = tl.load(ids + pair, mask=pair < num_pairs, other=-1)
            total += tl.sum((e[:, None] == expert[None, :]).to(tl.int32), axis=0)
    else:
        for first in range(0, num_chunks, CHUNK_TILE):
            row = first + tl.arange(0, CHUNK_TILE)
            tile = tl.load(counts + row[:, None] * EXPERTS + expert[None, :],
                           mask=(row[:, None] < num_chunks) & real[None, :], other=0)
            total += tl.sum(tile, axis=0)
            before += tl.sum(tl.where(row[:, None] < c, tile, 0), axis=0)
    blocks = (total + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    row_start = (block_end - blocks) * BLOCK_M  # first padded row of each expert

    seen = tl.zeros([E_P2], dtype=tl.int32)
    for start in range(0, chunk, SUB):
        pair = c * chunk + start + tl.arange(0, SUB)  # chunk is a multiple of SUB
        mine = pair < num_pairs
        e = tl.load(ids + pair, mask=mine, other=-1)
        if COUNT:
            rank, seen = _ranks(e, expert, seen)
        else:
            rank = tl.load(ranks + pair, mask=mine, other=0)
        mine = mine & (e >= 0) & (e < EXPERTS)  # an invalid id is dropped, never written out of bounds
        base = tl.sum(tl.where(e[:, None] == expert[None, :], row_start[None, :] + before[None, :], 0), axis=1)
        tl.store(sorted_pairs + base + rank, pair, mask=mine)

    owned = real & (expert % num_chunks == c)
    for pad in tl.static_range(0, BLOCK_M, 16):
        offset = total[:, None] + pad + tl.arange(0, 16)[None, :]
        tl.store(sorted_pairs + row_start[:, None] + offset, num_pairs,
                 mask=owned[:, None] & (offset < blocks[:, None] * BLOCK_M))

    for first in range(0, blocks_per_program, 16):
        block = c * blocks_per_program + first + tl.arange(0, 16)
        which = tl.sum((block_end[None, :] <= block[:, None]).to(tl.int32), axis=1)  # experts ending before
        used = block < tl.sum(blocks, axis=0)
        tl.store(block_expert + block, tl.where(used, which, -1),
                 mask=(block < max_blocks) & (first + tl.arange(0, 16) < blocks_per_program))


@triton.jit
def grouped_tile(pid, blocks, n_tiles, GROUP_M: tl.constexpr):
    """(row block, column tile) of output tile `pid` of a blocks x n_tiles grid, GROUP_M row blocks at a time so
    that neighbours share weight tiles in L2."""
    per_group = GROUP_M * n_tiles
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(blocks - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def expert_tile(pid, block_expert, max_blocks, n_tiles, GROUP_M: tl.constexpr):
    """(block, column tile, expert or -1) of output tile `pid` (`grouped_tile` over the expert blocks)."""
    block, tile = grouped_tile(pid, max_blocks, n_tiles, GROUP_M)
    return block, tile, tl.load(block_expert + block).to(tl.int64)


@triton.jit
def block_rows(sorted_pairs, block, num_pairs, BLOCK_M: tl.constexpr):
    """The pair index of each row of `block`, and which rows are real (not padding)."""
    pair = tl.load(sorted_pairs + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return pair, pair < num_pairs


@triton.jit
def _k_range(split, depth, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[start, end) of split `split`'s share of a reduction dimension of `depth`: whole BLOCK_K tiles, the last
    split ending at `depth` (a split past the end is empty and contributes zeros)."""
    per_split = tl.cdiv(tl.cdiv(depth, BLOCK_K), SPLIT_K) * BLOCK_K
    start = split * per_split
    return start, tl.minimum(start + per_split, depth)


@triton.jit
def swiglu(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up  # SiLU(gate) * up in fp32


@triton.jit
def weighted(acc, weight):
    return tl.where(weight == 0.0, 0.0, acc * weight)  # exact zero even if acc overflowed


@triton.jit
def _store_partial(partial, split, num_pairs, width, pair, col, value, mask):
    """An fp32 partial tile into the [SPLIT_K, num_pairs, width] workspace, by pair."""
    row = (split * num_pairs + pair).to(tl.int64) * width
    tl.store(partial + row[:, None] + col[None, :], value, mask=mask)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _gate_up_kernel(x, w13, out, partial, sorted_pairs, block_expert, num_pairs, max_blocks, top_k, inter, hidden,
                    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_ot, stride_on,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, SPLIT_K: tl.constexpr):
    """SiLU(gate) * up of a block's rows for BLOCK_N / 2 intermediate columns into `out`; with SPLIT_K > 1 the
    gate and up partial sums of one K range into `partial` (row: gate columns, then up columns)."""
    HALF: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    block, tile, expert = expert_tile(pid // SPLIT_K, block_expert, max_blocks, tl.cdiv(inter, HALF), GROUP_M)
    if expert < 0:
        return
    pair, row_ok = block_rows(sorted_pairs, block, num_pairs, BLOCK_M)
    col = tile * HALF + tl.arange(0, HALF)
    col_ok = col < inter
    k_start, k_end = _k_range(pid % SPLIT_K, hidden, BLOCK_K, SPLIT_K)
    k = tl.arange(0, BLOCK_K)
    a_ptr = x + (pair // top_k)[:, None].to(tl.int64) * stride_xt + (k_start + k[None, :]) * stride_xh
    g_ptr = w13 + expert * stride_we + col[None, :].to(tl.int64) * stride_wn + (k_start + k[:, None]) * stride_wh
    u_ptr = g_ptr + inter * stride_wn
    gate = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptr, mask=col_ok[None, :], other=0.0)
            u = tl.load(u_ptr, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = k < hidden - k0
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptr, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            u = tl.load(u_ptr, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        gate = tl.dot(a, g, gate, input_precision=PRECISION)
        up = tl.dot(a, u, up, input_precision=PRECISION)
        a_ptr += BLOCK_K * stride_xh
        g_ptr += BLOCK_K * stride_wh
        u_ptr += BLOCK_K * stride_wh
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out + pair[:, None].to(tl.int64) * stride_ot + col[None, :] * stride_on,
                 swiglu(gate, up).to(out.dtype.element_ty), mask=mask)
    else:
        _store_partial(partial, pid % SPLIT_K, num_pairs, 2 * inter, pair, col, gate, mask)
        _store_partial(partial, pid % SPLIT_K, num_pairs, 2 * inter, pair, inter + col, up, mask)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _down_kernel(act, w2, out, partial, weights, sorted_pairs, block_expert, num_pairs, max_blocks, hidden, inter,
                 stride_at, stride_ai, stride_we, stride_wh, stride_wi, stride_ot, stride_oh,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 EVEN_K: tl.constexpr, PRECISION: tl.constexpr, SPLIT_K: tl.constexpr):
    """A block's rows times w2[e]^T for BLOCK_N hidden columns, weighted, into `out`; with SPLIT_K > 1 the
    unweighted partial sums of one K range into `partial`."""
    pid = tl.program_id(0)
    block, tile, expert = expert_tile(pid // SPLIT_K, block_expert, max_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if expert < 0:
        return
    pair, row_ok = block_rows(sorted_pairs, block, num_pairs, BLOCK_M)
    col = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = col < hidden
    k_start, k_end = _k_range(pid % SPLIT_K, inter, BLOCK_K, SPLIT_K)
    k = tl.arange(0, BLOCK_K)
    a_ptr = act + pair[:, None].to(tl.int64) * stride_at + (k_start + k[None, :]) * stride_ai
    b_ptr = w2 + expert * stride_we + col[None, :].to(tl.int64) * stride_wh + (k_start + k[:, None]) * stride_wi
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptr, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = k < inter - k0
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptr += BLOCK_K * stride_ai
        b_ptr += BLOCK_K * stride_wi
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        weight = tl.load(weights + pair, mask=row_ok, other=0.0)
        tl.store(out + pair[:, None].to(tl.int64) * stride_ot + col[None, :] * stride_oh,
                 weighted(acc, weight[:, None]).to(out.dtype.element_ty), mask=mask)
    else:
        _store_partial(partial, pid % SPLIT_K, num_pairs, hidden, pair, col, acc, mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _split_reduce_kernel(partial, out, weights, num_pairs, width, stride_ot, stride_on, SPLIT_K: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, SWIGLU: tl.constexpr):
    """ROWS pairs x BLOCK output columns per program: the sum of each pair's SPLIT_K partial rows in split order,
    then the GEMM's epilogue: SiLU(gate) * up (SWIGLU: a partial row holds `width` gate then `width` up columns)
    or the pair's routing weight."""
    pair = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (pair < num_pairs)[:, None] & (col < width)[None, :]
    row_width = 2 * width if SWIGLU else width
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    up = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        row = partial + ((split * num_pairs + pair).to(tl.int64) * row_width)[:, None] + col[None, :]
        acc += tl.load(row, mask=mask, other=0.0)
        if SWIGLU:
            up += tl.load(row + width, mask=mask, other=0.0)
    if SWIGLU:
        acc = swiglu(acc, up)
    else:
        acc = weighted(acc, tl.load(weights + pair, mask=pair < num_pairs, other=0.0)[:, None])
    tl.store(out + pair[:, None].to(tl.int64) * stride_ot + col[None, :] * stride_on, acc.to(out.dtype.element_ty),
             mask=mask)


def max_blocks(num_pairs: int, experts: int, block_m: int) -> int:
    """Most BLOCK_M-row blocks the padded expert runs can take: sum_e ceil(c_e / M) with sum c_e = num_pairs
    and at most min(E, num_pairs) experts used."""
    return (num_pairs + min(experts, num_pairs) * (block_m - 1)) // block_m


def align_pairs(topk_ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (sorted_pairs [max_blocks * block_m] int32: pair index or the sentinel T*K,
    block_expert [max_blocks] int32: expert of each block or -1). Two launches, one up to _SINGLE_PROGRAM_PAIRS
    pairs (decode batches); sizes from the shapes only."""
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    blocks = max_blocks(num_pairs, experts, block_m)
    e_p2 = next_power_of_2(experts)
    sub = max(1, min(64, 4096 // e_p2))  # pairs per step: a [sub, E] one-hot stays small
    single = num_pairs <= _SINGLE_PROGRAM_PAIRS
    chunk = sub * cdiv(cdiv(num_pairs, sub), 1 if single else _MAX_CHUNKS)
    num_chunks = cdiv(num_pairs, chunk)
    device = ids.device
    aligned = torch.empty(blocks * (block_m + 1), dtype=torch.int32, device=device)  # one allocation for both
    sorted_pairs, block_expert = aligned[:blocks * block_m], aligned[blocks * block_m:]
    ranks = counts = ids  # unread by a single program
    if not single:
        ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
        counts = torch.empty(num_chunks, experts, dtype=torch.int32, device=device)
        _count_kernel[(num_chunks,)](ids, ranks, counts, num_pairs, chunk, EXPERTS=experts, E_P2=e_p2, SUB=sub)
    _place_kernel[(num_chunks,)](ids, ranks, counts, sorted_pairs, block_expert, num_pairs, chunk, num_chunks,
                                 blocks, cdiv(blocks, num_chunks), EXPERTS=experts, E_P2=e_p2, SUB=sub,
                                 CHUNK_TILE=max(1, min(64, 4096 // e_p2)), BLOCK_M=block_m, COUNT=single)
    return sorted_pairs, block_expert


def _reduce_splits(partial: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, split: int,
                   swiglu: bool) -> None:
    """out [num_pairs, width] = the epilogue of the sum over the `split` partial rows of each pair."""
    num_pairs, width = out.shape
    rows, block = 8, min(512, next_power_of_2(width))  # 4096-element tiles
    _split_reduce_kernel[(cdiv(num_pairs, rows), cdiv(width, block))](
        partial, out, weights, num_pairs, width, out.stride(0), out.stride(1), SPLIT_K=split, ROWS=rows,
        BLOCK=block, SWIGLU=swiglu, num_warps=4)


def expert_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(T, H, E, I, K) of a fused-experts call (both forms), or a clear error where the shapes disagree."""
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if w13.shape != (experts, 2 * inter, hidden) or w2.shape != (experts, hidden, inter):
        raise ValueError(f"expert weights do not match: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} "
                         f"do not match {tokens} tokens")
    return tokens, hidden, experts, inter, topk_ids.shape[1]


def reduce_pairs(out: torch.Tensor, tokens: int, top_k: int, reduce: bool) -> torch.Tensor:
    """The op's result from the weighted rows by pair [T*K, H]: [T, K, H] unreduced, else each token's sum."""
    rows = out.view(tokens, top_k, out.shape[1])
    if not reduce:
        return rows
    if top_k == 1:
        return out
    return rows.sum(dim=1)  # fp32 accumulation inside torch's reduction, one rounding


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, config: dict[str, int] | None = None,
                  reduce: bool = True) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows first); w2 [E, H, I]; topk_ids/weights [T, K] -> [T, H] in x's dtype,
    or with `reduce=False` the K weighted rows [T, K, H] unsummed (see `ops.moe.fused_experts`).

    Every id must lie in [0, E) (not checked: that would need a sync; a pair with another id is dropped and its
    token's row left undefined). `config` overrides the table/heuristic choice (the tuner uses it).
    """
    tokens, hidden, experts, inter, top_k = expert_shapes(x, w13, w2, topk_ids, topk_weights)
    if tokens == 0:
        out = torch.empty(0, hidden, dtype=x.dtype, device=x.device)
        return out if reduce else out.view(0, top_k, hidden)
    config = check_config(config, "config") if config is not None else \
        moe_config(tokens, experts, inter, hidden, top_k, x.dtype, x.device)
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    split_up, split_down = config["SPLIT_K_UP"], config["SPLIT_K_DOWN"]
    sorted_pairs, block_expert = align_pairs(topk_ids.contiguous(), experts, block_m)
    blocks, num_pairs = block_expert.numel(), tokens * top_k
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    # The weighted output rows and the activations in one allocation (both in x's dtype).
    buffer = torch.empty(num_pairs * (hidden + inter), dtype=x.dtype, device=x.device)
    out, act = buffer[:num_pairs * hidden].view(num_pairs, hidden), buffer[num_pairs * hidden:].view(num_pairs, inter)
    # fp32 partial rows of the split GEMMs (one after the other); unread when neither is split
    widths = [split_up * 2 * inter] * (split_up > 1) + [split_down * hidden] * (split_down > 1)
    partial = torch.empty(num_pairs * max(widths), dtype=torch.float32, device=x.device) if widths else buffer
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=config["GROUP_M"],
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                  num_warps=config["num_warps"], num_stages=config["num_stages"])
    _gate_up_kernel[(blocks * cdiv(inter, block_n // 2) * split_up,)](
        x, w13, act, partial, sorted_pairs, block_expert, num_pairs, blocks, top_k, inter, hidden,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0), act.stride(1),
        EVEN_K=hidden % block_k == 0, SPLIT_K=split_up, **launch)
    if split_up > 1:
        _reduce_splits(partial, act, weights, split_up, swiglu=True)
    _down_kernel[(blocks * cdiv(hidden, block_n) * split_down,)](
        act, w2, out, partial, weights, sorted_pairs, block_expert, num_pairs, blocks, hidden, inter,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), out.stride(1),
        EVEN_K=inter % block_k == 0, SPLIT_K=split_down, **launch)
    if split_down > 1:
        _reduce_splits(partial, out, weights, split_down, swiglu=False)
    return reduce_pairs(out, tokens, top_k, reduce)
