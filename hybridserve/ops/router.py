"""Ling's group-limited top-k router on fp32 logits: the Triton kernel on CUDA, the torch reference elsewhere."""
from __future__ import annotations

import torch

from hybridserve.ops import backends
from hybridserve.ops.reference import router as reference


def _check(logits: torch.Tensor, expert_bias: torch.Tensor | None, n_group: int, topk_group: int,
           top_k: int) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"router logits must be fp32 [T, E]; got {logits.dtype} {tuple(logits.shape)}")
    experts = logits.shape[1]
    if n_group < 1 or experts % n_group or experts // n_group < 2:
        raise ValueError(f"{experts} experts must split into n_group={n_group} groups of at least 2 "
                         "(a group's score is its top-2 sum)")
    if not 0 < topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if not 0 < top_k <= topk_group * (experts // n_group):
        raise ValueError(f"top_k={top_k} must be in [1, experts in the {topk_group} kept groups]")
    if expert_bias is not None and (expert_bias.shape != (experts,) or expert_bias.dtype != torch.float32):
        raise ValueError(f"expert_bias must be fp32 [{experts}]; got {expert_bias.dtype} "
                         f"{tuple(expert_bias.shape)}")


def grouped_topk(logits: torch.Tensor, expert_bias: torch.Tensor | None, n_group: int, topk_group: int, top_k: int,
                 routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [T, E] -> (expert ids [T, top_k] int64, fp32 weights [T, top_k]); lower index wins ties."""
    _check(logits, expert_bias, n_group, topk_group, top_k)
    if backends.use_triton("router", logits.device):
        from hybridserve.ops.triton import router as kernel
        return kernel.grouped_topk(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor)
    return reference.grouped_topk(logits, expert_bias, n_group, topk_group, top_k, routed_scaling_factor)
