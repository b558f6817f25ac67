"""Dense linear layers (the 16-bit projections of layers/linear.py, Ling-2.6's fp32 router logits): x @ W^T (+ bias).
Backend op "linear".

On CUDA, decode-sized inputs (at most `ops.triton.linear.FASTER_UP_TO_TOKENS` rows) of 16-bit or fp32 weights up
to `FASTER_UP_TO_WEIGHT_BYTES` run the GEMV kernel, where it beats cuBLAS (measured for 16-bit weights; fp32 is
Ling-2.6's router logits, which cuBLAS ran in 7.7 us a layer outside the PDL chain, not yet timed in the kernel);
everything else, and the reference the kernel is tested against, is torch's F.linear (cuBLAS on CUDA).
`linear_residual_norm` hands the GEMV kernel the residual norm that follows the projection, so that it runs in the
same launch; `linear` of an `ops.norm.PendingNorm` (the norm before the projection, left by the launch that made its
input) finishes that norm in the GEMV kernel's launch (`takes_pending`).

FP8 weights (`fp8` given: e4m3 weight, its scales and scheme) run as `ops.reference.fp8.fp8_linear` defines
(backend op "fp8_linear"): weight-only up to `core.quant.WEIGHT_ONLY_MAX_ROWS` rows, W8A8 beyond. On CUDA
`ops.triton.fp8_linear` (the weight-only GEMV kernel for the fewest rows, with a residual norm in its launch as for
16-bit weights; a weight-only tl.dot GEMM for the other decode sizes; a quantization launch and an FP8 GEMM beyond),
elsewhere that reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.core.quant import Fp8Scales, linear_weight_only
from hybridserve.ops import backends
from hybridserve.ops.norm import PendingNorm, ResidualNorm
from hybridserve.ops.reference import fp8 as fp8_reference


def _gemv_runs(rows: int, weight: torch.Tensor, fp8: Fp8Scales | None = None) -> bool:
    """Whether the GEMV kernel runs a product of `rows` decode-sized rows with this weight: a 16-bit or fp32 weight
    it streams faster than cuBLAS, or an e4m3 one of at most `E4M3_GEMV_MAX_TOKENS` rows (host sizes only)."""
    if fp8 is not None:
        if not backends.use_triton("fp8_linear", weight.device):
            return False
        from hybridserve.ops.triton import linear as kernel
        return rows <= kernel.E4M3_GEMV_MAX_TOKENS
    if (weight.dtype not in (torch.float16, torch.bfloat16, torch.float32)
            or not backends.use_triton("linear", weight.device)):
        return False
    from hybridserve.ops.triton import linear as kernel
    return rows <= kernel.FASTER_UP_TO_TOKENS and weight.is_contiguous() \
        and weight.numel() * weight.element_size() <= kernel.FASTER_UP_TO_WEIGHT_BYTES


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def _takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the GEMV kernel runs this 16-bit or fp32 product (`_gemv_runs`, x of the weight's dtype)."""
    return x.dtype == weight.dtype and x.stride(-1) == 1 and _gemv_runs(_rows(x), weight)


def linear(x: torch.Tensor | PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fp8: Fp8Scales | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] (`fp8`: the e4m3 weight's scales and scheme). x may
    be a PendingNorm: the product of its h, made in the GEMV kernel's launch where `takes_pending` (else in torch
    first)."""
    if isinstance(x, PendingNorm):
        if takes_pending(x.shape[0], weight, fp8) and (fp8 is not None or x.norm_weight.dtype == weight.dtype):
            from hybridserve.ops.triton import linear as kernel
            return kernel.linear(x, weight, bias, fp8=fp8)
        x = x.h()
    if fp8 is not None:
        return _fp8_linear(x, weight, bias, fp8)
    if _takes_gemv(x, weight):
        from hybridserve.ops.triton import linear as kernel
        return kernel.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def takes_pending(tokens: int, weight: torch.Tensor, fp8: Fp8Scales | None = None) -> bool:
    """Whether `linear` of a PendingNorm of `tokens` rows finishes its norm in the GEMV kernel's launch (where that
    kernel runs the product): a producer should leave h pending only then. Host-known sizes only."""
    return 0 < tokens and weight.dim() == 2 and weight.is_contiguous() and _gemv_runs(tokens, weight, fp8)


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: Fp8Scales) -> torch.Tensor:
    if backends.use_triton("fp8_linear", x.device):
        from hybridserve.ops.triton import fp8_linear as kernel
        return kernel.fp8_linear(x, weight, fp8.scale, fp8.scheme, bias, fp8.input_scale)
    return fp8_reference.fp8_linear(x, weight, fp8.scale, fp8.scheme, bias, fp8.input_scale, linear_weight_only(x))


def _fp8_takes_gemv(x: torch.Tensor, weight: torch.Tensor, fp8: Fp8Scales) -> bool:
    """Whether the GEMV kernel runs this FP8 product (on CUDA, decode-sized x of unit last stride)."""
    return x.stride(-1) == 1 and _gemv_runs(_rows(x), weight, fp8)


def linear_residual_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: ResidualNorm,
                         fp8: Fp8Scales | None = None):
    """`norm`(linear(x, weight, bias)) for x [T, K]: in the GEMV kernel's launch where that kernel runs.
    -> `norm`'s (x, h, h32)."""
    if x.dim() == 2 and (_takes_gemv(x, weight) if fp8 is None else _fp8_takes_gemv(x, weight, fp8)):
        from hybridserve.ops.triton import linear as kernel
        return kernel.linear(x, weight, bias, norm=norm, fp8=fp8)
    return norm(linear(x, weight, bias, fp8))
