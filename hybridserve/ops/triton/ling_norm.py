"""Ling's RMS-norm fusions in Triton: each program normalises a tile of rows (whole rows, channel groups, or q/k
heads; about 2048 elements, so narrow rows share a program); the same contract and roundings as
ops/reference/ling_norm.py, which stays the oracle."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.pdl import wait_for_previous
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2


@triton.jit
def _add_rms_norm_kernel(x_ptr, addend_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, out32_ptr, rows,
                         width, stride_x, stride_xp, stride_a, stride_r, stride_o, stride_ro, eps,
                         PARTS: tl.constexpr, HAS_ADDEND: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         FP32_COPY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """x's PARTS rows a row (a token's routed expert rows; 1: x itself) summed in fp32 in part order and rounded
    once to x's dtype, plus the addend (rounded to x's dtype, as `x + addend` is), plus the residual, then the norm.
    Every input is loaded at once after the wait, before the first add: in a loop (even one unrolled by 8, whose
    remainder loop took Ling's 7 parts after the first) each part's load went out only after the add before it,
    one memory round trip a part, and the addend's and residual's after all of them."""
    col = tl.arange(0, BLOCK_C)[None, :]
    # A weight: before the wait (after the residual store it would be an L2 round trip of its own: no load moves
    # above a store).
    weight = tl.load(weight_ptr + col, mask=col < width, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)
    row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    mask = (row < rows) & (col < width)
    h = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
    parts = ()
    for part in tl.static_range(1, PARTS):
        parts = parts + (tl.load(x_ptr + row * stride_x + part * stride_xp + col, mask=mask, other=0.0),)
    if HAS_ADDEND:
        addend = tl.load(addend_ptr + row * stride_a + col, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + col, mask=mask, other=0.0)
    stream = h.dtype
    if PARTS > 1:
        h = h.to(tl.float32)
        for part in tl.static_range(PARTS - 1):
            h += parts[part].to(tl.float32)
        h = h.to(stream)
    if HAS_ADDEND:
        h = (h.to(tl.float32) + addend.to(tl.float32)).to(stream)
    if HAS_RESIDUAL:
        stream = residual_out_ptr.dtype.element_ty  # the residual stream keeps its dtype
        h = (h.to(tl.float32) + r.to(tl.float32)).to(stream)
        tl.store(residual_out_ptr + row * stride_ro + col, h, mask=mask)
    h = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / width + eps)[:, None]
    # The roundings of RMSNorm as a module: normalised value to the stream's dtype, then to the weight's.
    normed = (h * rstd).to(stream).to(weight_ptr.dtype.element_ty).to(tl.float32)
    out = (weight * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + col, out, mask=mask)
    if FP32_COPY:
        tl.store(out32_ptr + row * width + col, out.to(tl.float32), mask=mask)


@triton.jit
def _group_rms_norm_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, rows, group_size, stride_x, stride_g, stride_o,
                           eps, HAS_GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                           USE_PDL: tl.constexpr):
    local = tl.arange(0, BLOCK_C)[None, :]
    col = tl.program_id(1) * group_size + local
    weight = tl.load(weight_ptr + col, mask=local < group_size, other=0.0).to(tl.float32)  # a weight: before the wait
    wait_for_previous(USE_PDL)
    row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    mask = (row < rows) & (local < group_size)
    x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:  # with x, not a round trip after the sum (no load moves across its barrier)
        gate = tl.load(gate_ptr + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / group_size + eps)[:, None]
    out = weight * (x * rstd)
    if HAS_GATE:
        out *= tl.sigmoid(gate)
    tl.store(out_ptr + row * stride_o + col, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(x_ptr, q_weight_ptr, k_weight_ptr, positions_ptr, inv_freq_ptr, out_ptr, rows, heads,
                         stride_xt, stride_xs, stride_xh, stride_ot, stride_os, stride_oh, eps,
                         HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """BLOCK_R heads of [T, 2, H] (row = (token, q or k, head)), each in three column pieces: the two rotated
    halves [0, HALF) and [HALF, 2 HALF), and the pass-through rest."""
    wait_for_previous(USE_PDL)
    row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    token, which, head = row // (2 * heads), (row // heads) % 2, row % heads
    live = (row < rows)[:, None]
    half = tl.arange(0, BLOCK_HALF)[None, :]
    rest = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
    mask_half, mask_rest = live & (half < HALF), live & (rest < HEAD_DIM)
    src = x_ptr + (token * stride_xt + which * stride_xs + head * stride_xh)[:, None]
    x1 = tl.load(src + half, mask=mask_half, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + half, mask=mask_half, other=0.0).to(tl.float32)
    x3 = tl.load(src + rest, mask=mask_rest, other=0.0).to(tl.float32)
    if HAS_NORM:
        square_sum = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
        rstd = tl.math.rsqrt(square_sum / HEAD_DIM + eps)[:, None]
        is_q = (which == 0)[:, None]
        w1 = tl.where(is_q, tl.load(q_weight_ptr + half, mask=half < HALF, other=0.0),
                      tl.load(k_weight_ptr + half, mask=half < HALF, other=0.0)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + half, mask=half < HALF, other=0.0),
                      tl.load(k_weight_ptr + HALF + half, mask=half < HALF, other=0.0)).to(tl.float32)
        w3 = tl.where(is_q, tl.load(q_weight_ptr + rest, mask=rest < HEAD_DIM, other=0.0),
                      tl.load(k_weight_ptr + rest, mask=rest < HEAD_DIM, other=0.0)).to(tl.float32)
        x1, x2, x3 = x1 * rstd * w1, x2 * rstd * w2, x3 * rstd * w3
    position = tl.load(positions_ptr + token, mask=row < rows, other=0).to(tl.float32)[:, None]
    angle = position * tl.load(inv_freq_ptr + half, mask=half < HALF, other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    dst = out_ptr + (token * stride_ot + which * stride_os + head * stride_oh)[:, None]
    dtype = out_ptr.dtype.element_ty
    tl.store(dst + half, (x1 * cos - x2 * sin).to(dtype), mask=mask_half)
    tl.store(dst + HALF + half, (x2 * cos + x1 * sin).to(dtype), mask=mask_half)
    tl.store(dst + rest, x3.to(dtype), mask=mask_rest)


@triton.jit
def _pairs(src, live, half, STEP: tl.constexpr, OFFSET: tl.constexpr):
    """The pairs (i * STEP, i * STEP + OFFSET) of rows `src` ([R, 1] pointers, [R, BLOCK_HALF] mask `live`) in
    fp32: NeoX pairs are (i, i + half), GPT-J ones (2i, 2i + 1)."""
    x1 = tl.load(src + half * STEP, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + half * STEP + OFFSET, mask=live, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _rotate(x1, x2, dst, live, cos, sin, half, STEP: tl.constexpr, OFFSET: tl.constexpr):
    """`_pairs`' x1, x2 rotated into `dst`, rounded to its dtype."""
    dtype = dst.dtype.element_ty
    tl.store(dst + half * STEP, (x1 * cos - x2 * sin).to(dtype), mask=live)
    tl.store(dst + half * STEP + OFFSET, (x2 * cos + x1 * sin).to(dtype), mask=live)


@triton.jit
def _mla_latent_kernel(kv_ptr, weight_ptr, q_ptr, q_out_ptr, positions_ptr, inv_freq_ptr, slots_ptr, cache_ptr,
                       heads, stride_kv, stride_qt, stride_qh, stride_ot, stride_oh, stride_c, eps,
                       RANK: tl.constexpr, HALF: tl.constexpr, STEP: tl.constexpr, OFFSET: tl.constexpr,
                       BLOCK_RANK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """One token: its latent row [RMSNorm(c_kv) | rope(k_rope)] written to the cache at its slot, and its query
    heads' rope channels rotated into q_out."""
    token = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK_RANK)
    ok = col < RANK
    half = tl.arange(0, BLOCK_HALF)[None, :]
    # Weights and the step's metadata before the wait; the inputs all before the sum and the stores (no load moves
    # across a reduction's barrier or above a store: each would be an L2 round trip of its own).
    weight = tl.load(weight_ptr + col, mask=ok, other=0.0).to(tl.float32)
    row = cache_ptr + tl.load(slots_ptr + token).to(tl.int64) * stride_c
    angle = tl.load(positions_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + half, mask=half < HALF,
                                                                      other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)  # their range reduction's table loads too
    wait_for_previous(USE_PDL)
    c = tl.load(kv_ptr + token * stride_kv + col, mask=ok, other=0.0)
    k1, k2 = _pairs(kv_ptr + token * stride_kv + RANK, half < HALF, half, STEP, OFFSET)
    head = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)
    live = (head < heads) & (half < HALF)
    q1, q2 = _pairs(q_ptr + token * stride_qt + head * stride_qh, live, half, STEP, OFFSET)
    c32 = c.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(c32 * c32, axis=0) / RANK + eps)
    # RMSNorm's roundings as a module: normalised value to the input's dtype, then to the weight's.
    normed = (c32 * rstd).to(c.dtype).to(weight_ptr.dtype.element_ty).to(tl.float32)
    normed = (weight * normed).to(weight_ptr.dtype.element_ty)
    tl.store(row + col, normed.to(cache_ptr.dtype.element_ty), mask=ok)

    _rotate(k1, k2, row + RANK, half < HALF, cos, sin, half, STEP, OFFSET)
    _rotate(q1, q2, q_out_ptr + token * stride_ot + head * stride_oh, live, cos, sin, half, STEP, OFFSET)


