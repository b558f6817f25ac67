"""Lightning attention (Ling): the decayed linear recurrence over packed rows, states read and written by slot."""
from __future__ import annotations

import torch

from hybridserve.core.batch import ForwardBatch
from hybridserve.ops import backends
from hybridserve.ops.reference import lightning as reference


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                        state_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """q, k [T, H, d_k], v [T, H, d_v] -> o [T, H, d_v] fp32; `state_pool` [slots, H, d_k, d_v] fp32 by slot."""
    if backends.use_triton("lightning", q.device):
        from hybridserve.ops.triton import lightning as kernel
        return kernel.lightning_attention(q, k, v, log_decay, state_pool, batch)
    return reference.lightning_attention(q, k, v, log_decay, state_pool, batch)
