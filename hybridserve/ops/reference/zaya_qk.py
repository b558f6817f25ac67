"""ZAYA1's q/k normalisation, partial NeoX RoPE and KV-cache write: the pure-torch reference.

q and k are scaled to norm sqrt(D) in fp32 (the norm clamped at fp32 eps), k times its KV head's learned
temperature, then the leading rotary dims are rotated at each token's position (fp32) and the results rounded to
the model dtype; K and the (raw) V go to the paged cache rows of `slot_mapping`.
"""
from __future__ import annotations

import math

import torch

from hybridserve.ops.reference.rotary import apply_rotary


def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, temp: torch.Tensor,
                       inv_freq: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    eps = torch.finfo(torch.float32).eps
    scale = math.sqrt(q.shape[-1])
    q, k = q.float(), k.float()
    q = q * (scale / q.norm(dim=-1, keepdim=True).clamp_min(eps))
    k = k * (scale / k.norm(dim=-1, keepdim=True).clamp_min(eps))
    k = k * temp.float()[None, :, None]
    k_cache[slot_mapping] = apply_rotary(positions, k, inv_freq).to(out_dtype)
    v_cache[slot_mapping] = v
    return apply_rotary(positions, q, inv_freq).to(out_dtype)
