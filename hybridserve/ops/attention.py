"""Softmax attention over the paged KV cache (GQA, optional sliding window; MLA's absorbed form is one KV head)."""
from __future__ import annotations

import torch

from hybridserve.core.batch import ForwardBatch
from hybridserve.ops import backends
from hybridserve.ops.reference import attention as reference


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_cache [rows, Hk, D]; v_cache [rows, Hk, Dv] (this step's K/V already written) -> [T, Hq, Dv]."""
    if backends.use_triton("attention", q.device):
        from hybridserve.ops.triton import attention as kernel
        return kernel.paged_attention(q, k_cache, v_cache, batch, scale, sliding_window)
    return reference.paged_attention(q, k_cache, v_cache, batch, scale, sliding_window)
