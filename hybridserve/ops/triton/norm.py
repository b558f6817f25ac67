"""The fp32 residual update fused with the next RMSNorm: one program per row (contract: ops/reference/norm.py).

The reference's rounding is kept: the normalised row is rounded to the weight's dtype once, then multiplied by
the weight in that dtype (computed in fp32, rounded again), exactly as `weight * normalized.to(dtype)` does.

The row itself is `residual_norm_row`, which the decode GEMV kernels also run as an epilogue (`ops.norm.
ResidualNorm`): `epilogue_args` packs a ResidualNorm's tensors (its `ResidualNormArgs`) into that function's
arguments, after the update's pointer and row stride, which the calling kernel supplies.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.ops.residual_norm_args import ResidualNormArgs
from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.pdl import prefetch_share, wait_for_previous
from hybridserve.ops.triton.sizes import next_power_of_2


@triton.jit
def residual_norm_row(row, u_ptr, u_s0, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0, w_ptr,
                      x_out_ptr, h_ptr, h32_ptr, width, eps, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                      HAS_UB: tl.constexpr, HAS_US: tl.constexpr, HAS_RB: tl.constexpr, HAS_RS: tl.constexpr,
                      HAS_SKIP: tl.constexpr, FP32_COPY: tl.constexpr, U_CACHE: tl.constexpr):
    """Row `row`: x = the updated residual (fp32), h = norm(x) in the weight's dtype (and its fp32 copy).
    U_CACHE: the update's load cache modifier (".cg" where other programs of the same kernel wrote it)."""
    one = tl.cast(row, tl.int64) + tl.arange(0, 1)  # a Python int in the interpreter's loops
    residual_norm_rows(one, one == one, True, u_ptr, u_s0, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr,
                       sx_ptr, sx_s0, w_ptr, x_out_ptr, h_ptr, h32_ptr, width, eps, BLOCK, HAS_RESIDUAL, HAS_UB,
                       HAS_US, HAS_RB, HAS_RS, HAS_SKIP, FP32_COPY, U_CACHE)


