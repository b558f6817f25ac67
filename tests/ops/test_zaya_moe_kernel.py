"""ZAYA1's MoE half in one launch (ops/triton/zaya_moe.py) against the separate kernels it replaces and against the
references.

The launch runs the separate kernels' block functions on their tiles, so its routing and outputs must be their
bits exactly (`torch.equal`), whatever the number of programs sharing the work; and both must match the reference
ops (the router's, the experts', the residual norm's) to the kernels' own tolerances. Here the interpreter runs each
phase as a launch of its own (a barrier cannot work where programs run one after another); the one-launch form
with its barriers is compared with this on the GPU (tests/gpu/test_zaya_moe_gpu.py).
"""
from __future__ import annotations

import pytest
import torch

from hybridserve.ops import zaya_moe as ops
from hybridserve.ops.norm import ResidualNorm
from hybridserve.ops.reference import zaya_moe as reference
from hybridserve.ops.reference.zaya_router import EDARouterWeights
from hybridserve.ops.triton import moe_gemv
from hybridserve.ops.triton import zaya_moe as kernel
from hybridserve.ops.triton import zaya_router
from tests.ops.conftest import DEVICE, KERNEL_DTYPES
from tests.ops.test_zaya_router_kernel import router_inputs

HIDDEN, WIDTH, INTER, EXPERTS = 64, 32, 48, 4


def step_inputs(tokens: int, dtype: torch.dtype, skip_bias: float, carry: bool, seed: int = 0) -> dict:
    args = router_inputs(tokens, HIDDEN, WIDTH, EXPERTS, skip_bias, seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dt)

    x = rand(tokens, HIDDEN)
    router = EDARouterWeights(args["down_weight"], args["down_bias"], args["states_scale"] if carry else None,
                              args["norm_weight"], args["eps"], args["fc1_weight"], args["fc1_bias"],
                              args["fc2_weight"], args["fc2_bias"], args["out_weight"], args["balancing_biases"])
    norm = ResidualNorm(1 + rand(HIDDEN, scale=0.1), 1e-5, rand(tokens, HIDDEN, dt=torch.float32),
                        rand(HIDDEN, scale=0.1), 1 + rand(HIDDEN, scale=0.1), rand(HIDDEN, scale=0.1),
                        1 + rand(HIDDEN, scale=0.1))
    return dict(x=x, x32=x.float(), carry=args["carry"] if carry else None, router=router,
                w13=rand(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN ** -0.5),
                w2=rand(EXPERTS, HIDDEN, INTER, scale=INTER ** -0.5), norm=norm)


def separate_kernels(inputs: dict, scaled_identity: bool):
    """What the step ran before: the router's decode form, then the GEMV experts with the norm in their down launch."""
    route = zaya_router.fused_route(*inputs["router"].route_args(inputs["x32"], inputs["carry"]))
    norm = inputs["norm"]
    if scaled_identity:
        norm = ResidualNorm(**{**norm.__dict__, "skip_weight": route.skip_weight, "skip_input": inputs["x"]})
    return moe_gemv.fused_experts(inputs["x"], inputs["w13"], inputs["w2"], route.expert_ids, route.expert_weights,
                                  norm=norm), route


def one_launch(inputs: dict, scaled_identity: bool, programs: int | None = None):
    return kernel.routed_experts_residual_norm(inputs["x"], inputs["x32"], inputs["carry"], inputs["router"],
                                               inputs["w13"], inputs["w2"], inputs["norm"], scaled_identity,
                                               programs=programs, one_launch=False)


@pytest.mark.parametrize("tokens,skip_bias,carry,scaled_identity,dtype", [
    (1, -10.0, True, True, KERNEL_DTYPES[0]), (1, 10.0, True, True, KERNEL_DTYPES[-1]),
    (3, 0.3, False, True, KERNEL_DTYPES[1]), (5, 0.3, True, False, KERNEL_DTYPES[-1]),
    (8, 0.3, True, True, KERNEL_DTYPES[0])])
def test_the_step_is_the_separate_kernels_bits(tokens, skip_bias, carry, scaled_identity, dtype):
    inputs = step_inputs(tokens, dtype, skip_bias, carry)
    (x, h, _), route = one_launch(inputs, scaled_identity)
    (want_x, want_h, _), want_route = separate_kernels(inputs, scaled_identity)
    for name, got, want in zip(want_route._fields, route, want_route):
        assert torch.equal(got, want), name
    assert torch.equal(x, want_x)
    assert torch.equal(h, want_h)
    skipped = route.choice == EXPERTS
    assert skipped.all() if skip_bias > 5 else not skipped.any() if skip_bias < -5 else True


@pytest.mark.parametrize("programs", [1, 3])
def test_any_number_of_programs_gives_the_same_bits(programs):
    inputs = step_inputs(5, torch.float32, 0.3, True, seed=3)
    (x, h, _), route = one_launch(inputs, True)
    (got_x, got_h, _), got_route = one_launch(inputs, True, programs)
    assert torch.equal(got_x, x) and torch.equal(got_h, h)
    assert all(torch.equal(a, b) for a, b in zip(got_route, route))


