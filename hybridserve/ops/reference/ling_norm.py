"""Ling's RMS-norm fusions in pure torch (the CPU path and the oracle of ops/triton/ling_norm.py): residual add +
RMSNorm with the stream in the model dtype, gated GroupRMSNorm, per-head QK RMSNorm + partial NeoX RoPE.

Statistics are always fp32. Where a fusion replaces separate modules, its roundings are stated (see each function).
"""
from __future__ import annotations

import torch

from hybridserve.ops.reference.norm import rms_normalize
from hybridserve.ops.reference.rotary import apply_rotary


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual): a block's residual add fused with the next norm.

    The sum is rounded to the residual stream's dtype, the normalised value to that dtype too, then multiplied by
    the weight in the weight's dtype: exactly `h = x + residual; RMSNorm(h)` as separate modules compute it.
    """
    residual = x + residual
    return weight * rms_normalize(residual, eps).to(weight.dtype), residual


def group_rms_norm(x: torch.Tensor, weight: torch.Tensor, num_groups: int, eps: float,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """RMS statistics over each of `num_groups` contiguous channel groups of x [T, C], times weight [C], and with
    `gate` [T, C] times sigmoid(gate) (Ling's lightning output: norm first, gate second).

    All in fp32, rounded once: to the gate's dtype when gated, else to the promoted dtype of x and weight.
    """
    out = weight.float() * rms_normalize(x.float().unflatten(-1, (num_groups, -1)), eps).flatten(-2)
    if gate is None:
        return out.to(torch.promote_types(x.dtype, weight.dtype))
    return (out * torch.sigmoid(gate.float())).to(gate.dtype)


def qk_norm_rope(qk: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm (weights None: none) then partial NeoX RoPE of q and k, qk [T, 2, H, d] -> [T, 2, H, d].

    All in fp32, rounded once to qk's dtype; the rotary angles are those of `apply_rotary`.
    """
    x = qk.float()
    if q_weight is not None:
        weight = torch.stack((q_weight, k_weight)).float()[:, None, :]  # [2, 1, d]
        x = weight * rms_normalize(x, eps)
    return apply_rotary(positions, x.flatten(1, 2), inv_freq).view(qk.shape).to(qk.dtype)
