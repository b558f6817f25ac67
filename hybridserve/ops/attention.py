"""Softmax attention over the paged KV cache (GQA, optional sliding window; MLA's absorbed form is one KV head)."""
from __future__ import annotations

import torch

from hybridserve.core.batch import ForwardBatch
from hybridserve.ops import backends
from hybridserve.ops.qk_cache import PendingQK
from hybridserve.ops.reference import attention as reference


def paged_attention(q: torch.Tensor | PendingQK, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: ForwardBatch, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_cache [rows, Hk, D]; v_cache [rows, Hk, Dv] (this step's K/V already written) -> [T, Hq, Dv].
    q may be ZAYA1's PendingQK (`takes_pending_qk`): its q/k normalisation and this step's K are then made in the
    kernel's launch (elsewhere in torch first)."""
    if isinstance(q, PendingQK) and not takes_pending_qk(batch, k_cache.device):
        q = q.finish()
    if backends.use_triton("attention", k_cache.device):
        from hybridserve.ops.triton import attention as kernel
        return kernel.paged_attention(q, k_cache, v_cache, batch, scale, sliding_window)
    return reference.paged_attention(q, k_cache, v_cache, batch, scale, sliding_window)


def takes_pending_qk(batch: ForwardBatch, device: torch.device) -> bool:
    """Whether `paged_attention` finishes a PendingQK of this step in the kernel's launch (host fields only): the
    producer (ops.conv.cca_conv_to_cache) should leave q/k pending only then."""
    if not backends.use_triton("attention", device):
        return False
    from hybridserve.ops.triton import attention as kernel
    return kernel.takes_pending_qk(batch)
