"""The unsorted inverse-CDF draw: Triton kernel (`ops.triton.sampling`) vs the torch reference
(`ops.reference.sampling.draw_unsorted`).

Both invert the same float64 CDF, the kernel over unnormalised masses; they can disagree only when u * total falls
within rounding (~1e-7 relative, fp32 exp) of a CDF step's edge, which uniform numbers drawn at random hit with
probability ~1e-7 a draw, so every pick must match exactly. The cases cover vocabularies that do not fill the
last block, several blocks, min-p cutting most of the mass, -inf (masked) entries, u at 0 and at the top of the
CDF (the clamps onto the last kept entry), and temperatures from sharp to flat.
"""
from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import DEVICE
from hybridserve.ops.reference import sampling as reference
from hybridserve.ops.triton import sampling as kernel


def _params(rows: int, seed: int, min_p: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    temperature = torch.rand(rows, generator=gen, dtype=torch.float64) * 1.9 + 0.1
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    return torch.stack([temperature, torch.zeros(rows, dtype=torch.float64), torch.ones(rows, dtype=torch.float64),
                        torch.full((rows,), min_p, dtype=torch.float64), u], dim=1).to(DEVICE)


@pytest.mark.parametrize("vocab", [7, 1000, 1024, 5000, 262272])
@pytest.mark.parametrize("min_p", [0.0, 0.1])
def test_kernel_picks_the_references_tokens(vocab: int, min_p: float) -> None:
    rows = 3 if vocab > 10000 else 24
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).mul(3.0).to(DEVICE)
    params = _params(rows, seed=vocab + int(min_p * 10), min_p=min_p)
    want = reference.draw_unsorted(logits, params)
    got = kernel.draw_unsorted(logits, params)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, want)


def test_masked_entries_are_never_drawn_and_the_cdf_ends_clamp_onto_kept_tokens() -> None:
    """Kept tokens are not a prefix of the vocabulary, and the last kept one sits in an earlier block than the
    vocabulary's end: u = 1 (the search runs past every entry) must land on it, u = 0 on the first kept one."""
    vocab = 3000
    logits = torch.full((4, vocab), float("-inf"))
    kept = torch.tensor([5, 17, 1030, 1500])
    logits[:, kept] = torch.tensor([0.1, 2.0, -1.0, 0.5])
    params = _params(4, seed=1)
    params[:, 4] = torch.tensor([0.0, 1.0, 0.5, 0.999999], dtype=torch.float64)
    logits, params = logits.to(DEVICE), params.to(DEVICE)
    want = reference.draw_unsorted(logits, params)
    got = kernel.draw_unsorted(logits, params)
    assert torch.equal(got, want)
    assert got[0].item() == 5 and got[1].item() == 1500
    assert set(got.tolist()) <= set(kept.tolist())


def test_many_draws_follow_the_distribution() -> None:
    """400 rows of one 6-token distribution at evenly spaced u: each token's share of picks is its probability
    (within one row's step, 1/400), so the kernel inverts the CDF itself and not merely the reference's code."""
    rows = 400
    logits = torch.tensor([[0.0, 1.0, -0.5, 2.0, 0.3, -2.0]]).repeat(rows, 1)
    params = _params(rows, seed=3)
    params[:, 0] = 1.0
    params[:, 4] = (torch.arange(rows, dtype=torch.float64) + 0.5) / rows
    got = kernel.draw_unsorted(logits.to(DEVICE), params.to(DEVICE)).cpu()
    share = torch.bincount(got, minlength=6).double() / rows
    torch.testing.assert_close(share, torch.softmax(logits[0].double(), dim=0), atol=1.0 / rows, rtol=0)
