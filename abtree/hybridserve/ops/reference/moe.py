"""Routed-expert computation (SwiGLU experts, weighted sum over each token's chosen experts).

Three pure-torch formulations with identical results:
- `sorted`: tokens grouped by expert with host-side counts. Exact and cheapest on CPU, where reading sizes back
  costs nothing.
- `gathered`: each (token, choice) gathers its expert's weights. Sync-free; bandwidth-optimal when there are fewer
  assignments than experts (small-batch decode on GPU).
- `dense`: every expert runs on every token, weighted by a 0/weight mask. Sync-free; used on GPU otherwise.
On CUDA the Triton fused-MoE kernel (`ops.triton.moe`) replaces them; these stay as its reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def experts_sorted(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # host sizes: CPU only
    token_of = order // topk_ids.shape[1]
    weights = topk_weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count:
            tokens = token_of[start:start + count]
            y = _swiglu(x[tokens], w13[expert], w2[expert]) * weights[start:start + count, None].to(x.dtype)
            out.index_add_(0, tokens, y)
        start += count
    return out


def experts_gathered(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor) -> torch.Tensor:
    tokens, k = topk_ids.shape
    xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [T*K, H, 1]
    gate, up = torch.bmm(w13[topk_ids.flatten()], xs).squeeze(-1).chunk(2, dim=-1)
    y = torch.bmm(w2[topk_ids.flatten()], (F.silu(gate) * up)[:, :, None]).squeeze(-1)
    y = y * topk_weights.flatten()[:, None].to(x.dtype)
    return y.view(tokens, k, -1).sum(dim=1)


def experts_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        weight = (topk_weights * (topk_ids == expert)).sum(dim=-1, keepdim=True).to(x.dtype)
        out += _swiglu(x, w13[expert], w2[expert]) * weight
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows first); w2 [E, H, I]; topk_ids/weights [T, K] -> [T, H]."""
    if x.device.type == "cpu":
        return experts_sorted(x, w13, w2, topk_ids, topk_weights)
    if topk_ids.numel() < w13.shape[0]:
        return experts_gathered(x, w13, w2, topk_ids, topk_weights)
    return experts_dense(x, w13, w2, topk_ids, topk_weights)
