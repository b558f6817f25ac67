"""Ling router kernel (`ops.triton.router`) vs the torch reference (`ops.reference.router`), ties included.

The logits and biases of `tests/ops/router_grid.py` tie exactly often (both sides must then pick the lower index),
while scores that differ, and group scores (sums of two) that differ, are apart by far more than the last-bit
differences of two sigmoid implementations: the ids must match exactly. Weights: 1e-6 relative (a few fp32 ulps
from the sigmoid and the order of the 8-term sum).
"""
from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import DEVICE
from tests.ops.router_grid import LOGIT_STEPS, grid_bias, grid_logits
from hybridserve.ops import router as entry
from hybridserve.ops.reference import router as reference
from hybridserve.ops.triton import router as kernel


def test_router_grid_keeps_comparisons_apart() -> None:
    """In float64: distinct single scores and distinct group scores (pair sums plus twice a group bias) of the
    grid differ by more than 1e-4, some 1,000 fp32 ulps of a score near 1."""
    scores = torch.sigmoid(torch.arange(LOGIT_STEPS, dtype=torch.float64) / 4.0)
    levels = grid_bias(8, 8, torch.device("cpu")).to(torch.float64).unique()
    singles = (scores[:, None] + levels[None, :]).flatten()
    pairs = (scores[:, None] + scores[None, :]).flatten().unique()
    groups = (pairs[:, None] + 2 * levels[None, :]).flatten()
    for values in (singles, groups):
        gaps = (values[:, None] - values[None, :]).abs().fill_diagonal_(1.0)
        assert gaps.min() > 1e-4


def _check_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("experts,n_group,topk_group,top_k", [
    (256, 8, 4, 8),  # Ling-2.6-flash
    (24, 4, 2, 3),  # group size 6: padded to 8
    (48, 3, 2, 5),  # 3 groups: padded to 4
    (16, 1, 1, 4),  # one group
    (8, 4, 4, 8),  # every group kept, every expert chosen
])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_reference(experts: int, n_group: int, topk_group: int, top_k: int, bias: bool) -> None:
    logits = grid_logits(13, experts, experts + top_k, DEVICE)
    expert_bias = grid_bias(experts, n_group, DEVICE) if bias else None
    args = (expert_bias, n_group, topk_group, top_k, 2.5)
    want = reference.grouped_topk(logits, *args)
    _check_same(kernel.grouped_topk(logits, *args), want)
    torch.testing.assert_close(want[1].sum(-1), torch.full((13,), 2.5, device=DEVICE), rtol=1e-6, atol=0)


def test_ties_pick_the_lower_index() -> None:
    """Hand-computed: group scores tie between groups 1 and 2 (both better than 0 and 3) -> keep 1 and 2 with
    topk_group=2; inside them, experts 5, 6 and 9 tie at the top -> 5 and 6 win over 9 (top_k=2)."""
    logits = torch.zeros(1, 16)
    logits[0, [5, 6, 9, 10]] = 1.0  # groups of 4: group 1 = experts 4..7, group 2 = 8..11
    for fn in (reference.grouped_topk, kernel.grouped_topk):
        ids, weights = fn(logits.to(DEVICE), None, 4, 2, 2, 1.0)
        assert ids.tolist() == [[5, 6]]
        assert weights.tolist() == [[0.5, 0.5]]
        ids, _ = fn(torch.zeros(2, 16, device=DEVICE), None, 4, 2, 3, 1.0)  # everything ties
        assert ids.tolist() == [[0, 1, 2]] * 2


def test_bias_steers_selection_but_not_weights() -> None:
    """Expert 3 has the lowest score but a bias that makes it the best choice; its weight is its unbiased score."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], device=DEVICE)
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0], device=DEVICE)
    for fn in (reference.grouped_topk, kernel.grouped_topk):
        ids, weights = fn(logits, bias, 2, 2, 2, 3.0)
        assert ids.tolist() == [[3, 0]]
        p = torch.sigmoid(logits[0, [3, 0]])
        torch.testing.assert_close(weights[0], p / p.sum() * 3.0, rtol=1e-6, atol=0)


def test_reference_equals_the_topk_formulation() -> None:
    """Continuous logits (no ties): the sort-based reference equals the plain torch.topk formulation of the rule."""
    gen = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(64, 256, generator=gen), torch.randn(256, generator=gen) * 0.1
    choice = (torch.sigmoid(logits) + bias).view(64, 8, 32)
    kept = choice.topk(2, dim=-1).values.sum(-1).topk(4, dim=-1).indices
    mask = torch.zeros(64, 8, dtype=torch.bool).scatter_(1, kept, True)
    ids = choice.masked_fill(~mask[:, :, None], float("-inf")).flatten(1).topk(8, dim=-1).indices
    got_ids, got_weights = reference.grouped_topk(logits, bias, 8, 4, 8, 2.5)
    assert torch.equal(got_ids, ids)
    p = torch.sigmoid(logits).gather(1, ids)
    torch.testing.assert_close(got_weights, p / p.sum(-1, keepdim=True) * 2.5, rtol=1e-6, atol=0)


def test_no_tokens() -> None:
    ids, weights = kernel.grouped_topk(torch.zeros(0, 16, device=DEVICE), None, 4, 2, 2, 1.0)
    assert ids.shape == weights.shape == (0, 2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_group=3), "groups of at least 2"),
    (dict(n_group=16), "groups of at least 2"),
    (dict(topk_group=5), "topk_group"),
    (dict(top_k=9), "top_k"),
    (dict(bias=torch.zeros(8)), "expert_bias"),
    (dict(logits=torch.zeros(2, 16, dtype=torch.float16)), "fp32"),
])
def test_bad_arguments(kwargs: dict, message: str) -> None:
    args = dict(logits=torch.zeros(2, 16), bias=None, n_group=4, topk_group=2, top_k=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        entry.grouped_topk(args["logits"], args["bias"], args["n_group"], args["topk_group"], args["top_k"], 1.0)
