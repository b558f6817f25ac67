"""ZAYA1's QKNorm + partial NeoX RoPE + K/V cache write in one Triton kernel (contract: ops/reference/zaya_qk.py).

One program per token holds all its q heads and k heads as [heads, D] tiles. Each rotated channel needs its NeoX
partner (i <-> i + rot/2), so the tile is loaded a second time at the partner columns; both copies get the same
per-head scale, which keeps the reference's order of roundings.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.pdl import wait_for_previous
from hybridserve.ops.triton.sizes import next_power_of_2


@triton.jit
def _normed(x_ptr, s0, s1, tok, heads, d, partner, d_ok, scale, eps, BLOCK_H: tl.constexpr):
    """(x, x at the partner columns) of one token's heads, both times sqrt(D) / max(|x|, eps) (fp32)."""
    h = tl.arange(0, BLOCK_H)
    ok = (h < heads)[:, None] & d_ok[None, :]
    base = x_ptr + tok * s0 + h[:, None] * s1
    x = tl.load(base + d[None, :], mask=ok, other=0.0).to(tl.float32)
    mate = tl.load(base + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    factor = scale / tl.maximum(tl.sqrt_rn(tl.sum(x * x, axis=1)), eps)
    return x * factor[:, None], mate * factor[:, None], h, ok


@triton.jit
def _rotate(x, mate, cos, sin, d, HALF: tl.constexpr):
    first = (d < HALF)[None, :]
    rotated = (d < 2 * HALF)[None, :]
    return tl.where(first, x * cos - mate * sin, tl.where(rotated, x * cos + mate * sin, x))


@triton.jit
def _qk_norm_rope_cache_kernel(q_ptr, q_s0, q_s1, k_ptr, k_s0, k_s1, v_ptr, v_s0, v_s1, temp_ptr, inv_freq_ptr,
                               pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, kc_s0, kc_s1, v_cache_ptr, vc_s0, vc_s1,
                               scale, eps, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                               HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr,
                               BLOCK_HK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    partner = tl.where(d < HALF, d + HALF, tl.where(d < 2 * HALF, d - HALF, d))
    freq = tl.load(inv_freq_ptr + tl.where(d < HALF, d, d - HALF), mask=d < 2 * HALF, other=0.0)
    angle = (tl.load(pos_ptr + tok).to(tl.float32) * freq)[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle)

    q, q_mate, hq, q_ok = _normed(q_ptr, q_s0, q_s1, tok, HQ, d, partner, d_ok, scale, eps, BLOCK_HQ)
    q = _rotate(q, q_mate, cos, sin, d, HALF)
    tl.store(q_out_ptr + (tok * HQ + hq[:, None]) * D + d[None, :], q.to(q_out_ptr.dtype.element_ty), mask=q_ok)

    k, k_mate, hk, k_ok = _normed(k_ptr, k_s0, k_s1, tok, HK, d, partner, d_ok, scale, eps, BLOCK_HK)
    temp = tl.load(temp_ptr + hk, mask=hk < HK, other=0.0).to(tl.float32)[:, None]
    k = _rotate(k * temp, k_mate * temp, cos, sin, d, HALF)
    row = tl.load(slot_ptr + tok)
    tl.store(k_cache_ptr + row * kc_s0 + hk[:, None] * kc_s1 + d[None, :], k.to(k_cache_ptr.dtype.element_ty),
             mask=k_ok)
    v = tl.load(v_ptr + tok * v_s0 + hk[:, None] * v_s1 + d[None, :], mask=k_ok, other=0.0)
    tl.store(v_cache_ptr + row * vc_s0 + hk[:, None] * vc_s1 + d[None, :], v.to(v_cache_ptr.dtype.element_ty),
             mask=k_ok)


def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, temp: torch.Tensor,
                       inv_freq: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    tokens, q_heads, d = q.shape
    k_heads = k.shape[1]
    half = inv_freq.shape[0]
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)) or 2 * half > d:
        raise ValueError("q, k, v and the caches need a unit stride over D, and the rotary dims must fit in D")
    out = torch.empty(tokens, q_heads, d, device=q.device, dtype=out_dtype)
    if tokens:
        _qk_norm_rope_cache_kernel[(tokens,)](
            q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), temp, inv_freq,
            positions, slot_mapping, out, k_cache, k_cache.stride(0), k_cache.stride(1), v_cache, v_cache.stride(0),
            v_cache.stride(1), math.sqrt(d), torch.finfo(torch.float32).eps, HQ=q_heads, HK=k_heads, D=d,
            HALF=half, BLOCK_D=next_power_of_2(d), BLOCK_HQ=next_power_of_2(q_heads),
            BLOCK_HK=next_power_of_2(k_heads), num_warps=4, **pdl.launch(q.device))
    return out
