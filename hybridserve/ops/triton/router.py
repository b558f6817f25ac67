"""Ling's grouped sigmoid router in one launch: fp32 logits [T, E] -> (top-k expert ids, weights).

One program per token holds its E scores as a [groups, group size] tile (padded to powers of two with -inf).
Every "pick the best" is a max followed by the minimum index attaining it, so the lower group / expert index wins
ties, exactly as the reference's stable sort (`ops.reference.router`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.pdl import wait_for_previous
from hybridserve.ops.triton.sizes import next_power_of_2


@triton.jit
def _grouped_topk_kernel(logits, bias, ids_out, weights_out, logits_stride, scaling,
                         HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, G_P2: tl.constexpr, S_P2: tl.constexpr,
                         K_P2: tl.constexpr, USE_PDL: tl.constexpr):
    group = tl.arange(0, G_P2)
    member = tl.arange(0, S_P2)
    valid = (group[:, None] < N_GROUP) & (member[None, :] < GROUP_SIZE)
    expert = group[:, None] * GROUP_SIZE + member[None, :]  # padded lanes alias real ids: mask with `valid`
    if HAS_BIAS:  # a weight: before the wait
        balancing = tl.load(bias + expert, mask=valid, other=0.0)
    wait_for_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    scores = tl.sigmoid(tl.load(logits + token * logits_stride + expert, mask=valid, other=0.0))
    choice = scores
    if HAS_BIAS:
        choice = scores + balancing
    choice = tl.where(valid, choice, float("-inf"))

    # A group's score: its best value plus the best of the rest (the top-2 sum).
    best = tl.max(choice, axis=1)
    first = tl.min(tl.where(choice == best[:, None], member[None, :], S_P2), axis=1)
    second = tl.max(tl.where(member[None, :] == first[:, None], float("-inf"), choice), axis=1)
    group_score = best + second

    open_group = group < N_GROUP
    kept = group < 0
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.max(tl.where(open_group, group_score, float("-inf")), axis=0)
        pick = tl.min(tl.where(open_group & (group_score == top), group, G_P2), axis=0)
        kept = kept | (group == pick)
        open_group = open_group & (group != pick)

    candidate = valid & kept[:, None]
    slot = tl.arange(0, K_P2)
    ids = tl.zeros([K_P2], dtype=tl.int32)
    weights = tl.zeros([K_P2], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        top = tl.max(tl.max(tl.where(candidate, choice, float("-inf")), axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(candidate & (choice == top), expert, N_GROUP * GROUP_SIZE), axis=1), axis=0)
        weight = tl.sum(tl.sum(tl.where(valid & (expert == pick), scores, 0.0), axis=1), axis=0)
        ids = tl.where(slot == k, pick, ids)
        weights = tl.where(slot == k, weight, weights)
        candidate = candidate & (expert != pick)

    weights = weights / (tl.sum(weights, axis=0) + 1e-20) * scaling
    tl.store(ids_out + token * TOP_K + slot, ids.to(tl.int64), mask=slot < TOP_K)
    tl.store(weights_out + token * TOP_K + slot, weights, mask=slot < TOP_K)


def grouped_topk(logits: torch.Tensor, expert_bias: torch.Tensor | None, n_group: int, topk_group: int, top_k: int,
                 routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [T, E] -> (expert ids [T, top_k] int64, weights [T, top_k] fp32); see `ops.router`."""
    tokens, experts = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    if tokens == 0:
        return ids, weights
    group_size = experts // n_group
    bias = expert_bias.contiguous() if expert_bias is not None else logits  # unread without a bias
    _grouped_topk_kernel[(tokens,)](
        logits, bias, ids, weights, logits.stride(0), float(routed_scaling_factor),
        HAS_BIAS=expert_bias is not None, N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group,
        TOP_K=top_k, G_P2=next_power_of_2(n_group), S_P2=next_power_of_2(group_size),
        K_P2=next_power_of_2(top_k), num_warps=1 if experts <= 512 else 4, **pdl.launch(logits.device))
    return ids, weights
