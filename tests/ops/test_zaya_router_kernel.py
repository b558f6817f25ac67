"""EDA router kernel vs the reference (ops/reference/zaya_router.py), fp32 throughout.

The carry and the probabilities are fp32 arithmetic in another summation order: 1e-5 relative. The choice is
discrete: it must equal the reference's wherever the reference's best and second-best p + bias differ by more
than 1e-5 (every difference is a genuine near-tie), and the inputs are drawn so that such ties are rare.
"""
from __future__ import annotations

import pytest
import torch

from hybridserve.ops.reference import zaya_router as reference
from hybridserve.ops.triton import zaya_router as kernel
from tests.ops.conftest import DEVICE


def router_inputs(tokens: int, width: int, experts: int, skip_bias: float, seed: int = 0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    biases = rand(experts + 1, scale=0.05)
    biases[-1] = skip_bias
    return dict(z=rand(tokens, width, scale=2.0), carry=rand(tokens, width), states_scale=rand(width, scale=0.5),
                norm_weight=1 + rand(width, scale=0.1), eps=1e-5, fc1_weight=rand(width, width, scale=width ** -0.5),
                fc1_bias=rand(width, scale=0.1), fc2_weight=rand(width, width, scale=width ** -0.5),
                fc2_bias=rand(width, scale=0.1), out_weight=rand(experts + 1, width, scale=4 * width ** -0.5),
                balancing_biases=biases)


def check_routing(got: reference.Routing, want: reference.Routing, probs_biased: torch.Tensor) -> None:
    """Compare a routing (any device) to the reference; `probs_biased` = the reference's p + bias [T, E + 1]."""
    got = reference.Routing(*(t.cpu() for t in got))
    assert torch.allclose(got.carry, want.carry, rtol=1e-5, atol=1e-5)
    top2 = probs_biased.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-5
    assert clear.float().mean().item() >= 0.9
    assert torch.equal(got.choice[clear], want.choice[clear])
    same = got.choice == want.choice
    assert torch.allclose(got.weight[same], want.weight[same], rtol=1e-5, atol=1e-7)
    for name in ("expert_ids", "expert_weights", "skip_weight"):
        assert torch.allclose(getattr(got, name)[same].double(), getattr(want, name)[same].double(), rtol=1e-5,
                              atol=1e-7), name
    assert got.choice.dtype == got.expert_ids.dtype == torch.int64


def biased_probs(args: dict, carry: torch.Tensor) -> torch.Tensor:
    """The reference's p + balancing_biases for the z that includes the carry term (the routing's carry)."""
    names = ("norm_weight", "eps", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "out_weight")
    return reference.router_probs(carry, *(args[n] for n in names)) + args["balancing_biases"]


@pytest.mark.parametrize("tokens", [1, 37])  # one partial token block; several blocks, the last partial
@pytest.mark.parametrize("with_carry", [True, False])
@pytest.mark.parametrize("width, experts, skip_bias", [(40, 4, -1.0), (24, 6, 0.15)])  # 40: 3 column blocks
def test_router_kernel_matches_reference(tokens, with_carry, width, experts, skip_bias):
    args = router_inputs(tokens, width, experts, skip_bias, device="cpu")
    if not with_carry:
        args["carry"] = None
    want = reference.eda_route(**{**args, "z": args["z"].clone()})
    z = args["z"].clone().to(DEVICE)
    got = kernel.eda_route(**{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                              for k, v in {**args, "z": z}.items()})
    check_routing(got, want, biased_probs(args, want.carry))
    assert torch.equal(z.cpu(), args["z"])  # the caller's z is left as it was (the carry is a tensor of its own)
    if skip_bias > 0 and tokens > 1:  # the skip class is chosen for some tokens and mapped to expert 0 with weight 0
        skip = want.choice == experts
        assert 0 < skip.sum() < len(skip)
        assert (want.expert_ids[skip] == 0).all() and (want.expert_weights[skip] == 0).all()


def test_router_kernel_refuses_other_dtypes():
    args = router_inputs(4, 16, 2, -1.0)
    with pytest.raises(ValueError, match="fp32"):
        kernel.eda_route(**{**args, "fc1_weight": args["fc1_weight"].half()})