def test_one_program_runs_the_phases_in_one_launch():
    """One program passes its own barriers, so the interpreter runs the one-launch form too (and the sm_90 compile
    check gets its variant): the phases' bits, and the barrier counter back at zero after the launch."""
    from hybridserve.ops.triton.grid_sync import barrier_counter
    inputs = step_inputs(3, torch.float32, 0.3, True, seed=4)
    args = (inputs["x"], inputs["x32"], inputs["carry"], inputs["router"], inputs["w13"], inputs["w2"],
            inputs["norm"], True)
    (x, h, _), route = kernel.routed_experts_residual_norm(*args, programs=1, one_launch=True)
    (want_x, want_h, _), want_route = kernel.routed_experts_residual_norm(*args, programs=1, one_launch=False)
    assert torch.equal(x, want_x) and torch.equal(h, want_h)
    assert all(torch.equal(a, b) for a, b in zip(route, want_route))
    assert int(barrier_counter("zaya_moe", DEVICE)[0]) == 0


@pytest.mark.parametrize("scaled_identity", [True, False])
def test_the_step_matches_the_reference_ops(scaled_identity):
    """The reference: the three ops' torch references in order (ops/reference/zaya_moe.py), fp32."""
    inputs = step_inputs(4, torch.float32, 0.2, True, seed=5)
    (x, h, _), route = one_launch(inputs, scaled_identity)
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    cpu["router"] = EDARouterWeights(*(t.cpu() if isinstance(t, torch.Tensor) else t
                                       for t in inputs["router"].__dict__.values()))
    cpu["norm"] = ResidualNorm(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                  for k, v in inputs["norm"].__dict__.items()})
    (want_x, want_h, _), want_route = reference.routed_experts_residual_norm(
        cpu["x"], cpu["x32"], cpu["carry"], cpu["router"], cpu["w13"], cpu["w2"], cpu["norm"], scaled_identity)
    assert torch.equal(route.choice.cpu(), want_route.choice)
    assert (want_route.choice == EXPERTS).any() and (want_route.choice < EXPERTS).any()  # both kinds of token
    assert torch.allclose(route.carry.cpu(), want_route.carry, rtol=1e-5, atol=1e-5)
    assert torch.allclose(route.weight.cpu(), want_route.weight, rtol=1e-5, atol=1e-7)
    assert torch.allclose(x.cpu(), want_x, rtol=1e-5, atol=1e-5)
    assert torch.allclose(h.cpu(), want_h, rtol=1e-5, atol=1e-5)


@pytest.fixture
def one_launch_env(monkeypatch):
    """Sets HYBRIDSERVE_ONE_LAUNCH_MOE (None: unset) and forgets `enabled`'s answer, now and after the test."""
    def set_to(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("HYBRIDSERVE_ONE_LAUNCH_MOE", raising=False)
        else:
            monkeypatch.setenv("HYBRIDSERVE_ONE_LAUNCH_MOE", value)
        ops.enabled.cache_clear()
    yield set_to
    ops.enabled.cache_clear()


def test_the_op_takes_only_what_the_launch_runs(one_launch_env):
    """Not asked for (HYBRIDSERVE_ONE_LAUNCH_MOE unset or not 1), CPU tensors, more tokens than MAX_TOKENS and FP8
    experts keep the separate ops (the model's other path)."""
    inputs = step_inputs(2, torch.float32, 0.3, True)
    args = (inputs["x"], inputs["w13"], inputs["w2"])
    for value in (None, "0"):
        one_launch_env(value)
        assert not ops.enabled() and not ops.takes(*args, None)
    one_launch_env("1")
    assert ops.enabled()
    if DEVICE.type == "cpu":
        assert not ops.takes(*args, None)
        with pytest.raises(ValueError, match="ops.zaya_moe.takes"):
            ops.routed_experts_residual_norm(inputs["x"], inputs["x32"], inputs["carry"], inputs["router"],
                                             inputs["w13"], inputs["w2"], inputs["norm"], True)
    else:
        assert ops.takes(*args, None)
        assert not ops.takes(*args, (object(), object()))
        many = step_inputs(kernel.MAX_TOKENS + 1, torch.float32, 0.3, True)
        assert not ops.takes(many["x"], many["w13"], many["w2"], None)


def test_bad_inputs_are_refused():
    inputs = step_inputs(kernel.MAX_TOKENS + 1, torch.float32, 0.3, True)
    with pytest.raises(ValueError, match="at most"):
        one_launch(inputs, True)
    inputs = step_inputs(2, torch.float32, 0.3, True)
    with pytest.raises(ValueError, match="x32"):
        kernel.routed_experts_residual_norm(inputs["x"], inputs["x32"].double(), inputs["carry"], inputs["router"],
                                            inputs["w13"], inputs["w2"], inputs["norm"], True)
    with pytest.raises(ValueError, match="contiguous fp32"):
        kernel.routed_experts_residual_norm(inputs["x"], inputs["x32"], inputs["carry"].t().contiguous().t(),
                                            inputs["router"], inputs["w13"], inputs["w2"], inputs["norm"], True)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="grid barriers"):
            kernel.routed_experts_residual_norm(inputs["x"], inputs["x32"], inputs["carry"], inputs["router"],
                                                inputs["w13"], inputs["w2"], inputs["norm"], True, programs=2,
                                                one_launch=True)
