"""ZAYA1's CCA convolution (two causal convs over time on the raw q|k, plus head-mix residuals) and value lag,
over packed rows, with the carried window and lag read and written in the state pool by slot; and the same
followed by the q/k normalisation, RoPE and the K/V cache write (reference: ops/reference/zaya_qk.py) as one op,
which the kernel runs in the conv's own launch (its epilogue)."""
from __future__ import annotations

import torch

from hybridserve.core.batch import ForwardBatch
from hybridserve.ops import backends
from hybridserve.ops.qk_cache import QKCache
from hybridserve.ops.reference import conv as reference
from hybridserve.ops.reference import zaya_qk


def cca_conv(proj: torch.Tensor, weight0: torch.Tensor, bias0: torch.Tensor, weight1: torch.Tensor,
             bias1: torch.Tensor, lag_bias: torch.Tensor | None, q_heads: int, kv_head_offset: int,
             batch: ForwardBatch, conv_state: torch.Tensor, lag_state: torch.Tensor,
             conv_footer: torch.Tensor | None = None, lag_footer: torch.Tensor | None = None):
    """proj [T, C + 2 * Vh] = [q | k | v_current | v_delayed]; weight0 [C, 1, K0], bias0 [C]; weight1 [C, D, K1],
    bias1 [C]; lag_bias [Vh] (v_delayed's bias) or None; conv_state [slots, C, P] and lag_state [slots, Vh] by
    `batch.state_slots`, updated in place; footers [pages, ...] by page, when given.

    -> query [T, Hq, D], key [T, Hk, D] (fp32 from the kernel, proj's dtype from the reference) and value
    [T, Hk, D] in proj's dtype: this rank's KV heads, the first at `kv_head_offset` of all KV heads.
    """
    args = (proj, weight0, bias0, weight1, bias1, lag_bias, q_heads, kv_head_offset, batch, conv_state, lag_state,
            conv_footer, lag_footer)
    if backends.use_triton("conv", proj.device):
        from hybridserve.ops.triton import conv as kernel
        return kernel.cca_conv(*args)
    return reference.cca_conv(*args)


def cca_conv_to_cache(proj: torch.Tensor, weight0: torch.Tensor, bias0: torch.Tensor, weight1: torch.Tensor,
                      bias1: torch.Tensor, lag_bias: torch.Tensor | None, q_heads: int, kv_head_offset: int,
                      batch: ForwardBatch, conv_state: torch.Tensor, lag_state: torch.Tensor,
                      conv_footer: torch.Tensor | None, lag_footer: torch.Tensor | None,
                      cache: QKCache) -> torch.Tensor:
    """cca_conv, then qk_norm_rope_cache of its q, k, v at `batch.positions` (K and V into `cache`'s caches)
    -> q normalised and rotated, [T, Hq, D] in `cache.out_dtype`."""
    args = (proj, weight0, bias0, weight1, bias1, lag_bias, q_heads, kv_head_offset, batch, conv_state, lag_state,
            conv_footer, lag_footer)
    if backends.use_triton("conv", proj.device):
        from hybridserve.ops.triton import conv as kernel
        return kernel.cca_conv(*args, to_cache=cache)
    q, k, v = reference.cca_conv(*args)
    return zaya_qk.qk_norm_rope_cache(q, k, v, cache.temp, cache.inv_freq, batch.positions, cache.slot_mapping,
                                      cache.k_cache, cache.v_cache, cache.out_dtype)
