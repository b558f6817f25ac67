"""Ling's RMS-norm fusions in pure torch (the CPU path and the oracle of ops/triton/ling_norm.py): RMSNorm alone or
after the residual add (the stream in the model dtype), gated GroupRMSNorm, per-head QK RMSNorm + partial NeoX
RoPE, and MLA's latent norm + RoPE + cache write with its query's RoPE.

Statistics are always fp32. Where a fusion replaces separate modules, its roundings are stated (see each function).
"""
from __future__ import annotations

import torch

from hybridserve.ops.reference.norm import rms_normalize
from hybridserve.ops.reference.rotary import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) [T, C] in weight's dtype: normalised in fp32, rounded to x's dtype, then to the weight's, then
    multiplied by the weight (the `RMSNorm` module's roundings)."""
    return weight * rms_normalize(x, eps).to(weight.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 addend: torch.Tensor | None = None,
                 fp32_copy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(x (+ addend) + residual), x (+ addend) + residual, the normed value as fp32 if `fp32_copy`): a
    block's residual add fused with the next norm; `addend` is a second part of the block's output (Ling's shared
    expert beside the routed ones). x [T, C], or [T, P, C] rows summed first (the routed experts' unreduced
    output: summed in fp32, rounded once to x's dtype, as `x.sum(1)`).

    `x + addend` is rounded to x's dtype first, the sum with the residual to the residual stream's dtype, the
    normalised value to that dtype too, then multiplied by the weight in the weight's dtype: exactly
    `h = (x + addend) + residual; RMSNorm(h)` as separate modules compute it. The fp32 copy is that result, exact.
    """
    if x.dim() == 3:
        x = x.sum(1)
    if addend is not None:
        x = x + addend
    residual = x + residual
    out = rms_norm(residual, weight, eps)
    return out, residual, out.float() if fp32_copy else None


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


def mla_latent_rope(kv_a: torch.Tensor, norm_weight: torch.Tensor, q_rope: torch.Tensor, q_out: torch.Tensor,
                    positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool, eps: float,
                    slot_mapping: torch.Tensor, latent_cache: torch.Tensor) -> None:
    """MLA's per-token latent and query rope: the cache rows at `slot_mapping` get [RMSNorm(c_kv) | rope(k_rope)]
    from kv_a [T, rank + rope] = [c_kv | k_rope], and q_out [T, H, rope] gets rope(q_rope) (q_out may be q_rope
    itself). The norm's roundings are `rms_norm`'s, the rotation's `apply_rotary`'s (fp32, rounded once)."""
    rank = norm_weight.shape[0]
    c_kv = rms_norm(kv_a[:, :rank], norm_weight, eps)
    k_rope = apply_rotary(positions, kv_a[:, None, rank:], inv_freq, interleaved)
    latent_cache[slot_mapping] = torch.cat([c_kv[:, None, :], k_rope], dim=-1)
    q_out.copy_(apply_rotary(positions, q_rope, inv_freq, interleaved))
