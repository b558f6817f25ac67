"""QKCache: where ZAYA1's fused CCA conv puts its q/k normalisation's outputs (ops.conv.cca_conv_to_cache); PendingQK:
that normalisation left to the attention that reads q (ops.attention.paged_attention). The model builds them and the
ops and their kernels read them, so they live beside them rather than in the reference."""
from __future__ import annotations

from typing import NamedTuple

import torch

from hybridserve.ops.reference import zaya_qk


class QKCache(NamedTuple):
    """qk_norm_rope_cache's arguments besides q, k, v and the positions (ops/reference/zaya_qk.py)."""
    temp: torch.Tensor  # [Hk]
    inv_freq: torch.Tensor  # [rotary_dim / 2] fp32
    slot_mapping: torch.Tensor  # [T] K/V cache rows
    k_cache: torch.Tensor  # [rows, Hk, D]
    v_cache: torch.Tensor  # [rows, Hk, D]
    out_dtype: torch.dtype  # q's


class PendingQK(NamedTuple):
    """The conv's raw q|k rows with their q/k normalisation, RoPE and K cache write still to do: the decode attention
    kernel does them in its own launch (the conv's launch then ends without its last programs' read-back and
    normalisation); `ops.attention` finishes them in torch first for any other path. V is in the cache already."""
    qk: torch.Tensor  # [T, Hq + Hk, D] fp32: the raw q heads, then the k heads
    q_heads: int
    positions: torch.Tensor  # [T]
    cache: QKCache

    def finish(self) -> torch.Tensor:
        """In torch (ops/reference/zaya_qk.py): K into its cache; -> q normalised and rotated."""
        cache = self.cache
        return zaya_qk.qk_norm_rope_k_cache(self.qk[:, :self.q_heads], self.qk[:, self.q_heads:], cache.temp,
                                            cache.inv_freq, self.positions, cache.slot_mapping, cache.k_cache,
                                            cache.out_dtype)
