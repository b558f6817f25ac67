"""Ling's RMS-norm fusions: residual add + RMSNorm (the stream in the model dtype), gated GroupRMSNorm, per-head
QK RMSNorm + partial NeoX RoPE. Backend op "ling_norm"."""
from __future__ import annotations

import torch

from hybridserve.ops import backends
from hybridserve.ops.reference import ling_norm as reference


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, C] -> (RMSNorm(x + residual) in weight's dtype, x + residual)."""
    if backends.use_triton("ling_norm", x.device):
        from hybridserve.ops.triton import ling_norm as kernel
        return kernel.add_rms_norm(x, residual, weight, eps)
    return reference.add_rms_norm(x, residual, weight, eps)


def group_rms_norm(x: torch.Tensor, weight: torch.Tensor, num_groups: int, eps: float,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] normalised per channel group, times weight [C], then (optionally) times sigmoid(gate [T, C])."""
    if backends.use_triton("ling_norm", x.device):
        from hybridserve.ops.triton import ling_norm as kernel
        return kernel.group_rms_norm(x, weight, num_groups, eps, gate)
    return reference.group_rms_norm(x, weight, num_groups, eps, gate)


def qk_norm_rope(qk: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> torch.Tensor:
    """qk [T, 2, H, d] (q heads, k heads) -> per-head RMSNorm + RoPE of the first 2*len(inv_freq) channels."""
    if backends.use_triton("ling_norm", qk.device):
        from hybridserve.ops.triton import ling_norm as kernel
        return kernel.qk_norm_rope(qk, q_weight, k_weight, positions, inv_freq, eps)
    return reference.qk_norm_rope(qk, q_weight, k_weight, positions, inv_freq, eps)
