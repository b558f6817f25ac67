"""Lightning attention (Ling): the decayed linear recurrence over packed rows, states read and written by slot."""
from __future__ import annotations

import torch

from hybridserve.core.batch import ForwardBatch
from hybridserve.ops import backends
from hybridserve.ops.ling_norm import qk_norm_rope
from hybridserve.ops.reference import lightning as reference
from hybridserve.ops.reference.lightning import QKNormRope

__all__ = ["QKNormRope", "lightning_attention"]


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                        state_pool: torch.Tensor, batch: ForwardBatch,
                        norm_rope: QKNormRope | None = None) -> torch.Tensor:
    """q, k [T, H, d_k], v [T, H, d_v] -> o [T, H, d_v] fp32; `state_pool` [slots, H, d_k, d_v] fp32 by slot.

    With `norm_rope`, q and k are raw and get its per-head RMSNorm + RoPE first: on CUDA inside the decode kernel
    (one launch per decode step); otherwise through `ops.ling_norm.qk_norm_rope`, where the caller, holding q and
    k as one [T, 2, H, d] tensor, should call it itself (no stacking copy)."""
    if backends.use_triton("lightning", q.device):
        from hybridserve.ops.triton import lightning as kernel
        if batch.is_decode:
            return kernel.lightning_decode(q, k, v, log_decay, state_pool, batch, norm_rope=norm_rope)
        if norm_rope is not None:
            q, k = qk_norm_rope(torch.stack((q, k), dim=1), *norm_rope).unbind(1)
        return kernel.lightning_prefill(q, k, v, log_decay, state_pool, batch)
    return reference.lightning_attention(q, k, v, log_decay, state_pool, batch, norm_rope)
