"""Paged softmax attention in Triton: varlen flash attention over the paged KV cache, split-K for long keys.

One kernel serves decode, prefill and mixed batches. Programs run over (query block, row, KV head x split); a
program's M rows are BLOCK_Q tokens x the G query heads that share one KV head, so each K/V tile is loaded once
for the whole query group (GQA; MLA's absorbed form is G = all heads over one latent head); at decode, where
there are very few (row, KV head) programs, a group of more than MAX_DECODE_GROUP heads is cut over programs
that each read the KV head (`choose_group_split`: MLA's 32 heads at batch 1 in 4 programs). A row's queries sit at
positions kv_len - query_len .. kv_len - 1 and see keys causally (and, with a window W, only keys j > i - W), so a
program reads only the keys its queries can see: pages entirely before the window are never touched (their page
table entries may be the dummy page). Decode rows are 1-token rows with BLOCK_Q = 1; when there are too few
programs to fill the GPU, the key range is cut into splits (flash-decoding) whose partial (output, log-sum-exp)
pairs are merged in the same launch: each split program that got keys stores its pair, then bumps the arrival
counter of its (query block, row, KV head) (acq_rel); the last of them to arrive reads their pairs back through
L2, merges them and resets the counter to zero for the next call (ops/triton/counters.py). A split count is fixed
for the longest context (CUDA graphs: max_model_len keys, 64 splits at batch 1), so at a short one most splits get
no keys: they leave at once, before the PDL wait, and are not waited for (split 0 always stays, so that a row
without keys still gets its zeros). Waited for, ZAYA1-8B's 118 empty programs of 128 at batch 1 (640 keys) cost
about 3% of its decode rate on an H100.

Under programmatic dependent launch (ops/triton/pdl.py) a program waits for the kernel before it, which wrote q
and this step's own K/V rows (keys kv_len - query_len on); earlier steps' rows were written two or more kernels back.
So a decode program loads its split's first key tile before the wait: the page-table entries and the K/V rows of
earlier steps' keys. After the wait it loads q and this step's rows of that tile, all issued together: at batch 1,
where a split is one tile, one L2 round trip after the wait instead of two (page-table entries, then K/V rows).
Not for MLA's 512-wide latent (its registers are full) nor prefill: they ask L2 for the first tile before the wait.

Head dims need not be powers of two: the key dim is loaded as a power-of-two main part plus a padded tail (MLA:
576 = 512 + 64), and when V is the first channels of the K row (MLA's latent cache: v_cache is a strided view of
k_cache) the V tile is the K tile already loaded.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridserve.core.batch import ForwardBatch
from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.counters import arrival_counters
from hybridserve.ops.triton.pdl import prefetch_rows, wait_for_previous
from hybridserve.ops.triton.sizes import cdiv

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 128  # below this a split's loads no longer hide the extra partial write and merge
COUNTERS = 1 << 14  # arrival counters per device: (query block, row, KV head) groups of one split launch
MERGE_TILE = 8192  # fp32 elements of the merge's [rows, splits, DV] load: 64 registers a thread at 4 warps
MAX_DECODE_GROUP = 8  # query heads a decode program takes at most, where `choose_group_split` cuts a group
FEW_PROGRAMS_SHARE = 8  # ... which it does where the (row, KV head) programs are at most sm_count / this
MERGE_UNROLL = tl.constexpr(8)  # splits whose loads the merge issues together where its tile holds one split (MLA)


# Integers that change from step to step are not specialised on (Triton would compile a variant per class: 1,
# divisible by 16, other), so the variants compiled at start-up are all there are.
@triton.jit(do_not_specialize=["stride_pt", "num_splits"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
    query_start_loc_ptr, kv_lens_ptr, page_table_ptr,
    stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_ot, stride_oh, stride_pt,
    scale_log2, window, num_splits, num_q_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, D_TAIL_PAD: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, V_IN_K: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr, GROUP_P2: tl.constexpr,
    MERGE_CHUNK: tl.constexpr, GROUP_SPLIT: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr,
):
    # Decode loads its first key tile's rows of earlier steps before the wait (module docstring); not MLA's 512-wide
    # latent, whose accumulator and tiles already take all the registers (a held tile spilled: sm_90, 344 bytes).
    PRELOAD: tl.constexpr = BLOCK_Q == 1 and D_MAIN <= 128 and DV_PAD <= 128
    q_block = tl.program_id(0)
    row = tl.program_id(1)
    heads = tl.program_id(2) // num_splits  # this program's GROUP query heads: a KV head's share of GROUP_SPLIT
    kv_head = heads // GROUP_SPLIT
    split = tl.program_id(2) % num_splits
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + row).to(tl.int32)

    # This program's keys: what its first query sees (window) up to its last query; then this split's share,
    # cut on BLOCK_N boundaries (an empty share adds nothing).
    first_pos = kv_len - q_len + q_block * BLOCK_Q
    hi = tl.minimum(first_pos + BLOCK_Q, kv_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    per_split = ((hi - lo + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    if MIN_SPLIT_KEYS > BLOCK_N:  # (the count is the longest context's: a short one's splits are fewer, longer)
        per_split = tl.maximum(per_split, MIN_SPLIT_KEYS)
    split_lo = lo + split * per_split
    split_hi = tl.minimum(split_lo + per_split, hi)
    # The splits that get keys (at least split 0, which gives a row without keys its zeros) are the only ones that
    # store a pair and count as arrivals; the others leave before the wait.
    used = tl.maximum(tl.cdiv(tl.maximum(hi - lo, 0), tl.maximum(per_split, 1)), 1)
    if split >= used:
        return
    pages = page_table_ptr + row * stride_pt
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    d = tl.arange(0, D_MAIN)
    if D_TAIL > 0:
        dt = tl.arange(0, D_TAIL_PAD)
    dv = tl.arange(0, DV_PAD)
    if PRELOAD:  # the first tile's page-table entries, and the K/V rows of its keys before this step's (held0)
        j0 = split_lo + tl.arange(0, BLOCK_N)
        rows0 = _kv_rows(pages, j0, j0 < split_hi, PAGE_SIZE)
        held0 = ((j0 < split_hi) & (j0 < kv_len - q_len))[:, None]
        k0 = tl.load(k_head + rows0[:, None] * stride_kr + d[None, :], mask=held0, other=0.0)
        k0_tail, v0 = None, None  # (they stay None without a tail, and with V in K)
        if D_TAIL > 0:
            k0_tail = tl.load(k_head + rows0[:, None] * stride_kr + D_MAIN + dt[None, :],
                              mask=held0 & (dt[None, :] < D_TAIL), other=0.0)
        if not V_IN_K:
            v0 = tl.load(v_head + rows0[:, None] * stride_vr + dv[None, :], mask=held0 & (dv[None, :] < DV), other=0.0)
    elif USE_PDL:  # the row lengths and page tables come from the host: the first tile's stream starts before
        _prefetch_keys(k_ptr, v_ptr, pages, kv_head, split_lo, split_hi, stride_kr, stride_kh, stride_vr, stride_vh,
                       BLOCK_N, PAGE_SIZE, D_MAIN + D_TAIL, DV, V_IN_K)
    wait_for_previous(USE_PDL)  # the wait (this step's own key is the kernel before's output; L2 keeps it coherent)

    tok, head, m_valid, q_rows = _query_rows(q_block, heads, q_start, q_len, GROUP, GROUP_PAD, BLOCK_Q)
    q_pos = kv_len - q_len + tok
    q_base = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
    kv_dtype = k_ptr.dtype.element_ty
    q_main = tl.load(q_base + d[None, :], mask=m_valid[:, None], other=0.0).to(kv_dtype)
    q_tail = None
    if D_TAIL > 0:
        q_tail = tl.load(q_base + D_MAIN + dt[None, :], mask=m_valid[:, None] & (dt[None, :] < D_TAIL),
                         other=0.0).to(kv_dtype)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_Q * GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q * GROUP_PAD, DV_PAD], 0.0, tl.float32)
    # The held tile is straight-line code (an empty split's is all masked and adds nothing): held across a loop,
    # its registers would stay taken through the loop's tiles (sm_90: 236 registers against 163).
    if PRELOAD:
        m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q_main, q_tail, q_pos, j0, split_hi, rows0, k_head, v_head,
                                     stride_kr, stride_vr, scale_log2, window, held0, k0, k0_tail, v0, D_MAIN, D_TAIL,
                                     D_TAIL_PAD, DV, DV_PAD, V_IN_K, HAS_WINDOW, PRECISION)
    for start in range(split_lo + PRELOAD * BLOCK_N, split_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        kv_rows = _kv_rows(pages, j, j < split_hi, PAGE_SIZE)
        m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q_main, q_tail, q_pos, j, split_hi, kv_rows, k_head, v_head,
                                     stride_kr, stride_vr, scale_log2, window, None, None, None, None, D_MAIN, D_TAIL,
                                     D_TAIL_PAD, DV, DV_PAD, V_IN_K, HAS_WINDOW, PRECISION)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_mask = m_valid[:, None] & (dv[None, :] < DV)
    out = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
    if SPLIT:
        part = (q_rows * num_q_heads + head) * num_splits
        tl.store(part_o_ptr + (part + split)[:, None] * DV + dv[None, :], o, mask=o_mask)
        tl.store(part_lse_ptr + part + split, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=m_valid)
        tl.debug_barrier()  # every thread's stores precede the release below
        group = (q_block * tl.num_programs(1) + row) * (tl.num_programs(2) // num_splits) + heads
        if tl.atomic_add(counter_ptr + group, 1, sem="acq_rel") == used - 1:
            _merge(part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, q_start, q_block, q_len, heads, used,
                   num_q_heads, num_splits, GROUP, GROUP_P2, BLOCK_Q, DV, DV_PAD, MERGE_CHUNK)
            tl.store(counter_ptr + group, 0)
    else:
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _query_rows(q_block, heads, q_start, q_len, GROUP: tl.constexpr, PAD: tl.constexpr, BLOCK_Q: tl.constexpr):
    """A program's BLOCK_Q * PAD query rows, token-major, the GROUP query heads of head group `heads` minor (PAD >=
    GROUP; padding rows are masked): (token in the row, query head, valid, row of q / out)."""
    m = tl.arange(0, BLOCK_Q * PAD)
    tok = q_block * BLOCK_Q + m // PAD
    valid = (m % PAD < GROUP) & (tok < q_len)
    return tok, heads * GROUP + m % PAD, valid, (q_start + tok).to(tl.int64)


@triton.jit
def _attend_tile(m_i, l_i, acc, q_main, q_tail, q_pos, j, split_hi, kv_rows, k_head, v_head, stride_kr, stride_vr,
                 scale_log2, window, held, k_held, k_tail_held, v_held, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
                 D_TAIL_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, V_IN_K: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """The running (max, sum, output) of the M rows after one more tile, keys j (cache rows kv_rows; those from
    split_hi on are masked): online softmax. Where `held` (None: nowhere), the K/V rows are the *_held tiles."""
    j_valid = j < split_hi
    d = tl.arange(0, D_MAIN)
    dv = tl.arange(0, DV_PAD)
    v_ptrs = v_head + kv_rows[:, None] * stride_vr + dv[None, :]
    v_mask = j_valid[:, None] & (dv[None, :] < DV)
    k_main = _load_unless_held(k_head + kv_rows[:, None] * stride_kr + d[None, :], j_valid[:, None], held, k_held)
    if held is not None and not V_IN_K:  # with K's rows: this step's V row is not a round trip after the softmax
        v = _load_unless_held(v_ptrs, v_mask, held, v_held)
    s = tl.dot(q_main, tl.trans(k_main), input_precision=PRECISION)
    if D_TAIL > 0:
        dt = tl.arange(0, D_TAIL_PAD)
        k_tail = _load_unless_held(k_head + kv_rows[:, None] * stride_kr + D_MAIN + dt[None, :],
                                   j_valid[:, None] & (dt[None, :] < D_TAIL), held, k_tail_held)
        s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
    visible = j_valid[None, :] & (j[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible &= j[None, :] > q_pos[:, None] - window
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays at zero
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_IN_K:
        v = k_main
    elif held is None:
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(k_head.dtype.element_ty), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _kv_rows(pages, j, j_valid, PAGE_SIZE: tl.constexpr):
    """Cache rows of keys j of the sequence whose page-table row is `pages` (masked keys: rows of page 0)."""
    page = tl.load(pages + j // PAGE_SIZE, mask=j_valid, other=0)
    return page.to(tl.int64) * PAGE_SIZE + j % PAGE_SIZE


@triton.jit
def _load_unless_held(ptrs, mask, held, early):
    """tl.load(ptrs, mask, other=0), except where `held` (None: nowhere): there `early`, the same values loaded
    before the wait (zero wherever not held), so that only the rest is loaded now. `early` as the load's `other`
    is tl.where(held, early, load) with the load written into early's registers (sm_90: 163 registers, not 195)."""
    if held is None:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(ptrs, mask=mask & ~held, other=early)
    return x


