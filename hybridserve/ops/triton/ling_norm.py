"""Ling's RMS-norm fusions in Triton: each program normalises a tile of rows (whole rows, channel groups, or q/k
heads; about 2048 elements, so narrow rows share a program); the same contract and roundings as
ops/reference/ling_norm.py, which stays the oracle."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, rows, width,
                         stride_x, stride_r, stride_o, stride_ro, eps,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    col = tl.arange(0, BLOCK_C)[None, :]
    mask = (row < rows) & (col < width)
    x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * stride_r + col, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(residual_out_ptr.dtype.element_ty)  # the residual stream keeps its dtype
    tl.store(residual_out_ptr + row * stride_ro + col, h, mask=mask)
    h = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / width + eps)[:, None]
    # The roundings of RMSNorm as a module: normalised value to the stream's dtype, then to the weight's.
    normed = (h * rstd).to(residual_out_ptr.dtype.element_ty).to(weight_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + col, mask=col < width, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + col, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_rms_norm_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, rows, group_size, stride_x, stride_g, stride_o,
                           eps, HAS_GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    local = tl.arange(0, BLOCK_C)[None, :]
    col = tl.program_id(1) * group_size + local
    mask = (row < rows) & (local < group_size)
    x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / group_size + eps)[:, None]
    out = tl.load(weight_ptr + col, mask=local < group_size, other=0.0).to(tl.float32) * (x * rstd)
    if HAS_GATE:
        out *= tl.sigmoid(tl.load(gate_ptr + row * stride_g + col, mask=mask, other=0.0).to(tl.float32))
    tl.store(out_ptr + row * stride_o + col, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(x_ptr, q_weight_ptr, k_weight_ptr, positions_ptr, inv_freq_ptr, out_ptr, rows, heads,
                         stride_xt, stride_xs, stride_xh, stride_ot, stride_os, stride_oh, eps,
                         HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """BLOCK_R heads of [T, 2, H] (row = (token, q or k, head)), each in three column pieces: the two rotated
    halves [0, HALF) and [HALF, 2 HALF), and the pass-through rest."""
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


def _rows(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{what} must be [rows, channels] with unit channel stride; got {tuple(x.shape)} "
                         f"strides {x.stride()}")


def _tile(width: int) -> tuple[int, int, int]:
    """(rows per program, column block, warps): ~2048-element tiles, so narrow rows share a program."""
    block_c = triton.next_power_of_2(width)
    block_r = max(1, 2048 // block_c)
    return block_r, block_c, max(1, min(8, block_r * block_c // 512))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _rows(x, "x")
    _rows(residual, "residual")
    if x.shape != residual.shape or weight.shape != x.shape[1:]:
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty(x.shape, device=x.device, dtype=weight.dtype)
    residual_out = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, residual.dtype))
    rows, width = x.shape
    block_r, block_c, warps = _tile(width)
    _add_rms_norm_kernel[(triton.cdiv(rows, block_r),)](
        x, residual, weight.contiguous(), out, residual_out, rows, width, x.stride(0), residual.stride(0),
        out.stride(0), residual_out.stride(0), eps, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out, residual_out


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
    _group_rms_norm_kernel[(triton.cdiv(rows, block_r), num_groups)](
        x, x if gate is None else gate, weight.contiguous(), out, rows, group_size, x.stride(0),
        0 if gate is None else gate.stride(0), out.stride(0), eps, HAS_GATE=gate is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
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
    _qk_norm_rope_kernel[(triton.cdiv(rows, block_r),)](
        qk, q_weight.contiguous() if norm else inv_freq, k_weight.contiguous() if norm else inv_freq, positions,
        inv_freq.contiguous(), out, rows, heads, qk.stride(0), qk.stride(1), qk.stride(2), out.stride(0),
        out.stride(1), out.stride(2), eps, HEAD_DIM=head_dim, HALF=half, HAS_NORM=norm, BLOCK_R=block_r,
        BLOCK_HALF=max(16, triton.next_power_of_2(half)),
        BLOCK_PASS=max(16, triton.next_power_of_2(head_dim - 2 * half)), num_warps=warps)
    return out
