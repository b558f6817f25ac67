"""Ling's RMS-norm fusions: RMSNorm alone or after the residual add (the stream in the model dtype), gated
GroupRMSNorm, per-head QK RMSNorm + partial NeoX RoPE, MLA's latent norm + RoPE + cache write with its query's
RoPE. Backend op "ling_norm"."""
from __future__ import annotations

import torch

from hybridserve.ops import backends
from hybridserve.ops.reference import ling_norm as reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, C] (rows may be strided) -> RMSNorm(x) in weight's dtype."""
    if backends.use_triton("ling_norm", x.device):
        from hybridserve.ops.triton import ling_norm as kernel
        return kernel.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 addend: torch.Tensor | None = None,
                 fp32_copy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [T, C] or [T, P, C] (parts summed first), residual (, addend) [T, C] -> (RMSNorm(x (+ addend) + residual)
    in weight's dtype, x (+ addend) + residual, that norm as fp32 when `fp32_copy`, else None)."""
    if x.dim() not in (2, 3) or residual.shape != (x.shape[0], x.shape[-1]):
        raise ValueError(f"x {tuple(x.shape)} must be [T, C] or [T, P, C], residual {tuple(residual.shape)} [T, C]")
    if addend is not None and (addend.shape != residual.shape or addend.dtype != x.dtype):
        raise ValueError(f"addend {addend.dtype} {tuple(addend.shape)} does not match x {x.dtype} {tuple(x.shape)}")
    args = (x, residual, weight, eps, addend, fp32_copy)
    if backends.use_triton("ling_norm", x.device):
        from hybridserve.ops.triton import ling_norm as kernel
        return kernel.add_rms_norm(*args)
    return reference.add_rms_norm(*args)


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


def mla_latent_rope(kv_a: torch.Tensor, norm_weight: torch.Tensor, q_rope: torch.Tensor, q_out: torch.Tensor,
                    positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool, eps: float,
                    slot_mapping: torch.Tensor, latent_cache: torch.Tensor) -> None:
    """kv_a [T, rank + rope] = [c_kv | k_rope]; q_rope, q_out [T, H, rope] (strided views; q_out may be q_rope):
    writes latent_cache [rows, 1, rank + rope] at rows `slot_mapping` with [RMSNorm(c_kv) | RoPE(k_rope)] and
    q_out with RoPE(q_rope), NeoX or (`interleaved`) GPT-J pairs."""
    args = (kv_a, norm_weight, q_rope, q_out, positions, inv_freq, interleaved, eps, slot_mapping, latent_cache)
    if backends.use_triton("ling_norm", kv_a.device):
        from hybridserve.ops.triton import ling_norm as kernel
        return kernel.mla_latent_rope(*args)
    return reference.mla_latent_rope(*args)
