"""Router logits and biases whose comparisons no sigmoid rounding can flip, while exact ties stay frequent.

Two sigmoid implementations (torch's, Triton's) differ in the last bits, so every comparison the grouped top-k makes
must be either an exact tie of the same fp32 values (both sides then pick the lower index) or apart by far more
than those bits. Single scores sigmoid(x) + b and group scores (the sum of a group's two best) are compared.
Logits are multiples of 1/4 in [0, 4] and an expert's bias is (its group // 2) / 3, so groups 2k and 2k + 1 tie
exactly when their best pairs hold the same logits. Negative logits are left out because sigmoid(x) + sigmoid(-x)
= 1 makes pairs of different logits tie in real arithmetic and not in fp32 (and 1/16-steps and per-expert biases
make sums of different values meet within 1e-16); `test_router_grid_keeps_comparisons_apart` measures the gaps.
"""
from __future__ import annotations

import torch

LOGIT_STEPS = 17  # logits k / 4, k in [0, 17)


def grid_logits(tokens: int, experts: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, LOGIT_STEPS, (tokens, experts), generator=gen) / 4.0).to(device)


def grid_bias(experts: int, n_group: int, device: torch.device) -> torch.Tensor:
    group = torch.arange(experts) // -(-experts // n_group)
    return ((group // 2) / 3.0).to(device)
