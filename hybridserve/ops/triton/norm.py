"""RMS-norm fusions in Triton, one program per row (or row x group, or token x q/k x head block); the same
contract and roundings as ops/reference/norm.py, which stays the oracle."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                         stride_x, stride_r, stride_o, stride_ro, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(residual_out_ptr.dtype.element_ty)  # the residual stream keeps its dtype
    tl.store(residual_out_ptr + row * stride_ro + offs, h, mask=mask)
    h = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / width + eps)
    # The roundings of RMSNorm as a module: normalised value to the stream's dtype, then to the weight's.
    normed = (h * rstd).to(residual_out_ptr.dtype.element_ty).to(weight_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_rms_norm_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, stride_x, stride_g, stride_o, group_size, eps,
                           HAS_GATE: tl.constexpr, BLOCK: tl.constexpr):
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1)
    local = tl.arange(0, BLOCK)
    mask = local < group_size
    offs = group * group_size + local
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / group_size + eps)
    out = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32) * (x * rstd)
    if HAS_GATE:
        out *= tl.sigmoid(tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32))
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(x_ptr, q_weight_ptr, k_weight_ptr, positions_ptr, inv_freq_ptr, out_ptr,
                         stride_xt, stride_xs, stride_xh, stride_ot, stride_os, stride_oh, heads, eps,
                         HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """A [BLOCK_H, head_dim] tile of q (which = 0) or k (which = 1) heads of one token, in three column pieces:
    the two rotated halves [0, HALF) and [HALF, 2 HALF), and the pass-through rest."""
    token, which, hblock = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    head = hblock * BLOCK_H + tl.arange(0, BLOCK_H)
    half = tl.arange(0, BLOCK_HALF)
    rest = 2 * HALF + tl.arange(0, BLOCK_PASS)
    mask_h = (head < heads)[:, None]
    mask_half, mask_rest = mask_h & (half < HALF)[None, :], mask_h & (rest < HEAD_DIM)[None, :]
    src = x_ptr + token * stride_xt + which * stride_xs + head[:, None] * stride_xh
    x1 = tl.load(src + half[None, :], mask=mask_half, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + half[None, :], mask=mask_half, other=0.0).to(tl.float32)
    x3 = tl.load(src + rest[None, :], mask=mask_rest, other=0.0).to(tl.float32)
    if HAS_NORM:
        square_sum = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
        rstd = tl.math.rsqrt(square_sum / HEAD_DIM + eps)[:, None]
        is_q = which == 0
        w1 = tl.where(is_q, tl.load(q_weight_ptr + half, mask=half < HALF, other=0.0),
                      tl.load(k_weight_ptr + half, mask=half < HALF, other=0.0)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + half, mask=half < HALF, other=0.0),
                      tl.load(k_weight_ptr + HALF + half, mask=half < HALF, other=0.0)).to(tl.float32)
        w3 = tl.where(is_q, tl.load(q_weight_ptr + rest, mask=rest < HEAD_DIM, other=0.0),
                      tl.load(k_weight_ptr + rest, mask=rest < HEAD_DIM, other=0.0)).to(tl.float32)
        x1, x2, x3 = x1 * rstd * w1[None, :], x2 * rstd * w2[None, :], x3 * rstd * w3[None, :]
    angle = tl.load(positions_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + half, mask=half < HALF, other=0.0)
    cos, sin = tl.cos(angle)[None, :], tl.sin(angle)[None, :]
    dst = out_ptr + token * stride_ot + which * stride_os + head[:, None] * stride_oh
    dtype = out_ptr.dtype.element_ty
    tl.store(dst + half[None, :], (x1 * cos - x2 * sin).to(dtype), mask=mask_half)
    tl.store(dst + HALF + half[None, :], (x2 * cos + x1 * sin).to(dtype), mask=mask_half)
    tl.store(dst + rest[None, :], x3.to(dtype), mask=mask_rest)


def _rows(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{what} must be [rows, channels] with unit channel stride; got {tuple(x.shape)} "
                         f"strides {x.stride()}")


def _num_warps(block: int) -> int:
    return max(1, min(8, block // 256))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _rows(x, "x")
    _rows(residual, "residual")
    if x.shape != residual.shape or weight.shape != x.shape[1:]:
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty(x.shape, device=x.device, dtype=weight.dtype)
    residual_out = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, residual.dtype))
    block = triton.next_power_of_2(x.shape[1])
    _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight.contiguous(), out, residual_out, x.stride(0),
                                        residual.stride(0), out.stride(0), residual_out.stride(0), x.shape[1], eps,
                                        BLOCK=block, num_warps=_num_warps(block))
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
    group_size = x.shape[1] // num_groups
    block = triton.next_power_of_2(group_size)
    _group_rms_norm_kernel[(x.shape[0], num_groups)](
        x, x if gate is None else gate, weight.contiguous(), out, x.stride(0),
        0 if gate is None else gate.stride(0), out.stride(0), group_size, eps,
        HAS_GATE=gate is not None, BLOCK=block, num_warps=_num_warps(block))
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
    block_h = min(16, triton.next_power_of_2(heads))
    grid = (tokens, 2, triton.cdiv(heads, block_h))
    norm = q_weight is not None
    _qk_norm_rope_kernel[grid](qk, q_weight.contiguous() if norm else inv_freq,
                               k_weight.contiguous() if norm else inv_freq, positions, inv_freq.contiguous(), out,
                               qk.stride(0), qk.stride(1), qk.stride(2), out.stride(0), out.stride(1), out.stride(2),
                               heads, eps, HEAD_DIM=head_dim, HALF=half, HAS_NORM=norm, BLOCK_H=block_h,
                               BLOCK_HALF=max(16, triton.next_power_of_2(half)),
                               BLOCK_PASS=max(16, triton.next_power_of_2(head_dim - 2 * half)), num_warps=4)
    return out
