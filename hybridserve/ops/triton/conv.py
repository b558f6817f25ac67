"""ZAYA1's CCA convolution and value lag as one Triton kernel over packed rows (contract: ops/reference/conv.py).

Grid: (token blocks, work items). The first items are conv heads (D channels each: both conv stages, the head-mix
residual in the epilogue); the remaining items are blocks of value channels (v_current copied, v_delayed shifted by
one token). The kernel has two forms, chosen on the host by the token count alone (`cca_conv`):

- heads (prefill and large steps): one item per head, stage 2 as a [D, D] tl.dot per tap over a block of tokens;
- columns (decode-sized steps, up to COLUMNS_MAX_TOKENS tokens): each head's D output columns are split over
  several items, about PROGRAMS programs in all (one per SM of an H200). An item recomputes stage 1 for all of its
  head's input channels (cheap: K0 multiply-adds per channel and tap) and does stage 2 only for its columns, reading
  only their rows of the stage-2 weight (contiguous: D * K1 values per column), as broadcast multiply-adds into a
  [tokens, columns, chunk] fp32 register tile, without padding one token to tl.dot's 16. At one token a step the
  heads form ran ~12 programs that each streamed a whole head's weight serially.

Ownership makes the in-place state update race-free without a second launch: only a row's first P tokens read
its carried window (and only its first token the lag), so every token with local index < P belongs to the token
block of the row's first token, which is also the one whose programs write the row's new window and lag. Token
blocks therefore overlap by P - 1 tokens (none when every row has one token): program p looks at tokens
[p * S, p * S + BLOCK_T) with stride S = BLOCK_T - OVERLAP and processes the token t iff
(t - min(local(t), OVERLAP)) // S == p (each token exactly once). In the heads form the one program of a (token
block, head) loads all of the old state before a barrier and stores the new one after it. In the columns form
several programs read the head's window, so each bumps the (token block, head) arrival counter after its reads
(acq_rel); the last to arrive writes the new window and the page footers, and resets the counter to 0 so that the
next call (and every CUDA-graph replay) starts from zero (ops/triton/counters.py). Every program loads what the
stores take (old window columns, projection rows) before its arrival, so that the last one's stores follow the
arrival without an L2 round trip of their own. Page footers are stored from values loaded before the new window is
written.

With `to_cache` (ops.conv.cca_conv_to_cache, what the model runs) the kernel also does the q/k normalisation, RoPE
and the K/V cache write (ops/triton/zaya_qk.py) instead of returning q, k and v: the program that writes a head's
new window (the heads form's one program of the head; the columns form's last to arrive) reads the head's fp32
rows back and stores them normalised and rotated, as q or into the K cache, and the value programs store V
straight into its cache rows. The fp32 q|k buffer stays the exchange between a head's programs.

Verify rows (speculative decoding, `batch.verify`): each token stores the window and lag after it in its own slot
(`token_slots`: the row's working slot for its first token, intermediate slots for its drafts), and the row's
final window and lag are not stored. Only the first token targets the working slot; its window is stored by the
program that writes the windows (after every read of the old one), like a row's new window.

PDL (ops/triton/pdl.py): the kernel before this one is the q|k|v|v projection, and `proj` is all it writes, so a
program loads everything else before its one `wait_for_previous`: the batch metadata (copied by the host before
the step), weights and biases (no kernel's output; the columns form's whole stage-2 tile into registers when its
loop is one chunk, else the rows' first bytes asked of L2), and the carried window and lag (stored by this
kernel's previous call, two or more kernels back, hence complete when this one starts). Only the projection's loads
and the stores follow the wait, each part's loads issued before its stores (the compiler moves no load above a
store): one round trip, not one per store. The old state is still read before the new one is stored, as above.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import triton
import triton.language as tl

from hybridserve.core.batch import ForwardBatch
from hybridserve.ops.qk_cache import QKCache
from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.counters import arrival_counters
from hybridserve.ops.triton.pdl import prefetch_rows, wait_for_previous
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2
from hybridserve.ops.triton.zaya_qk import norm_rope_store, rotation

# Launch constants of the columns form, sized for an H200 (132 SMs); benchmarks/ops/conv.py times both forms.
# Steps of at most this many tokens run the columns form (H200, 40-layer graphs: 1.8x at 1 token, 1.3x at 8,
# 0.6x at 64).
COLUMNS_MAX_TOKENS = 16
PROGRAMS = 128  # conv programs to aim for (the value blocks come on top)
MIN_COLUMNS = 4  # output columns per program at least
TILE_ELEMENTS = 8192  # a program's [tokens, columns, chunk] product tile: 64 fp32 registers a thread at 4 warps
PIPELINE_STAGES = 4  # stage-2 chunks in flight per program when its loop has several
COLUMN_WARPS = 4
COUNTERS = 1 << 14  # arrival counters per device: token blocks x heads of one call


@triton.jit
def _old(state_ptr, cs0, cs1, cs2, back, slot, init, valid, ch, ch_ok, P: tl.constexpr):
    """The carried half of `_raw`: column P + back of the window where back < 0 (zero elsewhere, and for a row
    without initial state). This kernel's previous call wrote it, not the kernel before: loadable before the wait."""
    return tl.load(state_ptr + slot * cs0 + ch * cs1 + (P + back) * cs2, mask=valid & (back < 0) & init & ch_ok,
                   other=0.0)


