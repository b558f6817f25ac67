"""RMS normalisation, alone or fused with the residual update before it: the pure-torch reference."""
from __future__ import annotations

import torch


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, computed in fp32 and returned in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def residual_rms_norm(update: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None, update_bias: torch.Tensor | None = None,
                      update_scale: torch.Tensor | None = None, residual_bias: torch.Tensor | None = None,
                      residual_scale: torch.Tensor | None = None, skip_weight: torch.Tensor | None = None,
                      skip_input: torch.Tensor | None = None, fp32_copy: bool = False):
    u = update.float()
    if skip_weight is not None:
        u = u + skip_weight.float() * skip_input.float()
    if update_bias is not None:
        u = u + update_bias.float()
    if update_scale is not None:
        u = u * update_scale.float()
    x = u
    if residual is not None:
        r = residual.float()
        if residual_bias is not None:
            r = r + residual_bias.float()
        if residual_scale is not None:
            r = r * residual_scale.float()
        x = u + r
    normed = norm_weight * rms_normalize(x, eps).to(norm_weight.dtype)
    return x, normed, normed.float() if fp32_copy else None
