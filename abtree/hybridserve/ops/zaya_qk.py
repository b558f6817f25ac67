"""ZAYA1's QKNorm (fp32 L2 to norm sqrt(D), key temperature per KV head) + partial NeoX RoPE (fp32) + the K/V
cache write through the slot mapping, in one pass (reference: ops/reference/zaya_qk.py)."""
from __future__ import annotations

import torch

from hybridserve.ops import backends
from hybridserve.ops.reference import zaya_qk as reference


def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, temp: torch.Tensor,
                       inv_freq: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hk, D] (any float dtype, any strides); temp [Hk]; inv_freq [rotary_dim / 2] fp32;
    k_cache, v_cache [rows, Hk, D] written at rows `slot_mapping` [T] -> q normalised and rotated, [T, Hq, D] in
    `out_dtype`."""
    args = (q, k, v, temp, inv_freq, positions, slot_mapping, k_cache, v_cache, out_dtype)
    if backends.use_triton("zaya_qk", q.device):
        from hybridserve.ops.triton import zaya_qk as kernel
        return kernel.qk_norm_rope_cache(*args)
    return reference.qk_norm_rope_cache(*args)
