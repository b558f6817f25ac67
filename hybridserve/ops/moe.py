"""Routed SwiGLU experts: each token's weighted sum over its chosen experts."""
from __future__ import annotations

import torch

from hybridserve.ops import backends
from hybridserve.ops.reference import moe as reference


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows first); w2 [E, H, I]; topk_ids/weights [T, K] -> [T, H] in x's dtype."""
    if backends.use_triton("moe", x.device):
        from hybridserve.ops.triton import moe as kernel
        return kernel.fused_experts(x, w13, w2, topk_ids, topk_weights)
    return reference.fused_experts(x, w13, w2, topk_ids, topk_weights)