@triton.jit
def _prefetch_keys(k_ptr, v_ptr, pages_ptr, kv_head, lo, hi, stride_kr, stride_kh, stride_vr, stride_vh,
                   BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                   V_IN_K: tl.constexpr):
    """Ask L2 for the K (and V) rows of keys lo .. lo + BLOCK_N (below hi) of this KV head."""
    j = lo + tl.arange(0, BLOCK_N)
    j_ok = j < hi
    kv_rows = _kv_rows(pages_ptr, j, j_ok, PAGE_SIZE)
    prefetch_rows(k_ptr + kv_head * stride_kh, kv_rows, j_ok, stride_kr, D)
    if not V_IN_K:
        prefetch_rows(v_ptr + kv_head * stride_vh, kv_rows, j_ok, stride_vr, DV)


@triton.jit
def _merge(part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, q_start, q_block, q_len, heads, used,
           num_q_heads, num_splits, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr,
           DV: tl.constexpr, DV_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Store the output of this program's query rows (the BLOCK_Q tokens x GROUP query heads of head group `heads`;
    no tl.dot padding here): their first `used` splits' outputs weighted by 2^lse, rescaled to the running maximum
    as it grows (read through L2: other programs wrote them). The splits come in chunks of as many as a
    [rows, splits, DV] tile of MERGE_TILE holds (16 for ZAYA1's four query heads of 128 channels), each chunk's
    loads issued together: at batch 1 a few hundred keys make 8-10 splits, one L2 round trip on a decode step's
    critical path where a loop over the splits (unrolled by 8, its remainder one split at a time) took three. A
    tile of one split (MLA's 512-wide latent) keeps that loop, unrolled by MERGE_UNROLL."""
    UNROLL: tl.constexpr = MERGE_UNROLL if CHUNK == 1 else 1
    _, head, valid, q_rows = _query_rows(q_block, heads, q_start, q_len, GROUP, GROUP_P2, BLOCK_Q)
    part = (q_rows * num_q_heads + head) * num_splits
    dv = tl.arange(0, DV_PAD)
    s = tl.arange(0, CHUNK)
    top = tl.full([BLOCK_Q * GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
    merged = tl.zeros([BLOCK_Q * GROUP_P2, DV_PAD], tl.float32)
    for first in tl.range(0, used, CHUNK, loop_unroll_factor=UNROLL):
        pair = part[:, None] + first + s[None, :]
        ok = valid[:, None] & (first + s < used)[None, :]
        lse = tl.load(part_lse_ptr + pair, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_o_ptr + pair[:, :, None] * DV + dv[None, None, :], mask=ok[:, :, None] &
                    (dv < DV)[None, None, :], other=0.0, cache_modifier=".cg")
        new_top = tl.maximum(top, tl.max(lse, axis=1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # no keys so far: weights stay zero
        old, weight = tl.exp2(top - safe), tl.exp2(lse - safe[:, None])
        merged = merged * old[:, None] + tl.sum(o * weight[:, :, None], axis=1)
        total = total * old + tl.sum(weight, axis=1)
        top = new_top
    # A row without keys (kv_len 0: CUDA-graph padding) has only empty splits and gets zeros, as unsplit.
    o = merged / tl.maximum(total, 1.0)[:, None]
    out = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (dv < DV)[None, :])


@dataclass(frozen=True)
class LaunchConfig:
    block_q: int  # tokens per program
    group_pad: int  # query heads per program (power of two >= G); block_q * group_pad >= 16 for tl.dot
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    min_split_keys: int  # keys a split gets at least (a multiple of block_n)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def launch_config(decode: bool, group: int, d_main: int, dv_pad: int) -> LaunchConfig:
    """Tile shapes from the batch kind and head dims (a plain function: deterministic, CUDA-graph friendly)."""
    wide = max(d_main, dv_pad) > 128  # MLA's 512-channel latent: smaller tiles keep acc and K on chip
    group_pad = _pow2(group)
    rows = 16 if decode else (32 if wide else 128)
    block_q = 1 if decode else max(1, rows // group_pad)
    group_pad = max(group_pad, 16 // block_q)
    block_n = 32 if wide else 64
    # A split's partial output is merged by one program: MLA's [heads, 512] fp32 a split is 16x ZAYA1's, so its
    # splits take two tiles at least (fewer to merge; an H100 micro of 640 keys: 13 us a call against 18 at one).
    # Prefill splits take MIN_KEYS_PER_SPLIT keys at least, as `choose_splits` gives them when it knows the keys:
    # the prefill graphs fix the count for max_model_len keys, 9 for a lone 512-token row, which would cut its
    # keys into one-tile splits (an H200 micro of that row: 37.9 us at 9 splits, 23.6 at the 4 the floor leaves).
    # Decode keeps one tile: the decode graph's short splits measured faster than two-tile ones in the engine.
    min_split_keys = 2 * block_n if wide else block_n
    if not decode:
        min_split_keys = max(min_split_keys, -(-MIN_KEYS_PER_SPLIT // block_n) * block_n)
    return LaunchConfig(block_q, group_pad, block_n, num_warps=4 if decode and not wide else 8,
                        num_stages=2 if wide else 3, min_split_keys=min_split_keys)


def choose_group_split(decode: bool, group: int, programs: int, sm_count: int) -> int:
    """Programs a KV head's query group is cut over at decode (a power of two dividing `group`), each taking at most
    MAX_DECODE_GROUP of its heads, where the (row, KV head) `programs` are very few: MLA's 32 heads over one latent
    head at batch 1 would otherwise leave the GPU to key splits alone, whose merge of [32, 512] fp32 a split runs
    in one program (an H100 micro, the decode graph's 64 splits: 34 -> 21 us a call at 640 keys, 76 -> 33 at 2048).
    At 64 rows the cut is slower (182 -> 245 us at 2048 keys: its 256 programs leave no key splits, and each
    streams the row's keys alone), so it stops at sm_count / FEW_PROGRAMS_SHARE programs (16 rows of 132 SMs;
    between 1 and 64 rows untimed)."""
    split = 1
    if decode and programs * FEW_PROGRAMS_SHARE <= sm_count:
        while group % (2 * split) == 0 and group // split > MAX_DECODE_GROUP:
            split *= 2
    return split


def merge_chunk(rows: int, dv_pad: int) -> int:
    """Splits a merge chunk loads together (`_merge`): the most, a power of two, whose [rows, splits, dv_pad] fp32
    tile is at most MERGE_TILE elements; at least 1."""
    fits = MERGE_TILE // (rows * dv_pad)
    return 1 << (fits.bit_length() - 1) if fits else 1


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def choose_splits(batch: ForwardBatch, num_kv_heads: int, block_q: int, sm_count: int,
                  sliding_window: int | None = None) -> int:
    """Key splits per (query block, KV head): enough programs for ~2 waves, at least MIN_KEYS_PER_SPLIT keys each.

    Only host fields are read. For CUDA graphs, capture with `batch.max_kv_len` = max_model_len: the count is then
    fixed per batch size, and splits beyond a shorter row's keys are empty and ignored.
    """
    programs = num_kv_heads * sum(-(-n // block_q) for n in batch.query_lens)
    if programs >= sm_count:
        return 1
    keys = batch.max_kv_len if sliding_window is None else min(batch.max_kv_len, sliding_window + block_q - 1)
    return max(1, min(-(-2 * sm_count // programs), -(-keys // MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                    scale: float, sliding_window: int | None = None, num_splits: int | None = None,
                    group_split: int | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_cache [rows, Hk, D]; v_cache [rows, Hk, Dv] (this step's K/V already written) -> [T, Hq, Dv].

    Same contract as `ops.reference.attention.paged_attention`. `num_splits` overrides the split-K heuristic
    (any count >= 1 is correct; splits without keys contribute nothing), `group_split` `choose_group_split`'s (any
    power of two dividing the query group). Rows with kv_len 0 (padding) give zeros.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_cache.shape[1], v_cache.shape[-1]
    if k_cache.shape[-1] != head_dim or v_cache.shape[:2] != k_cache.shape[:2] or num_q_heads % num_kv_heads:
        raise ValueError(f"attention shapes disagree: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if head_dim < 16 or v_dim < 1:
        raise ValueError(f"the attention kernel needs a head dim of at least 16; got {head_dim}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need unit stride along their last dim")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1; got {sliding_window}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}]; got {num_splits}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    sm_count = _sm_count(q.device)
    group = num_q_heads // num_kv_heads
    cut = group_split or choose_group_split(batch.is_decode, group, num_kv_heads * batch.num_seqs, sm_count)
    if group % cut or cut & (cut - 1):
        raise ValueError(f"group_split must be a power of two dividing the {group} query heads a KV head; got {cut}")
    group //= cut  # a program's query heads
    head_groups = num_kv_heads * cut
    d_main = 1 << (head_dim.bit_length() - 1)
    d_tail = head_dim - d_main
    dv_pad = max(16, _pow2(v_dim))
    config = launch_config(batch.is_decode, group, d_main, dv_pad)
    splits = num_splits or choose_splits(batch, head_groups, config.block_q, sm_count, sliding_window)
    # V is the K tile already loaded when it is the first channels of the same rows (MLA's latent cache).
    v_in_k = (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
              and v_dim == d_main)
    out = q.new_empty(num_tokens, num_q_heads, v_dim)
    grid = (cdiv(batch.max_query_len, config.block_q), batch.num_seqs, head_groups * splits)
    if splits > 1:
        part_o = torch.empty(num_tokens, num_q_heads, splits, v_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_tokens, num_q_heads, splits, dtype=torch.float32, device=q.device)
        if grid[0] * grid[1] * head_groups > COUNTERS:
            raise ValueError(f"{grid[0] * grid[1] * head_groups} split groups exceed the {COUNTERS} arrival "
                             "counters: use fewer splits")
        counters = arrival_counters("attention_splits", COUNTERS, q.device)
    else:
        part_o = part_lse = counters = out  # unused
    _attention_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse, counters,
        batch.query_start_loc, batch.kv_lens, batch.page_table,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), batch.page_table.stride(0),
        scale * LOG2E, sliding_window or 0, splits, num_q_heads,
        GROUP=group, GROUP_PAD=config.group_pad, BLOCK_Q=config.block_q, BLOCK_N=config.block_n,
        PAGE_SIZE=batch.page_size, D_MAIN=d_main, D_TAIL=d_tail,
        D_TAIL_PAD=max(16, _pow2(d_tail)) if d_tail else 0, DV=v_dim, DV_PAD=dv_pad, V_IN_K=v_in_k,
        HAS_WINDOW=sliding_window is not None, SPLIT=splits > 1, GROUP_P2=_pow2(group),
        MERGE_CHUNK=merge_chunk(config.block_q * _pow2(group), dv_pad), GROUP_SPLIT=cut,
        MIN_SPLIT_KEYS=config.min_split_keys, PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch(q.device),
    )
    return out