def _rows(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{what} must be [rows, channels] with unit channel stride; got {tuple(x.shape)} "
                         f"strides {x.stride()}")


def _tile(width: int) -> tuple[int, int, int]:
    """(rows per program, column block, warps): ~2048-element tiles, so narrow rows share a program."""
    block_c = next_power_of_2(width)
    block_r = max(1, 2048 // block_c)
    return block_r, block_c, max(1, min(8, block_r * block_c // 512))


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
          addend: torch.Tensor | None,
          fp32_copy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [T, C], or [T, P, C] parts summed first."""
    parts = x.shape[1] if x.dim() == 3 else 1
    rows_x = x if x.dim() == 2 else x[:, 0]
    _rows(rows_x, "x")
    for name, t in (("residual", residual), ("addend", addend)):
        if t is not None:
            _rows(t, name)
            if t.shape != rows_x.shape:
                raise ValueError(f"{name} {tuple(t.shape)} does not match x {tuple(x.shape)}")
    if weight.shape != rows_x.shape[1:]:
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    rows, width = rows_x.shape
    out = torch.empty(rows, width, device=x.device, dtype=weight.dtype)
    residual_out = None if residual is None else \
        torch.empty(rows, width, device=x.device, dtype=torch.promote_types(x.dtype, residual.dtype))
    out32 = None
    if fp32_copy:
        out32 = out if out.dtype == torch.float32 else torch.empty(rows, width, device=x.device, dtype=torch.float32)
    block_r, block_c, warps = _tile(width)
    _add_rms_norm_kernel[(cdiv(rows, block_r),)](
        x, x if addend is None else addend, x if residual is None else residual, weight.contiguous(), out,
        out if residual_out is None else residual_out, out if out32 is None else out32, rows, width,
        x.stride(0), x.stride(1) if parts > 1 else 0, 0 if addend is None else addend.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0),
        0 if residual_out is None else residual_out.stride(0), eps, PARTS=parts, HAS_ADDEND=addend is not None,
        HAS_RESIDUAL=residual is not None, FP32_COPY=out32 is not None and out32 is not out, BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=warps, **pdl.launch(x.device))
    return out, residual_out, out32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps, None, False)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 addend: torch.Tensor | None = None,
                 fp32_copy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return _norm(x, residual, weight, eps, addend, fp32_copy)


def group_rms_norm(x: torch.Tensor, weight: torch.Tensor, num_groups: int, eps: float,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    _rows(x, "x")
    if gate is not None:
        _rows(gate, "gate")
    if x.shape[1] % num_groups or weight.shape != x.shape[1:] or (gate is not None and gate.shape != x.shape):
        raise ValueError(f"x {tuple(x.shape)} in {num_groups} groups, weight {tuple(weight.shape)}, "
                         f"gate {None if gate is None else tuple(gate.shape)}")
    dtype = gate.dtype if gate is not None else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, device=x.device, dtype=dtype)
    rows, group_size = x.shape[0], x.shape[1] // num_groups
    block_r, block_c, warps = _tile(group_size)
    _group_rms_norm_kernel[(cdiv(rows, block_r), num_groups)](
        x, x if gate is None else gate, weight.contiguous(), out, rows, group_size, x.stride(0),
        0 if gate is None else gate.stride(0), out.stride(0), eps, HAS_GATE=gate is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps, **pdl.launch(x.device))
    return out


def qk_norm_rope(qk: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> torch.Tensor:
    tokens, pair, heads, head_dim = qk.shape
    half = inv_freq.numel()
    if pair != 2 or qk.stride(-1) != 1 or 2 * half > head_dim or positions.shape != (tokens,):
        raise ValueError(f"qk must be [T, 2, H, d] with unit stride along d, rotating 2*{half} <= d channels, "
                         f"with one position per token; got {tuple(qk.shape)}, positions {tuple(positions.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q and k norm weights must be given together (or neither)")
    out = torch.empty(qk.shape, device=qk.device, dtype=qk.dtype)
    rows = tokens * 2 * heads
    block_r, _, warps = _tile(head_dim)
    norm = q_weight is not None
    _qk_norm_rope_kernel[(cdiv(rows, block_r),)](
        qk, q_weight.contiguous() if norm else inv_freq, k_weight.contiguous() if norm else inv_freq, positions,
        inv_freq.contiguous(), out, rows, heads, qk.stride(0), qk.stride(1), qk.stride(2), out.stride(0),
        out.stride(1), out.stride(2), eps, HEAD_DIM=head_dim, HALF=half, HAS_NORM=norm, BLOCK_R=block_r,
        BLOCK_HALF=max(16, next_power_of_2(half)),
        BLOCK_PASS=max(16, next_power_of_2(head_dim - 2 * half)), num_warps=warps,
        **pdl.launch(qk.device))
    return out


def mla_latent_rope(kv_a: torch.Tensor, norm_weight: torch.Tensor, q_rope: torch.Tensor, q_out: torch.Tensor,
                    positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool, eps: float,
                    slot_mapping: torch.Tensor, latent_cache: torch.Tensor) -> None:
    tokens, width = kv_a.shape
    rank, half = norm_weight.numel(), inv_freq.numel()
    heads = q_rope.shape[1]
    if (width != rank + 2 * half or q_rope.shape != (tokens, heads, 2 * half) or q_out.shape != q_rope.shape
            or latent_cache.shape[1:] != (1, width) or positions.shape != (tokens,)
            or slot_mapping.shape != (tokens,)):
        raise ValueError(f"kv_a {tuple(kv_a.shape)} must be [T, {rank} + {2 * half}], q_rope / q_out "
                         f"{tuple(q_rope.shape)} / {tuple(q_out.shape)} [T, H, {2 * half}], the cache rows [1, "
                         f"{width}] (got {tuple(latent_cache.shape)}), one position and slot per token")
    if any(t.stride(-1) != 1 for t in (kv_a, q_rope, q_out, latent_cache)):
        raise ValueError("kv_a, q_rope, q_out and the latent cache need unit stride along their channels")
    if tokens:
        _mla_latent_kernel[(tokens,)](
            kv_a, norm_weight.contiguous(), q_rope, q_out, positions, inv_freq.contiguous(), slot_mapping,
            latent_cache, heads, kv_a.stride(0), q_rope.stride(0), q_rope.stride(1), q_out.stride(0),
            q_out.stride(1), latent_cache.stride(0), eps, RANK=rank, HALF=half, STEP=2 if interleaved else 1,
            OFFSET=1 if interleaved else half, BLOCK_RANK=next_power_of_2(rank),
            BLOCK_HALF=max(16, next_power_of_2(half)), BLOCK_H=max(2, next_power_of_2(heads)),
            num_warps=4, **pdl.launch(kv_a.device))
