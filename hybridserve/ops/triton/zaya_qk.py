"""ZAYA1's QKNorm + partial NeoX RoPE + K cache write of one head, as the CCA conv kernel's epilogue
(contract: ops/reference/zaya_qk.py; the caller: ops/triton/conv.py).

The conv's program(s) of a head store its fp32 outputs for a block of tokens; the head's last program reads them
back as a [tokens, D] tile. Each rotated channel needs its NeoX partner (i <-> i + rot/2), so the tile is loaded a
second time at the partner columns; both copies get the same per-token scale, which keeps the reference's order of
roundings.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate(x, mate, cos, sin, d, HALF: tl.constexpr):
    first = (d < HALF)[None, :]
    rotated = (d < 2 * HALF)[None, :]
    return tl.where(first, x * cos - mate * sin, tl.where(rotated, x * cos + mate * sin, x))


@triton.jit
def rotation(tok, g, mine, pos_ptr, inv_freq_ptr, temp_ptr, HQ: tl.constexpr, HALF: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """(cos, sin [tokens, BLOCK_D], temperature) of head g at the `mine` tokens' positions (the temperature 1 for a
    q head), for `norm_rope_store`. The positions are step metadata the host copied, the frequencies and
    temperatures weights: the caller makes this before its PDL wait. Made after the norm's sum, their loads were a
    round trip of their own (no load moves across a reduction's barrier) on a decode step's critical path."""
    d = tl.arange(0, BLOCK_D)
    freq = tl.load(inv_freq_ptr + tl.where(d < HALF, d, d - HALF), mask=d < 2 * HALF, other=0.0)
    angle = tl.load(pos_ptr + tok, mask=mine, other=0).to(tl.float32)[:, None] * freq[None, :]
    temp = tl.load(temp_ptr + (g - HQ), mask=g >= HQ, other=1.0).to(tl.float32)
    return tl.cos(angle), tl.sin(angle), temp


@triton.jit
def norm_rope_store(qk_ptr, tok, g, mine, rope, q_out_ptr, k_cache_ptr, kc_s0, kc_s1, kv_row, scale, eps,
                    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                    CACHE: tl.constexpr):
    """Head g (q heads first, then k heads) of the `mine` tokens of `tok`, read from qk [T, HQ + HK, D] fp32:
    scaled to norm sqrt(D) (`scale`; the norm clamped at eps), a k head times its temperature, rotated at the
    token's position (`rope`: `rotation`'s); a q head goes to q_out [T, HQ, D], a k head to the K cache row
    `kv_row` of its token."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    partner = tl.where(d < HALF, d + HALF, tl.where(d < 2 * HALF, d - HALF, d))
    ok = mine[:, None] & d_ok[None, :]
    base = qk_ptr + (tok[:, None].to(tl.int64) * (HQ + HK) + g) * D
    x = tl.load(base + d[None, :], mask=ok, other=0.0, cache_modifier=CACHE)
    mate = tl.load(base + partner[None, :], mask=ok, other=0.0, cache_modifier=CACHE)
    factor = scale / tl.maximum(tl.sqrt_rn(tl.sum(x * x, axis=1)), eps)
    x, mate = x * factor[:, None], mate * factor[:, None]
    cos, sin, temp = rope
    if g < HQ:
        q = _rotate(x, mate, cos, sin, d, HALF)
        tl.store(q_out_ptr + (tok[:, None].to(tl.int64) * HQ + g) * D + d[None, :],
                 q.to(q_out_ptr.dtype.element_ty), mask=ok)
    else:
        k = _rotate(x * temp, mate * temp, cos, sin, d, HALF)
        tl.store(k_cache_ptr + kv_row[:, None] * kc_s0 + (g - HQ) * kc_s1 + d[None, :],
                 k.to(k_cache_ptr.dtype.element_ty), mask=ok)