@triton.jit
def residual_norm_rows(rows, row_ok, store, u_ptr, u_s0, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr,
                       sx_s0, w_ptr, x_out_ptr, h_ptr, h32_ptr, width, eps, BLOCK: tl.constexpr,
                       HAS_RESIDUAL: tl.constexpr, HAS_UB: tl.constexpr, HAS_US: tl.constexpr, HAS_RB: tl.constexpr,
                       HAS_RS: tl.constexpr, HAS_SKIP: tl.constexpr, FP32_COPY: tl.constexpr,
                       U_CACHE: tl.constexpr):
    """`residual_norm_row` of the rows `rows` [R] where `row_ok`, stored only if `store` (a program that needs h
    for its own product but is not the one that writes it). -> h as fp32 [R, BLOCK] (zero past `width`)."""
    rows = rows.to(tl.int64)
    col = tl.arange(0, BLOCK)
    col_ok = col < width
    ok = row_ok[:, None] & col_ok[None, :]
    # The norm weight is loaded with the update, not after the store of x: the compiler moves no load above a
    # store, so there it would be an L2 round trip of its own on a decode step's critical path.
    w = tl.load(w_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    u = tl.load(u_ptr + rows[:, None] * u_s0 + col[None, :], mask=ok, other=0.0, cache_modifier=U_CACHE)
    skip_weight = 0.0
    if HAS_SKIP:
        skip_weight = tl.load(sw_ptr + rows, mask=row_ok, other=0.0)
    terms = residual_terms(rows, row_ok, col, col_ok, skip_weight, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sx_ptr,
                           sx_s0, HAS_RESIDUAL, HAS_UB, HAS_US, HAS_RB, HAS_RS, HAS_SKIP)
    x = updated_residual(u.to(tl.float32), terms, HAS_RESIDUAL, HAS_UB, HAS_US, HAS_SKIP)
    out = rows[:, None] * width + col[None, :]
    stored = tl.where(store, ok, False)  # tl.where, not &: the interpreter cannot AND a mask with a scalar
    tl.store(x_out_ptr + out, x, mask=stored)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    h = rms_normed(x, rstd, w, h_ptr.dtype.element_ty)
    tl.store(h_ptr + out, h, mask=stored)
    if FP32_COPY:
        tl.store(h32_ptr + out, h.to(tl.float32), mask=stored)
    return h.to(tl.float32)


@triton.jit
def residual_terms(rows, row_ok, col, col_ok, skip_weight, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sx_ptr, sx_s0,
                   HAS_RESIDUAL: tl.constexpr, HAS_UB: tl.constexpr, HAS_US: tl.constexpr, HAS_RB: tl.constexpr,
                   HAS_RS: tl.constexpr, HAS_SKIP: tl.constexpr):
    """What `updated_residual` combines an update with at rows x columns `col` (int64 rows), loaded apart from it
    (a kernel may load them before its PDL wait): (skip weight [R, 1] (`skip_weight` [R], given), skip input, update
    bias, update scale, the biased and scaled residual), each fp32 where present, else 0."""
    ok = row_ok[:, None] & col_ok[None, :]
    weight, skip, ub, us, r = 0.0, 0.0, 0.0, 0.0, 0.0
    if HAS_SKIP:
        weight = skip_weight.to(tl.float32)[:, None]
        skip = tl.load(sx_ptr + rows[:, None] * sx_s0 + col[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_UB:
        ub = tl.load(ub_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_US:
        us = tl.load(us_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * r_s0 + col[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_RB:
            r += tl.load(rb_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_RS:
            r *= tl.load(rs_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return weight, skip, ub, us, r


@triton.jit
def updated_residual(u, terms, HAS_RESIDUAL: tl.constexpr, HAS_UB: tl.constexpr, HAS_US: tl.constexpr,
                     HAS_SKIP: tl.constexpr):
    """x [R, C] fp32, the updated residual (ops/norm.py's formula) of the update u [R, C] (fp32) and its
    `residual_terms`."""
    weight, skip, ub, us, r = terms
    if HAS_SKIP:
        u += weight * skip
    if HAS_UB:
        u += ub
    if HAS_US:
        u *= us
    x = u
    if HAS_RESIDUAL:
        x = u + r
    return x


@triton.jit
def rms_normed(x, rstd, w, dtype: tl.constexpr):
    """h = w * to_dtype(x * rstd) in `dtype` (x [R, C] fp32, rstd [R], w [1, C] fp32): the reference's two
    roundings."""
    normed = (x * rstd[:, None]).to(dtype).to(tl.float32)
    return (w * normed).to(dtype)


@triton.jit
def pending_sums(sums_ptr, sums_s0, parts, rows, row_ok, BLOCK_PARTS: tl.constexpr):
    """[R, BLOCK_PARTS] fp32: the `parts` (at most BLOCK_PARTS) partial sums of squares a row of a PendingNorm
    (ops/norm.py), zero past them; `pending_rstd` of them is the rows' rstd."""
    p = tl.arange(0, BLOCK_PARTS)
    return tl.load(sums_ptr + rows.to(tl.int64)[:, None] * sums_s0 + p[None, :],
                   mask=row_ok[:, None] & (p < parts)[None, :], other=0.0)


@triton.jit
def pending_rstd(sums, width, eps):
    """[R] fp32: 1 / sqrt(mean(x^2) + eps) of rows of `width` from their `pending_sums`."""
    return tl.rsqrt(tl.sum(sums, axis=1) / width + eps)


@triton.jit
def prefetch_row_inputs(row, program, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0, w_ptr,
                        width, HAS_RESIDUAL: tl.constexpr, HAS_UB: tl.constexpr, HAS_US: tl.constexpr,
                        HAS_RB: tl.constexpr, HAS_RS: tl.constexpr, HAS_SKIP: tl.constexpr):
    """Before a PDL wait, ask L2 for this program's line (`program`) of each tensor `residual_norm_row` of `row`
    reads besides the update: as an epilogue only the last program to arrive reads them, after the kernel's own
    products, and the vectors (weights, last read a step ago) would come from HBM on the step's critical path. A
    prefetch is a hint and L2 is coherent: it is safe whichever kernel wrote them."""
    row = tl.cast(row, tl.int64)
    prefetch_share(w_ptr, width, program)
    if HAS_SKIP:
        prefetch_share(sw_ptr + row, 1, program)
        prefetch_share(sx_ptr + row * sx_s0, width, program)
    if HAS_UB:
        prefetch_share(ub_ptr, width, program)
    if HAS_US:
        prefetch_share(us_ptr, width, program)
    if HAS_RESIDUAL:
        prefetch_share(r_ptr + row * r_s0, width, program)
        if HAS_RB:
            prefetch_share(rb_ptr, width, program)
        if HAS_RS:
            prefetch_share(rs_ptr, width, program)


@triton.jit
def _residual_rms_norm_kernel(u_ptr, u_s0, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr, sx_s0, w_ptr,
                              x_out_ptr, h_ptr, h32_ptr, width, eps,
                              BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_UB: tl.constexpr,
                              HAS_US: tl.constexpr, HAS_RB: tl.constexpr, HAS_RS: tl.constexpr,
                              HAS_SKIP: tl.constexpr, FP32_COPY: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    residual_norm_row(tl.program_id(0), u_ptr, u_s0, r_ptr, r_s0, ub_ptr, us_ptr, rb_ptr, rs_ptr, sw_ptr, sx_ptr,
                      sx_s0, w_ptr, x_out_ptr, h_ptr, h32_ptr, width, eps, BLOCK, HAS_RESIDUAL, HAS_UB, HAS_US,
                      HAS_RB, HAS_RS, HAS_SKIP, FP32_COPY, "")


def epilogue_args(norm: ResidualNormArgs | None, rows: int, width: int, like: torch.Tensor, pending: bool = False):
    """(the arguments of `residual_norm_row` after u_ptr and u_s0, its constexprs, (x, h, h32) outputs) of `norm`
    over `rows` rows of `width`; `norm` None: placeholders (`like` for every pointer), every flag off, no outputs.
    `pending` (a kernel that leaves h to its reader, where `norm.h_pending` allows it): the outputs are (x, None,
    None) and h's pointers placeholders; every other kernel makes h whatever `h_pending` allows."""
    if norm is None:
        absent = ResidualNormArgs(like, 0.0)  # every optional tensor absent: each flag off, `like` in each pointer
        return _pack(absent, 1, (like, like, None), like), _flags(absent, 1, False), None
    for name, t in (("residual", norm.residual), ("skip_input", norm.skip_input)):
        if t is not None and (t.stride(-1) != 1 or t.shape != (rows, width)):
            raise ValueError(f"{name} must be [{rows}, {width}] with a unit column stride")
    if pending:  # x only: h is left to its reader (the caller stores the sums of squares)
        x = torch.empty(rows, width, device=like.device, dtype=torch.float32)
        return _pack(norm, width, (x, like, None), like), _flags(norm, width, False), (x, None, None)
    h = torch.empty(rows, width, device=like.device, dtype=norm.norm_weight.dtype)
    if norm.fp32_copy and norm.norm_weight.dtype != torch.float32:  # the fp32 residual and its copy: one allocation
        x, h32 = torch.empty(2, rows, width, device=like.device, dtype=torch.float32)
    else:
        x = torch.empty(rows, width, device=like.device, dtype=torch.float32)
        h32 = h if norm.fp32_copy else None
    outputs = (x, h, h32)
    return _pack(norm, width, outputs, like), _flags(norm, width, h32 is not None and h32 is not h), outputs


def _pack(norm: ResidualNormArgs, width: int, outputs: tuple, like: torch.Tensor) -> tuple:
    """`residual_norm_row`'s runtime arguments after u_ptr and u_s0 (`like` for an absent tensor)."""
    def pointer(t: torch.Tensor | None) -> torch.Tensor:
        return like if t is None else t

    def row_stride(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.stride(0)

    x, h, h32 = outputs
    h32 = h if h32 is None else h32  # FP32_COPY off: never written
    return (pointer(norm.residual), row_stride(norm.residual), pointer(norm.update_bias), pointer(norm.update_scale),
            pointer(norm.residual_bias), pointer(norm.residual_scale), pointer(norm.skip_weight),
            pointer(norm.skip_input), row_stride(norm.skip_input), norm.norm_weight, x, h, h32, width, norm.eps)


def _flags(norm: ResidualNormArgs, width: int, fp32_copy: bool) -> dict:
    """`residual_norm_row`'s constexprs (FP32_COPY: a separate fp32 copy to store)."""
    return dict(BLOCK=next_power_of_2(width), HAS_RESIDUAL=norm.residual is not None,
                HAS_UB=norm.update_bias is not None, HAS_US=norm.update_scale is not None,
                HAS_RB=norm.residual_bias is not None, HAS_RS=norm.residual_scale is not None,
                HAS_SKIP=norm.skip_weight is not None, FP32_COPY=fp32_copy)


def residual_rms_norm(update: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None, update_bias: torch.Tensor | None = None,
                      update_scale: torch.Tensor | None = None, residual_bias: torch.Tensor | None = None,
                      residual_scale: torch.Tensor | None = None, skip_weight: torch.Tensor | None = None,
                      skip_input: torch.Tensor | None = None, fp32_copy: bool = False):
    rows, width = update.shape
    if update.stride(-1) != 1:
        raise ValueError("update needs a unit column stride")
    norm = ResidualNormArgs(norm_weight, eps, residual, update_bias, update_scale, residual_bias, residual_scale,
                            skip_weight, skip_input, fp32_copy)
    args, flags, outputs = epilogue_args(norm, rows, width, update)
    if rows:
        _residual_rms_norm_kernel[(rows,)](update, update.stride(0), *args, **flags,
                                           num_warps=min(16, max(1, flags["BLOCK"] // 256)),
                                           **pdl.launch(update.device))
    return outputs
