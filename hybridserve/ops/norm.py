"""The fp32 residual update fused with the RMSNorm after it (one pass over the row; the residual stays fp32).

    u = update (+ skip_weight * skip_input) (+ update_bias) (* update_scale)
    x = u + ((residual + residual_bias) * residual_scale)           (x = u without a residual)
    h = norm_weight * to_dtype(x / sqrt(mean(x^2) + eps))            (statistics in fp32; h in norm_weight's dtype)

ZAYA1's ResidualScaling is the full form (x_new = (u + b_h) * s_h + (x + b_r) * s_r, MOD's scaled-identity skip
term added to the routed update); a plain pre-norm residual add is the form without biases and scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.ops import backends
from hybridserve.ops.reference import norm as reference
from hybridserve.ops.residual_norm_args import ResidualNormArgs


def residual_rms_norm(update: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None, update_bias: torch.Tensor | None = None,
                      update_scale: torch.Tensor | None = None, residual_bias: torch.Tensor | None = None,
                      residual_scale: torch.Tensor | None = None, skip_weight: torch.Tensor | None = None,
                      skip_input: torch.Tensor | None = None, fp32_copy: bool = False):
    """update [T, H] (any float dtype), residual [T, H] fp32, vectors [H], skip_weight [T, 1] fp32 with
    skip_input [T, H] -> (x [T, H] fp32, h [T, H] in norm_weight's dtype, h as fp32 if `fp32_copy` else None)."""
    if (skip_weight is None) != (skip_input is None):
        raise ValueError("skip_weight and skip_input come together")
    args = (update, norm_weight, eps, residual, update_bias, update_scale, residual_bias, residual_scale,
            skip_weight, skip_input, fp32_copy)
    if backends.use_triton("norm", update.device):
        from hybridserve.ops.triton import norm as kernel
        return kernel.residual_rms_norm(*args)
    return reference.residual_rms_norm(*args)


class ResidualNorm(ResidualNormArgs):
    """A `residual_rms_norm` waiting for its update, handed to the projection that computes the update: a decode
    GEMV kernel applies it in its epilogue (its last program, once the whole row is written), saving the norm's own
    launch (`ops.linear.linear_residual_norm`, `ops.moe.fused_experts_residual_norm`); any other path calls it on
    the finished update. Either way the result is the same (the same kernel code on the same stored update: the
    same bits in 16-bit dtypes; fp32, whose update nothing rounds, may differ by where the compiler places FMAs)."""

    def __call__(self, update: torch.Tensor):
        """-> (x fp32, h, h as fp32 or None), as `residual_rms_norm` (h a tensor even where `h_pending` allows a
        PendingNorm)."""
        return residual_rms_norm(update, self.norm_weight, self.eps, self.residual, self.update_bias,
                                 self.update_scale, self.residual_bias, self.residual_scale, self.skip_weight,
                                 self.skip_input, self.fp32_copy)


@dataclass(frozen=True)
class PendingNorm:
    """The RMSNorm half of a `ResidualNorm` whose update is done (`h_pending`): x, the new fp32 residual, is stored,
    and each row's sum of squares as partial sums, one per program of the launch that made x. The projection that
    reads h finishes it in its own launch (`ops.linear.linear` takes it as its input), so the launch that made x ends
    without a last program's norm on a decode step's critical path; `h()` finishes it in torch for any other reader.
    The statistics and roundings are `residual_rms_norm`'s; only the sum's order differs."""
    x: torch.Tensor  # [T, H] fp32
    sum_squares: torch.Tensor  # [T, P] fp32: the partial sums of x^2 over H
    norm_weight: torch.Tensor  # [H]
    eps: float

    @property
    def shape(self) -> torch.Size:
        """h's shape."""
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        """h's dtype."""
        return self.norm_weight.dtype

    def h(self) -> torch.Tensor:
        """h = norm_weight * to_dtype(x / sqrt(mean(x^2) + eps)), in norm_weight's dtype."""
        rstd = torch.rsqrt(self.sum_squares.sum(-1, keepdim=True) / self.x.shape[-1] + self.eps)
        return self.norm_weight * (self.x * rstd).to(self.norm_weight.dtype)
