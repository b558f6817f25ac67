"""QKCache: where ZAYA1's fused CCA conv puts its q/k normalisation's outputs (ops.conv.cca_conv_to_cache). The
model builds it and both the op and its kernel read it, so it lives beside them rather than in the reference."""
from __future__ import annotations

from typing import NamedTuple

import torch


class QKCache(NamedTuple):
    """qk_norm_rope_cache's arguments besides q, k, v and the positions (ops/reference/zaya_qk.py)."""
    temp: torch.Tensor  # [Hk]
    inv_freq: torch.Tensor  # [rotary_dim / 2] fp32
    slot_mapping: torch.Tensor  # [T] K/V cache rows
    k_cache: torch.Tensor  # [rows, Hk, D]
    v_cache: torch.Tensor  # [rows, Hk, D]
    out_dtype: torch.dtype  # q's
