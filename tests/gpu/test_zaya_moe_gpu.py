"""ZAYA1's MoE half in one persistent launch (ops/triton/zaya_moe.py) on CUDA at ZAYA1-8B widths, bf16.

On the GPU the launch runs its five phases with grid barriers between them. It must give the bits of the same
kernel launched a phase at a time (where each kernel boundary orders the phases: the barriers are what is tested)
and of the separate kernels it replaces; replayed from a CUDA graph it must give them again at every replay (the
barrier and arrival counters back at zero), and it makes no device-to-host sync.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.sync import no_host_sync

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    from hybridserve.ops.triton import zaya_moe
    from tests.ops import test_zaya_moe_kernel as cases

WIDTHS = dict(HIDDEN=2048, WIDTH=256, INTER=2048, EXPERTS=16)


@pytest.fixture(autouse=True)
def zaya1_8b_widths(monkeypatch):
    for name, value in WIDTHS.items():
        monkeypatch.setattr(cases, name, value)


def _equal(a, b) -> bool:
    (ax, ah, _), a_route = a
    (bx, bh, _), b_route = b
    return torch.equal(ax, bx) and torch.equal(ah, bh) and all(torch.equal(p, q) for p, q in zip(a_route, b_route))


@pytest.mark.parametrize("tokens,skip_bias", [(1, -10.0), (1, 10.0), (2, 0.3), (8, 0.3)])
def test_one_launch_is_the_phases_and_the_separate_kernels(tokens, skip_bias):
    inputs = cases.step_inputs(tokens, torch.bfloat16, skip_bias, carry=True)
    args = (inputs["x"], inputs["x32"], inputs["carry"], inputs["router"], inputs["w13"], inputs["w2"],
            inputs["norm"], True)
    with no_host_sync():
        together = zaya_moe.routed_experts_residual_norm(*args, one_launch=True)
    phases = zaya_moe.routed_experts_residual_norm(*args, one_launch=False)
    assert _equal(together, phases)
    assert _equal(together, cases.separate_kernels(inputs, scaled_identity=True))
    for programs in (7, 64):  # fewer programs than items: each takes several in turn
        assert _equal(zaya_moe.routed_experts_residual_norm(*args, programs=programs, one_launch=True), phases)


def test_one_launch_replays_from_a_cuda_graph():
    inputs = cases.step_inputs(1, torch.bfloat16, 0.0, carry=True)
    args = (inputs["x"], inputs["x32"], inputs["carry"], inputs["router"], inputs["w13"], inputs["w2"],
            inputs["norm"], True)
    want = zaya_moe.routed_experts_residual_norm(*args, one_launch=False)
    zaya_moe.routed_experts_residual_norm(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = zaya_moe.routed_experts_residual_norm(*args)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert _equal(captured, want)
    new = cases.step_inputs(1, torch.bfloat16, 0.0, carry=True, seed=9)  # new inputs, same buffers
    for key in ("x", "x32", "carry"):
        inputs[key].copy_(new[key])
    graph.replay()
    assert _equal(captured, zaya_moe.routed_experts_residual_norm(*args, one_launch=False))
