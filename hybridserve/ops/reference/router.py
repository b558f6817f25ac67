"""Ling's grouped sigmoid router after the logits GEMM, in pure torch.

Scores are fp32 sigmoids; `expert_bias` is added for the selection only. The experts are split into `n_group`
equal groups, a group's score is the sum of its two best biased scores, the best `topk_group` groups are kept and
the `top_k` best experts among them chosen. The weights are the chosen experts' unbiased scores, renormalised to
sum 1 and multiplied by `routed_scaling_factor`.

Ties are broken explicitly, identically here and in the Triton kernel (`ops.triton.router`): among equal scores
the lower group / expert index wins (a stable descending sort).
"""
from __future__ import annotations

import torch


def _best(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, lower index first among equals."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def grouped_topk(logits: torch.Tensor, expert_bias: torch.Tensor | None, n_group: int, topk_group: int, top_k: int,
                 routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [T, E] -> (expert ids [T, top_k] int64, weights [T, top_k] fp32)."""
    scores = torch.sigmoid(logits)
    choice = scores if expert_bias is None else scores + expert_bias
    grouped = choice.view(logits.shape[0], n_group, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # the values, whatever the tie order
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, _best(group_scores, topk_group), True)
    ids = _best(grouped.masked_fill(~keep[:, :, None], float("-inf")).flatten(1), top_k)
    weights = scores.gather(1, ids)
    return ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * routed_scaling_factor