@triton.jit
def _with_new(proj_ptr, proj_s0, old, start, back, valid, ch, ch_ok):
    """The projection half of `_raw`: this step's row at chunk index back where back >= 0, else `old` (fp32)."""
    in_chunk = back >= 0
    new = tl.load(proj_ptr + (start + back) * proj_s0 + ch, mask=valid & in_chunk & ch_ok, other=0.0)
    return tl.where(in_chunk, new.to(tl.float32), old.to(tl.float32))


@triton.jit
def _raw(proj_ptr, proj_s0, state_ptr, cs0, cs1, cs2, start, back, slot, init, valid, ch, ch_ok,
         P: tl.constexpr):
    """Raw q|k input (fp32) of the token at chunk index `back` of each row: this step's projection when
    back >= 0, else column P + back of the carried window (zero for a row without initial state)."""
    old = _old(state_ptr, cs0, cs1, cs2, back, slot, init, valid, ch, ch_ok, P)
    return _with_new(proj_ptr, proj_s0, old, start, back, valid, ch, ch_ok)


@triton.jit
def _token_rows(pid, num_tokens, seq_ids_ptr, qsl_ptr, slots_ptr, init_ptr, token_slots_ptr, OVERLAP: tl.constexpr,
                BLOCK_T: tl.constexpr, HAS_VERIFY: tl.constexpr):
    """Program pid's tokens and their rows' batch metadata, copied by the host before the step (loadable before
    the wait): token, local index, row start, row, `mine` (the tokens this program processes: see the token blocks
    above), `starter` (a row's first token), the row's end (starters only), state slot, initial state flag, and
    the verify slots."""
    STRIDE: tl.constexpr = BLOCK_T - OVERLAP
    tok = pid * STRIDE + tl.arange(0, BLOCK_T)
    valid = tok < num_tokens
    seq = tl.load(seq_ids_ptr + tok, mask=valid, other=0)
    start = tl.load(qsl_ptr + seq, mask=valid, other=0)
    local = tok - start
    mine = valid & ((tok - tl.minimum(local, OVERLAP)) // STRIDE == pid)
    starter = mine & (local == 0)
    end = tl.load(qsl_ptr + seq + 1, mask=starter, other=0)
    slot = tl.load(slots_ptr + seq, mask=mine, other=0)
    init = tl.load(init_ptr + seq, mask=mine, other=0) != 0
    if HAS_VERIFY:  # a verify row's tokens each have a slot; its first token's slot is set, so no final state
        out_slot = tl.load(token_slots_ptr + tok, mask=mine, other=-1)
        keep_final = tl.load(token_slots_ptr + start, mask=starter, other=-1) < 0
    else:
        out_slot = tl.full([BLOCK_T], -1, tl.int64)
        keep_final = starter
    return tok, local, start, seq, mine, starter, end, slot, init, out_slot, keep_final


@triton.jit
def _page_ends(tok, seq, mine, pos_ptr, pt_ptr, pt_s0, page_size):
    """(is_end, page): which tokens end a page, and that page (its footers are stored there)."""
    pos = tl.load(pos_ptr + tok, mask=mine, other=0)
    is_end = mine & ((pos + 1) % page_size == 0)
    return is_end, tl.load(pt_ptr + seq * pt_s0 + pos // page_size, mask=is_end, other=0)


@triton.jit
def _stage2_dot(g, local, start2, slot2, init2, mine2, proj_ptr, proj_s0, w0_ptr, b0_ptr, w1_ptr, conv_ptr, cs0,
                cs1, cs2, D: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, P: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Both conv stages of head g, all D output columns: stage 1 (depthwise, K0 taps) at tokens t - m, then
    stage 2's tap K1 - 1 - m on it as a [D, D] tl.dot. -> [BLOCK_T, BLOCK_D] fp32, without bias."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    ch = g * D + d
    ch2, ok2 = ch[None, :], d_ok[None, :]
    b0 = tl.load(b0_ptr + ch, mask=d_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for m in tl.static_range(K1):
        u = tl.zeros([BLOCK_T, BLOCK_D], tl.float32) + b0[None, :]
        for n in tl.static_range(K0):
            w0 = tl.load(w0_ptr + ch * K0 + (K0 - 1 - n), mask=d_ok, other=0.0).to(tl.float32)
            x = _raw(proj_ptr, proj_s0, conv_ptr, cs0, cs1, cs2, start2, (local - m - n)[:, None], slot2, init2,
                     mine2, ch2, ok2, P)
            u += w0[None, :] * x
        d_in, d_out = d[:, None], d[None, :]
        w1 = tl.load(w1_ptr + ((g * D + d_out) * D + d_in) * K1 + (K1 - 1 - m), mask=(d_in < D) & (d_out < D),
                     other=0.0).to(tl.float32)
        acc += tl.dot(u, w1, input_precision=PRECISION)
    return acc


@triton.jit
def _lanes(g, k0, D: tl.constexpr, K1: tl.constexpr, BLOCK_K: tl.constexpr):
    """Chunk k0 of head g's flat stage-2 rows: (j, j in range, input channel, lag). Index j = i * K1 + tap of a
    column's D * K1 values multiplies stage 1 at input channel g * D + i and lag m = K1 - 1 - tap."""
    j = k0 + tl.arange(0, BLOCK_K)
    return j, j < D * K1, g * D + j // K1, K1 - 1 - j % K1


@triton.jit
def _chunk_weights(g, k0, cols, w0_ptr, b0_ptr, w1_ptr, D: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Chunk k0's weights as stored: (stage-1 bias, stage-1 taps K0 - 1 - n for n < K0, the stage-2 rows of
    output columns `cols`). No kernel writes weights: loadable before the wait."""
    j, j_ok, ch, _ = _lanes(g, k0, D, K1, BLOCK_K)
    taps = ()
    for n in tl.static_range(K0):
        taps = taps + (tl.load(w0_ptr + ch * K0 + (K0 - 1 - n), mask=j_ok, other=0.0),)
    rows = (g * D + cols)[:, None] * (D * K1)
    w1 = tl.load(w1_ptr + rows + j[None, :], mask=(cols < D)[:, None] & j_ok[None, :], other=0.0)
    return tl.load(b0_ptr + ch, mask=j_ok, other=0.0), taps, w1


@triton.jit
def _chunk_old(g, k0, local, slot2, init2, mine2, conv_ptr, cs0, cs1, cs2, D: tl.constexpr, K0: tl.constexpr,
               K1: tl.constexpr, P: tl.constexpr, BLOCK_K: tl.constexpr):
    """Chunk k0's stage-1 inputs from the carried window (`_old`), one per tap n < K0."""
    _, j_ok, ch, m = _lanes(g, k0, D, K1, BLOCK_K)
    old = ()
    for n in tl.static_range(K0):
        old = old + (_old(conv_ptr, cs0, cs1, cs2, local[:, None] - m[None, :] - n, slot2, init2, mine2,
                          ch[None, :], j_ok[None, :], P),)
    return old


@triton.jit
def _chunk_product(acc, g, k0, weights, old, local, start2, mine2, proj_ptr, proj_s0, D: tl.constexpr,
                   K0: tl.constexpr, K1: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + chunk k0's products: stage 1 from `weights` (_chunk_weights), `old` (_chunk_old) and this step's
    projection, times the stage-2 rows, per j lane."""
    b0, taps, w1 = weights
    _, j_ok, ch, m = _lanes(g, k0, D, K1, BLOCK_K)
    u = tl.zeros([BLOCK_T, BLOCK_K], tl.float32) + b0.to(tl.float32)
    for n in tl.static_range(K0):
        x = _with_new(proj_ptr, proj_s0, old[n], start2, local[:, None] - m[None, :] - n, mine2, ch[None, :],
                      j_ok[None, :])
        u += taps[n].to(tl.float32)[None, :] * x
    return acc + u[:, None, :] * w1.to(tl.float32)[None, :, :]


@triton.jit
def _stage2_columns(g, cols, first, local, start2, slot2, init2, mine2, proj_ptr, proj_s0, w0_ptr, b0_ptr, w1_ptr,
                    conv_ptr, cs0, cs1, cs2, D: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, P: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Both conv stages of head g for output columns `cols` only, chunk by chunk of the flat stage-2 rows
    (`_lanes`); stage 1 is recomputed per chunk. Products accumulate per j lane and are summed once at the end.
    A one-chunk loop's inputs other than the projection come in `first` (weights, old), loaded before the
    wait; None: each chunk loads its own.
    -> [BLOCK_T, BLOCK_O] fp32, without bias."""
    acc = tl.zeros([BLOCK_T, BLOCK_O, BLOCK_K], tl.float32)
    for k0 in tl.range(0, D * K1, BLOCK_K, num_stages=STAGES):
        if first is not None:
            weights, old = first
        else:
            weights = _chunk_weights(g, k0, cols, w0_ptr, b0_ptr, w1_ptr, D, K0, K1, BLOCK_K)
            old = _chunk_old(g, k0, local, slot2, init2, mine2, conv_ptr, cs0, cs1, cs2, D, K0, K1, P, BLOCK_K)
        acc = _chunk_product(acc, g, k0, weights, old, local, start2, mine2, proj_ptr, proj_s0, D, K0, K1,
                             BLOCK_T, BLOCK_K)
    return tl.sum(acc, axis=2)


@triton.jit
def _head_mix(proj_ptr, proj_s0, tok, g, cols, ok2, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr):
    """Head-mix residuals of head g at output columns `cols` from the current token's raw q|k:
    q_res[h] = (q[h] + k[h // G]) / 2, k_res[j] = the mean of q_res over j's G query heads."""
    G: tl.constexpr = HQ // HK
    row = proj_ptr + tok[:, None] * proj_s0
    c = cols[None, :]
    if g < HQ:
        q = tl.load(row + g * D + c, mask=ok2, other=0.0).to(tl.float32)
        k = tl.load(row + (HQ + g // G) * D + c, mask=ok2, other=0.0).to(tl.float32)
        res = (q + k) * 0.5
    else:
        k = tl.load(row + g * D + c, mask=ok2, other=0.0).to(tl.float32)
        res = tl.zeros_like(k)
        for i in tl.static_range(G):
            q = tl.load(row + ((g - HQ) * G + i) * D + c, mask=ok2, other=0.0).to(tl.float32)
            res += (q + k) * 0.5
        res = res / G
    return res


@triton.jit
def _window_lanes(g, D: tl.constexpr, P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    """Head g's window as 3-D views (tokens x window columns x channels): (column p, p in range, channel, channel in
    range)."""
    d = tl.arange(0, BLOCK_D)
    p = tl.arange(0, BLOCK_P)[None, :, None]
    return p, p < P, (g * D + d)[None, None, :], (d < D)[None, None, :]


@triton.jit
def _window_values(g, tok, local, start, seq, mine, starter, end, out_slot, slot, init, proj_ptr, proj_s0, conv_ptr,
                   cs0, cs1, cs2, pos_ptr, pt_ptr, pt_s0, page_size, D: tl.constexpr, P: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, HAS_FOOTER: tl.constexpr,
                   HAS_VERIFY: tl.constexpr):
    """What `_store_windows` stores for head g, loaded: (page footers: the window after each page's last token,
    the window after each token of a verify row, the new window of every row whose first token is in this block,
    the footer tokens and their pages); the window itself where a kind is off. Every program of the columns form
    loads them before its arrival (any of them may be the last): after it they would be an L2 round trip of their
    own on a decode step's critical path. The old window is only overwritten after every program has arrived."""
    p, p_ok, ch3, ok3 = _window_lanes(g, D, P, BLOCK_D, BLOCK_P)
    start3, slot3, init3 = start[:, None, None], slot[:, None, None], init[:, None, None]
    # The row's new window: raw rows S - P .. S - 1 of the chunk (older ones from the old window).
    back = (end - start)[:, None, None] - P + p
    window = _raw(proj_ptr, proj_s0, conv_ptr, cs0, cs1, cs2, start3, back, slot3, init3,
                  starter[:, None, None] & p_ok, ch3, ok3, P)
    footer, each, is_end, page = window, window, starter, slot  # (placeholders where the kind is off)
    # The window after token t: raw rows t - P + 1 .. t (column p = row t - (P - 1 - p)).
    after = local[:, None, None] - (P - 1 - p)
    if HAS_FOOTER:  # after a page's last token
        is_end, page = _page_ends(tok, seq, mine, pos_ptr, pt_ptr, pt_s0, page_size)
        footer = _raw(proj_ptr, proj_s0, conv_ptr, cs0, cs1, cs2, start3, after, slot3, init3,
                      is_end[:, None, None] & p_ok, ch3, ok3, P)
    if HAS_VERIFY:  # after each token of a verify row, for its own slot
        has_out = (mine & (out_slot >= 0))[:, None, None] & p_ok
        each = _raw(proj_ptr, proj_s0, conv_ptr, cs0, cs1, cs2, start3, after, slot3, init3, has_out, ch3, ok3, P)
    return footer, each, window, is_end, page


@triton.jit
def _store_windows(g, values, mine, starter, out_slot, keep_final, slot, conv_ptr, cs0, cs1, cs2, cfoot_ptr, cf0,
                   cf1, cf2, D: tl.constexpr, P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                   HAS_FOOTER: tl.constexpr, HAS_VERIFY: tl.constexpr):
    """Store head g's `values` (`_window_values`): page footers, the rows' new windows (verify rows: the window
    after each token, into its slot instead)."""
    footer, each, window, is_end, page = values
    p, p_ok, ch3, ok3 = _window_lanes(g, D, P, BLOCK_D, BLOCK_P)
    slot3 = slot[:, None, None]
    tl.debug_barrier()  # every thread's reads of the old window happen before it is overwritten below
    if HAS_FOOTER:
        tl.store(cfoot_ptr + page[:, None, None] * cf0 + ch3 * cf1 + p * cf2, footer.to(cfoot_ptr.dtype.element_ty),
                 mask=is_end[:, None, None] & p_ok & ok3)
    tl.store(conv_ptr + slot3 * cs0 + ch3 * cs1 + p * cs2, window.to(conv_ptr.dtype.element_ty),
             mask=(starter & keep_final)[:, None, None] & p_ok & ok3)
    if HAS_VERIFY:
        has_out = (mine & (out_slot >= 0))[:, None, None] & p_ok
        tl.store(conv_ptr + out_slot[:, None, None] * cs0 + ch3 * cs1 + p * cs2, each.to(conv_ptr.dtype.element_ty),
                 mask=has_out & ok3)


@triton.jit
def _conv_head(g, cb, pid, num_tokens, proj_ptr, proj_s0, w0_ptr, b0_ptr, w1_ptr, b1_ptr, qk_out_ptr, conv_ptr, cs0,
               cs1, cs2, cfoot_ptr, cf0, cf1, cf2, seq_ids_ptr, qsl_ptr, slots_ptr, init_ptr, token_slots_ptr,
               pos_ptr, pt_ptr, pt_s0, page_size, counter_ptr, kv_slot_ptr, temp_ptr, inv_freq_ptr, q_out_ptr,
               k_cache_ptr, kc_s0, kc_s1, norm_scale, norm_eps,
               HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr,
               P: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_P: tl.constexpr, COLUMNS: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
               STAGES: tl.constexpr, HAS_FOOTER: tl.constexpr, HAS_VERIFY: tl.constexpr, PRECISION: tl.constexpr,
               TO_CACHE: tl.constexpr, HALF: tl.constexpr, USE_PDL: tl.constexpr):
    """Head g's output columns of column block cb (all of them in the heads form), then its state; with TO_CACHE,
    the head's last program then normalises and rotates the head's whole rows into q_out or the K cache."""
    ONE_CHUNK: tl.constexpr = COLUMNS and BLOCK_K >= D * K1  # the columns form's stage 2 in one chunk
    if COLUMNS:
        cols = cb * BLOCK_O + tl.arange(0, BLOCK_O)
    else:
        cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if USE_PDL and COLUMNS and not ONE_CHUNK:  # a loop of chunks loads its weights in the loop: asked of L2 first
        prefetch_rows(w1_ptr, g * D + cols, col_ok, D * K1, D * K1)
    bias = tl.load(b1_ptr + g * D + cols, mask=col_ok, other=0.0)
    tok, local, start, seq, mine, starter, end, slot, init, out_slot, keep_final = _token_rows(
        pid, num_tokens, seq_ids_ptr, qsl_ptr, slots_ptr, init_ptr, token_slots_ptr, OVERLAP, BLOCK_T, HAS_VERIFY)
    start2, slot2, init2, mine2 = start[:, None], slot[:, None], init[:, None], mine[:, None]
    first = None
    if ONE_CHUNK:  # stage 2's inputs other than the projection: weights, carried window
        first = (_chunk_weights(g, 0, cols, w0_ptr, b0_ptr, w1_ptr, D, K0, K1, BLOCK_K),
                 _chunk_old(g, 0, local, slot2, init2, mine2, conv_ptr, cs0, cs1, cs2, D, K0, K1, P, BLOCK_K))
    if TO_CACHE:  # the epilogue's K cache rows and rotation: metadata and weights (any program may be the last)
        kv_row = tl.load(kv_slot_ptr + tok, mask=mine, other=0)
        rope = rotation(tok, g, mine, pos_ptr, inv_freq_ptr, temp_ptr, HQ, HALF, BLOCK_D)
    wait_for_previous(USE_PDL)
    ok2 = mine2 & col_ok[None, :]
    mix = _head_mix(proj_ptr, proj_s0, tok, g, cols, ok2, HQ, HK, D)  # loaded with stage 2's rows, not after its sum
    if COLUMNS:
        acc = _stage2_columns(g, cols, first, local, start2, slot2, init2, mine2, proj_ptr, proj_s0, w0_ptr, b0_ptr,
                              w1_ptr, conv_ptr, cs0, cs1, cs2, D, K0, K1, P, BLOCK_T, BLOCK_O, BLOCK_K, STAGES)
    else:
        acc = _stage2_dot(g, local, start2, slot2, init2, mine2, proj_ptr, proj_s0, w0_ptr, b0_ptr, w1_ptr,
                          conv_ptr, cs0, cs1, cs2, D, K0, K1, P, BLOCK_T, BLOCK_D, PRECISION)
    acc += bias.to(tl.float32)[None, :]
    acc += mix
    tl.store(qk_out_ptr + (tok[:, None] * (HQ + HK) + g) * D + cols[None, :], acc, mask=ok2)
    windows = _window_values(g, tok, local, start, seq, mine, starter, end, out_slot, slot, init, proj_ptr, proj_s0,
                             conv_ptr, cs0, cs1, cs2, pos_ptr, pt_ptr, pt_s0, page_size, D, P, BLOCK_D, BLOCK_P,
                             HAS_FOOTER, HAS_VERIFY)
    last = True  # the heads form: this program is the head's only one
    if COLUMNS:
        tl.debug_barrier()  # every thread's reads of the old window precede the release below
        counter = counter_ptr + tl.program_id(0) * (HQ + HK) + g
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        last = arrived == (D + BLOCK_O - 1) // BLOCK_O - 1  # the head's other column blocks are done with it
    if last:
        _store_windows(g, windows, mine, starter, out_slot, keep_final, slot, conv_ptr, cs0, cs1, cs2, cfoot_ptr, cf0,
                       cf1, cf2, D, P, BLOCK_D, BLOCK_P, HAS_FOOTER, HAS_VERIFY)
        if TO_CACHE:
            tl.debug_barrier()  # the heads form: every thread's stores of the rows precede their reads below
            norm_rope_store(qk_out_ptr, tok, g, mine, rope, q_out_ptr, k_cache_ptr, kc_s0, kc_s1, kv_row,
                            norm_scale, norm_eps, HQ, HK, D, HALF, BLOCK_D,
                            ".cg" if COLUMNS else "")  # .cg: the other column blocks' outputs, from L2
        if COLUMNS:
            tl.store(counter, 0)


@triton.jit
def _rank_heads(ch, ok2, kv_head_offset, HK: tl.constexpr, D: tl.constexpr):
    """Value channels ch of [v_current | v_delayed] -> (KV head on this rank, stored): channel ch belongs to KV
    head ch // D, and a rank stores its own heads only."""
    head = ch // D - kv_head_offset
    return head, ok2 & (head >= 0)[None, :] & (head < HK)[None, :]


@triton.jit
def _value_block(vb, pid, num_tokens, proj_ptr, proj_s0, lag_bias_ptr, v_out_ptr, v_s0, v_s1, lag_ptr, lag_s0,
                 lfoot_ptr, lf0, seq_ids_ptr, qsl_ptr, slots_ptr, init_ptr, token_slots_ptr, pos_ptr, pt_ptr, pt_s0,
                 page_size, kv_head_offset, kv_slot_ptr,
                 HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, VH: tl.constexpr, OVERLAP: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LAG_BIAS: tl.constexpr,
                 HAS_FOOTER: tl.constexpr, HAS_VERIFY: tl.constexpr, TO_CACHE: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """Value channels [vb * BLOCK_D, ...) of the tokens: v_out [T, HK, D] rows by token, or with TO_CACHE the V
    cache rows of the tokens' slots (row stride v_s0, head stride v_s1); then the lag. Everything but the
    projection (bias, metadata, carried lag) is loaded before the wait."""
    c = vb * BLOCK_D + tl.arange(0, BLOCK_D)
    c_ok = c < VH
    current_col = (HQ + HK) * D + c
    delayed_col = current_col + VH
    if HAS_LAG_BIAS:
        fresh = tl.load(lag_bias_ptr + c, mask=c_ok, other=0.0)[None, :]
    else:
        fresh = tl.zeros([1, BLOCK_D], lag_ptr.dtype.element_ty)
    tok, local, start, seq, mine, starter, end, slot, init, out_slot, keep_final = _token_rows(
        pid, num_tokens, seq_ids_ptr, qsl_ptr, slots_ptr, init_ptr, token_slots_ptr, OVERLAP, BLOCK_T, HAS_VERIFY)
    mine2, c2, ok2 = mine[:, None], c[None, :], c_ok[None, :]
    row = proj_ptr + tok[:, None] * proj_s0
    if TO_CACHE:
        v_row = tl.load(kv_slot_ptr + tok, mask=mine, other=0)
    else:
        v_row = tok.to(tl.int64)
    v_dst = v_out_ptr + v_row[:, None] * v_s0
    inside = (local >= 1)[:, None]
    carried = tl.load(lag_ptr + slot[:, None] * lag_s0 + c2, mask=mine2 & (~inside) & init[:, None] & ok2, other=0.0)
    if HAS_FOOTER:
        is_end, page = _page_ends(tok, seq, mine, pos_ptr, pt_ptr, pt_s0, page_size)
    wait_for_previous(USE_PDL)

    # This step's projection, all loaded before the first store (the compiler would not move a load above one).
    head, keep = _rank_heads(c, ok2 & mine2, kv_head_offset, HK, D)
    current = tl.load(row + current_col[None, :], mask=keep, other=0.0)
    shifted = tl.load(row - proj_s0 + delayed_col[None, :], mask=mine2 & inside & ok2, other=0.0)
    if HAS_FOOTER:
        own = tl.load(row + delayed_col[None, :], mask=is_end[:, None] & ok2, other=0.0)
    # The new lag: v_delayed of the row's last token (verify rows: of each token, into the token's own slot).
    newest = tl.load(proj_ptr + (end - 1)[:, None] * proj_s0 + delayed_col[None, :], mask=starter[:, None] & ok2,
                     other=0.0)
    if HAS_VERIFY:
        has_out = (mine & (out_slot >= 0))[:, None] & ok2
        each = tl.load(row + delayed_col[None, :], mask=has_out, other=0.0)

    tl.store(v_dst + head[None, :] * v_s1 + (c % D)[None, :], current.to(v_out_ptr.dtype.element_ty), mask=keep)
    delayed = tl.where(inside, shifted, tl.where(init[:, None], carried, fresh.to(carried.dtype)))
    head, keep = _rank_heads(VH + c, ok2 & mine2, kv_head_offset, HK, D)
    tl.store(v_dst + head[None, :] * v_s1 + ((VH + c) % D)[None, :], delayed.to(v_out_ptr.dtype.element_ty),
             mask=keep)
    if HAS_FOOTER:
        tl.store(lfoot_ptr + page[:, None] * lf0 + c2, own.to(lfoot_ptr.dtype.element_ty), mask=is_end[:, None] & ok2)
    tl.debug_barrier()  # the old lag was read above
    tl.store(lag_ptr + slot[:, None] * lag_s0 + c2, newest.to(lag_ptr.dtype.element_ty),
             mask=(starter & keep_final)[:, None] & ok2)
    if HAS_VERIFY:
        tl.store(lag_ptr + out_slot[:, None] * lag_s0 + c2, each.to(lag_ptr.dtype.element_ty), mask=has_out)


@triton.jit(do_not_specialize=["pt_s0", "num_tokens"])  # per-step integers: one variant for all steps
def _cca_conv_kernel(proj_ptr, proj_s0, w0_ptr, b0_ptr, w1_ptr, b1_ptr, lag_bias_ptr, qk_out_ptr, v_out_ptr, v_s0,
                     v_s1, conv_ptr, cs0, cs1, cs2, lag_ptr, lag_s0, cfoot_ptr, cf0, cf1, cf2, lfoot_ptr, lf0,
                     seq_ids_ptr, qsl_ptr, slots_ptr, init_ptr, pos_ptr, pt_ptr, pt_s0, page_size, token_slots_ptr,
                     num_tokens, kv_head_offset, counter_ptr, kv_slot_ptr, temp_ptr, inv_freq_ptr, q_out_ptr,
                     k_cache_ptr, kc_s0, kc_s1, norm_scale, norm_eps,
                     HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, VH: tl.constexpr, K0: tl.constexpr,
                     K1: tl.constexpr, P: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, COLUMNS: tl.constexpr, BLOCK_O: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, HAS_LAG_BIAS: tl.constexpr,
                     HAS_FOOTER: tl.constexpr, HAS_VERIFY: tl.constexpr, PRECISION: tl.constexpr,
                     TO_CACHE: tl.constexpr, HALF: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    item = tl.program_id(1)
    BLOCKS: tl.constexpr = (D + BLOCK_O - 1) // BLOCK_O  # column blocks per head (1 in the heads form)
    if item < (HQ + HK) * BLOCKS:
        _conv_head(item // BLOCKS, item % BLOCKS, pid, num_tokens, proj_ptr, proj_s0, w0_ptr, b0_ptr, w1_ptr, b1_ptr,
                   qk_out_ptr, conv_ptr, cs0, cs1, cs2, cfoot_ptr, cf0, cf1, cf2, seq_ids_ptr, qsl_ptr, slots_ptr,
                   init_ptr, token_slots_ptr, pos_ptr, pt_ptr, pt_s0, page_size, counter_ptr, kv_slot_ptr, temp_ptr,
                   inv_freq_ptr, q_out_ptr, k_cache_ptr, kc_s0, kc_s1, norm_scale, norm_eps, HQ, HK, D, K0, K1, P,
                   OVERLAP, BLOCK_T, BLOCK_D, BLOCK_P, COLUMNS, BLOCK_O, BLOCK_K, STAGES, HAS_FOOTER, HAS_VERIFY,
                   PRECISION, TO_CACHE, HALF, USE_PDL)
    else:
        _value_block(item - (HQ + HK) * BLOCKS, pid, num_tokens, proj_ptr, proj_s0, lag_bias_ptr, v_out_ptr, v_s0,
                     v_s1, lag_ptr, lag_s0, lfoot_ptr, lf0, seq_ids_ptr, qsl_ptr, slots_ptr, init_ptr, token_slots_ptr,
                     pos_ptr, pt_ptr, pt_s0, page_size, kv_head_offset, kv_slot_ptr, HQ, HK, D, VH, OVERLAP, BLOCK_T,
                     BLOCK_D, HAS_LAG_BIAS, HAS_FOOTER, HAS_VERIFY, TO_CACHE, USE_PDL)


def _arrival_counters(device: torch.device) -> torch.Tensor:
    """The columns form's per-(token block, head) arrival counters."""
    return arrival_counters("cca_conv", COUNTERS, device)


def _block_tokens(num_tokens: int, history: int) -> int:
    """Tokens a heads-form program looks at: 16 (the smallest tl.dot) for decode-sized steps, 32 for prefill."""
    return max(16 if num_tokens <= 512 else 32, next_power_of_2(history + 1))


def column_tiles(tokens: int, channels: int, d: int, k1: int, overlap: int) -> tuple[int, int, int]:
    """(tokens, output columns, stage-2 chunk) per columns-form program: about PROGRAMS programs over all output
    columns, tiles as square as powers of two allow (a program reads its columns' weight rows once for all of its
    tokens), columns within one head, a token block longer than the overlap, and a chunk of the flat D * K1 weight
    row that keeps the product tile near TILE_ELEMENTS. Bucketed by the next power of two of the token count."""
    span = next_power_of_2(tokens)
    area = max(1, span * channels // PROGRAMS)
    bt = max(min(span, 1 << ((area.bit_length() - 1) // 2)), next_power_of_2(overlap + 1))
    bo = min(next_power_of_2(d), max(MIN_COLUMNS, next_power_of_2(-(-area // bt))))
    return bt, bo, min(max(8, TILE_ELEMENTS // (bt * bo)), next_power_of_2(d * k1))


def cca_conv(proj: torch.Tensor, weight0: torch.Tensor, bias0: torch.Tensor, weight1: torch.Tensor,
             bias1: torch.Tensor, lag_bias: torch.Tensor | None, q_heads: int, kv_head_offset: int,
             batch: ForwardBatch, conv_state: torch.Tensor, lag_state: torch.Tensor,
             conv_footer: torch.Tensor | None = None, lag_footer: torch.Tensor | None = None,
             to_cache: QKCache | None = None, form: Literal["heads", "columns"] | None = None,
             block_tokens: int | None = None):
    """ops.conv.cca_conv on the GPU, or with `to_cache` ops.conv.cca_conv_to_cache (-> q only). `form` forces one
    of the kernel's two forms (tests, benchmarks); by default steps of at most COLUMNS_MAX_TOKENS tokens take the
    columns form, larger ones the heads form. `block_tokens` forces the heads form's token block (a power of two of
    at least 16; benchmarks/ops/conv.py sweeps it)."""
    tokens, channels = proj.shape[0], weight0.shape[0]
    d, k0, k1 = weight1.shape[1], weight0.shape[-1], weight1.shape[-1]
    k_heads = channels // d - q_heads
    lag_width = lag_state.shape[-1]
    history = (k0 - 1) + (k1 - 1)
    if form not in (None, "heads", "columns"):
        raise ValueError(f"form must be 'heads', 'columns' or None, not {form!r}")
    if proj.stride(1) != 1 or proj.shape[1] != channels + 2 * lag_width:
        raise ValueError(f"proj must be [T, {channels} + 2 * {lag_width}] with unit column stride")
    if conv_state.shape[-2:] != (channels, history) or lag_state.stride(-1) != 1:
        raise ValueError(f"conv state must be [slots, {channels}, {history}]; lag state [slots, {lag_width}]")
    if not (weight0.is_contiguous() and weight1.is_contiguous()):
        raise ValueError("the conv weights must be contiguous")
    if (conv_footer is None) != (lag_footer is None):
        raise ValueError("page footers come as a pair (conv and lag) or not at all")
    if block_tokens is not None and (block_tokens < 16 or block_tokens & (block_tokens - 1)):
        raise ValueError(f"block_tokens must be a power of two of at least 16, not {block_tokens}")
    qk = torch.empty(tokens, q_heads + k_heads, d, device=proj.device, dtype=torch.float32)
    if to_cache is None:  # the epilogue's pointers are unused: any tensor will do
        value = torch.empty(tokens, k_heads, d, device=proj.device, dtype=proj.dtype)
        v_dst, query, k_cache, kv_slots, temp, inv_freq, half = value, qk, qk, batch.positions, qk, qk, 0
    else:
        query = torch.empty(tokens, q_heads, d, device=proj.device, dtype=to_cache.out_dtype)
        v_dst, k_cache, kv_slots = to_cache.v_cache, to_cache.k_cache, to_cache.slot_mapping
        temp, inv_freq, half = to_cache.temp, to_cache.inv_freq, to_cache.inv_freq.shape[0]
        if k_cache.stride(-1) != 1 or v_dst.stride(-1) != 1 or 2 * half > d:
            raise ValueError("the caches need a unit stride over D, and the rotary dims must fit in D")
    if tokens == 0:
        return query if to_cache is not None else (qk[:, :q_heads], qk[:, q_heads:], value)
    columns = tokens <= COLUMNS_MAX_TOKENS if form is None else form == "columns"
    block_d = max(16, next_power_of_2(d))
    # A row of one token has no later token reading its carried window, so token blocks need not overlap.
    overlap = max(history - 1, 0) if batch.max_query_len > 1 else 0
    if columns:
        block_t, block_o, block_k = column_tiles(tokens, channels, d, k1, overlap)
        launch = dict(COLUMNS=True, BLOCK_O=block_o, BLOCK_K=block_k,
                      STAGES=PIPELINE_STAGES if block_k < d * k1 else 1, PRECISION="ieee", num_warps=COLUMN_WARPS)
    else:
        block_t = max(block_tokens, next_power_of_2(history + 1)) if block_tokens else _block_tokens(
            tokens, history)
        block_o = block_d
        launch = dict(COLUMNS=False, BLOCK_O=block_o, BLOCK_K=1, STAGES=1,
                      PRECISION="ieee" if proj.dtype == torch.float32 else "tf32",
                      num_warps=8 if block_d >= 128 else 4)
    token_blocks = cdiv(tokens, block_t - overlap)
    heads = q_heads + k_heads
    if columns and token_blocks * heads > COUNTERS:
        raise ValueError(f"{token_blocks} token blocks x {heads} heads exceed the {COUNTERS} arrival counters")
    has_footer = conv_footer is not None
    cfoot = conv_footer if has_footer else conv_state
    lfoot = lag_footer if has_footer else lag_state
    grid = (token_blocks, heads * cdiv(d, block_o) + cdiv(lag_width, block_d))
    _cca_conv_kernel[grid](
        proj, proj.stride(0), weight0, bias0, weight1, bias1, lag_bias if lag_bias is not None else bias0,
        qk, v_dst, v_dst.stride(0), v_dst.stride(1), conv_state, *conv_state.stride(), lag_state,
        lag_state.stride(0), cfoot, *cfoot.stride(), lfoot, lfoot.stride(0), batch.seq_ids, batch.query_start_loc,
        batch.state_slots, batch.has_initial_state, batch.positions, batch.page_table, batch.page_table.stride(0),
        batch.page_size, batch.verify.token_slots if batch.verify is not None else batch.positions, tokens,
        kv_head_offset, _arrival_counters(proj.device) if columns else qk, kv_slots, temp, inv_freq, query,
        k_cache, k_cache.stride(0), k_cache.stride(1), math.sqrt(d), torch.finfo(torch.float32).eps,
        HQ=q_heads, HK=k_heads, D=d, VH=lag_width, K0=k0, K1=k1, P=history, OVERLAP=overlap, BLOCK_T=block_t,
        BLOCK_D=block_d, BLOCK_P=next_power_of_2(max(history, 1)), HAS_LAG_BIAS=lag_bias is not None,
        HAS_FOOTER=has_footer, HAS_VERIFY=batch.verify is not None, TO_CACHE=to_cache is not None, HALF=half,
        **launch, **pdl.launch(proj.device))
    return query if to_cache is not None else (qk[:, :q_heads], qk[:, q_heads:], value)
