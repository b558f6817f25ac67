"""FP8 (e4m3) activation quantization for the W8A8 kernels (`ops.triton.fp8_linear`'s GEMM, `ops.triton.fp8_moe`'s
grouped form), and the checks and scale layouts every FP8 kernel shares: the same e4m3 values and scales as
`ops.reference.fp8.quantize_activations`, bit for bit, both in Triton's interpreter and on the GPU.

A dynamic scale is amax / 448 floored at SCALE_EPS and a value is x / scale clamped to [-448, 448], both divisions
correctly rounded (`tl.math.div_rn`: a plain `/` is an approximate division on the GPU), as torch divides. The
rounding to e4m3 is done here in fp32 arithmetic (`round_to_e4m3`, ties to even), and only the exactly
representable result is converted to float8e4nv: Triton 3.6's interpreter rounds some values wrongly in
`.to(tl.float8e4nv)` (1.96 -> 1.0, 7.92 -> 4.0), while the conversion of an e4m3 value is exact everywhere (the
GPU's cvt.rn.satfinite too).

Layouts the kernels take (core/quant.py): weight scales per row, or per 128x128 block; activation scales per token
[T], per token and 128 columns [T, ceil(K / 128)], or one static 0-d scale.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.core.quant import FP8_DTYPE, FP8_MAX, SCALE_EPS, Fp8Scheme
from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.pdl import wait_for_previous
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2

SCALE_BLOCK = 128  # the weight-scale block (128 x 128) and activation group (1 x 128) the kernels take
JIT_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)  # the same for jit code (which reads only constexpr globals)
_FP8_MAX = tl.constexpr(FP8_MAX)
_SCALE_EPS = tl.constexpr(SCALE_EPS)
_QUANTIZE_TILE = 2048  # elements a program of the quantization launch takes per step


@triton.jit
def round_to_e4m3(v):
    """fp32 `v` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32."""
    bits = v.to(tl.uint32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # |v| >= 2^-6 (normal e4m3): keep 3 of fp32's 23 fraction bits, the 20 dropped rounded to nearest even
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & 0xFFF00000
    # below (subnormal e4m3, multiples of 2^-9): 1.5 * 2^14 has an fp32 ulp of 2^-9, so the sum rounds there
    small = ((magnitude.to(tl.float32, bitcast=True) + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    return (tl.where(magnitude < 0x3C800000, small, normal) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def dynamic_scale(amax):
    """The scale of values whose largest magnitude is `amax`: amax / 448, at least SCALE_EPS."""
    return tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _SCALE_EPS)


@triton.jit
def quantize(x, scale):
    """fp32 `x` / `scale` clamped to the e4m3 range and rounded to e4m3 (as fp32 values)."""
    return round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX), _FP8_MAX))


@triton.jit
def row_scales(x_rows, row_ok, xs_ptr, K: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
               ACT: tl.constexpr):
    """[ROWS] scales of the rows of x (`x_rows`: their starts, unit K stride) before a pass over them: "token" from
    each row's amax over all of K (a pass over x in BK chunks), "static" the 0-d scale at xs_ptr, "group"
    placeholders (each chunk finds its own: `quantize_chunk`)."""
    scale = tl.zeros([ROWS], dtype=tl.float32)
    if ACT == "token":
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            k = k0 + tl.arange(0, BK)
            x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
            scale = tl.maximum(scale, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        scale = dynamic_scale(scale)
    if ACT == "static":
        scale += tl.load(xs_ptr)
    return scale


@triton.jit
def quantize_chunk(x, scale, ACT: tl.constexpr):
    """(e4m3 values of the fp32 chunk x [rows, lanes] as fp32, the rows' scales): by `row_scales`' scales, or with
    "group" (the chunk is one group) by the chunk's own."""
    if ACT == "group":
        scale = dynamic_scale(tl.max(tl.abs(x), axis=1))
    return quantize(x, scale[:, None]), scale


@triton.jit(do_not_specialize=["tokens"])
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, tokens, stride_x, K: tl.constexpr, ACT: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """ROWS rows of x -> e4m3 q [tokens, K] and their scales ("token": [tokens]; "group": [tokens, K / BLOCK],
    BLOCK being the group; "static": the scale at static_ptr, nothing stored)."""
    wait_for_previous(USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < tokens
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K
    scale = row_scales(x_rows, row_ok, static_ptr, K, ROWS, BLOCK, 1, ACT)
    if ACT == "token":
        tl.store(scale_ptr + rows, scale, mask=row_ok)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (k < K)[None, :]
        q, scale = quantize_chunk(tl.load(x_rows + k[None, :], mask=mask, other=0.0).to(tl.float32), scale, ACT)
        if ACT == "group":
            tl.store(scale_ptr + rows * ((K + BLOCK - 1) // BLOCK) + k0 // BLOCK, scale, mask=row_ok)
        tl.store(q_rows + k[None, :], q.to(tl.float8e4nv), mask=mask)


def check_scheme(scheme: Fp8Scheme, input_scale: torch.Tensor | None) -> None:
    """A clear error for a scheme the kernels do not take (blocks other than 128 x 128; static without a scale)."""
    if scheme.weight == "block" and scheme.block != (SCALE_BLOCK, SCALE_BLOCK):
        raise ValueError(f"the FP8 kernels take {SCALE_BLOCK}x{SCALE_BLOCK} weight-scale blocks; got {scheme.block}")
    if scheme.activation == "static" and (input_scale is None or input_scale.numel() != 1
                                          or input_scale.dtype != torch.float32):
        raise ValueError("the static FP8 activation scheme needs the checkpoint's input_scale (one fp32 value)")


def check_scales(weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme) -> None:
    """e4m3 `weight` [..., N, K] with contiguous fp32 scales per row [..., N] or per block [..., N/128, K/128]."""
    *lead, n, k = weight.shape
    want = (*lead, n) if scheme.weight != "block" else (*lead, cdiv(n, SCALE_BLOCK), cdiv(k, SCALE_BLOCK))
    if weight.dtype != FP8_DTYPE or not weight.is_contiguous():
        raise ValueError(f"FP8 kernels need a contiguous float8_e4m3fn weight; got {weight.dtype} "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    if tuple(scale.shape) != want or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"FP8 weight {tuple(weight.shape)} ({scheme.weight} scales) needs contiguous fp32 scales "
                         f"{want}; got {scale.dtype} {tuple(scale.shape)}")


def group_stride(scales: torch.Tensor) -> int:
    """The row stride of per-group activation scales [T, G] (0 for per-token or static ones: unread)."""
    return scales.stride(0) if scales.dim() == 2 else 0


def block_stride(scale: torch.Tensor, scheme: Fp8Scheme) -> int:
    """The stride between 128-row blocks of block weight scales [..., N/128, K/128] (0 for per-row: unread)."""
    return scale.stride(-2) if scheme.weight == "block" else 0


def constexprs(scheme: Fp8Scheme | None) -> dict:
    """The kernels' ACT (the activation scheme; '' for a 16-bit weight) and W_BLOCK (per-block weight scales)."""
    if scheme is None:
        return {"ACT": "", "W_BLOCK": False}
    return {"ACT": scheme.activation, "W_BLOCK": scheme.weight == "block"}


def quantize_activations(x: torch.Tensor, scheme: Fp8Scheme, input_scale: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K] contiguous, scales: [T] per token, [T, ceil(K/128)] per group, or
    the static 0-d `input_scale`): `ops.reference.fp8.quantize_activations` in one launch."""
    tokens, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(tokens, k, dtype=FP8_DTYPE, device=x.device)
    if scheme.activation == "static":
        scales = input_scale.reshape(())
    elif scheme.activation == "token":
        scales = torch.empty(tokens, dtype=torch.float32, device=x.device)
    else:
        scales = torch.empty(tokens, cdiv(k, SCALE_BLOCK), dtype=torch.float32, device=x.device)
    if tokens:
        block = SCALE_BLOCK if scheme.activation == "group" else min(1024, next_power_of_2(k))
        rows = max(1, _QUANTIZE_TILE // block)
        _quantize_kernel[(cdiv(tokens, rows),)](x, q, scales, scales, tokens, x.stride(0), K=k,
                                                 ACT=scheme.activation, ROWS=rows, BLOCK=block, num_warps=4,
                                                 **pdl.launch(x.device))
    return q, scales
