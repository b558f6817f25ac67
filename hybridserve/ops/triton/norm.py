"""The fp32 residual update fused with the next RMSNorm: one program per row (contract: ops/reference/norm.py).

The reference's rounding is kept: the normalised row is rounded to the weight's dtype once, then multiplied by
the weight in that dtype (computed in fp32, rounded again), exactly as `weight * normalized.to(dtype)` does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.pdl import wait_for_previous


@triton.jit
def _residual_rms_norm_kernel(u_ptr, u_s0, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0, w_ptr,
                              x_out_ptr, h_ptr, h32_ptr, width, eps,
                              BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_UB: tl.constexpr,
                              HAS_US: tl.constexpr, HAS_RB: tl.constexpr, HAS_RS: tl.constexpr,
                              HAS_SKIP: tl.constexpr, FP32_COPY: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    ok = col < width
    u = tl.load(u_ptr + row * u_s0 + col, mask=ok, other=0.0).to(tl.float32)
    if HAS_SKIP:
        weight = tl.load(sw_ptr + row).to(tl.float32)
        u += weight * tl.load(sx_ptr + row * sx_s0 + col, mask=ok, other=0.0).to(tl.float32)
    if HAS_UB:
        u += tl.load(ub_ptr + col, mask=ok, other=0.0).to(tl.float32)
    if HAS_US:
        u *= tl.load(us_ptr + col, mask=ok, other=0.0).to(tl.float32)
    x = u
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * r_s0 + col, mask=ok, other=0.0).to(tl.float32)
        if HAS_RB:
            r += tl.load(rb_ptr + col, mask=ok, other=0.0).to(tl.float32)
        if HAS_RS:
            r *= tl.load(rs_ptr + col, mask=ok, other=0.0).to(tl.float32)
        x = u + r
    tl.store(x_out_ptr + row * width + col, x, mask=ok)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    dtype = h_ptr.dtype.element_ty
    normed = (x * rstd).to(dtype).to(tl.float32)
    h = (tl.load(w_ptr + col, mask=ok, other=0.0).to(tl.float32) * normed).to(dtype)
    tl.store(h_ptr + row * width + col, h, mask=ok)
    if FP32_COPY:
        tl.store(h32_ptr + row * width + col, h.to(tl.float32), mask=ok)


def residual_rms_norm(update: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None, update_bias: torch.Tensor | None = None,
                      update_scale: torch.Tensor | None = None, residual_bias: torch.Tensor | None = None,
                      residual_scale: torch.Tensor | None = None, skip_weight: torch.Tensor | None = None,
                      skip_input: torch.Tensor | None = None, fp32_copy: bool = False):
    rows, width = update.shape
    for name, t in (("update", update), ("residual", residual), ("skip_input", skip_input)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit column stride")
    h = torch.empty(rows, width, device=update.device, dtype=norm_weight.dtype)
    if fp32_copy and norm_weight.dtype != torch.float32:  # the fp32 residual and the fp32 copy: one allocation
        x, h32 = torch.empty(2, rows, width, device=update.device, dtype=torch.float32)
    else:
        x = torch.empty(rows, width, device=update.device, dtype=torch.float32)
        h32 = h if fp32_copy else None
    if rows:
        block = triton.next_power_of_2(width)
        dummy = update
        _residual_rms_norm_kernel[(rows,)](
            update, update.stride(0), residual if residual is not None else dummy,
            residual.stride(0) if residual is not None else 0,
            *(t if t is not None else dummy for t in (update_bias, update_scale, residual_bias, residual_scale,
                                                       skip_weight, skip_input)),
            skip_input.stride(0) if skip_input is not None else 0, norm_weight, x, h, h32 if h32 is not None else h,
            width, eps, BLOCK=block, HAS_RESIDUAL=residual is not None, HAS_UB=update_bias is not None,
            HAS_US=update_scale is not None, HAS_RB=residual_bias is not None, HAS_RS=residual_scale is not None,
            HAS_SKIP=skip_weight is not None, FP32_COPY=h32 is not None and h32 is not h,
            num_warps=min(16, max(1, block // 256)), **pdl.launch(x.device))
    return x, h, h32
