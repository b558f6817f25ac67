"""Decode GEMV kernels on CUDA at the real model widths, bf16: the dense linear (ops.triton.linear) at ZAYA1-8B's and
Ling-2.6-flash's projections, and the few-pair routed experts (ops.triton.moe_gemv) at both MoE shapes.

Linear bound: every element within one bf16 ulp of the exact (fp64) product of the same bf16 inputs (fp32
accumulation, one rounding); cuBLAS's bf16 GEMM is held to nothing here, it is only the speed reference. Experts
bound, fixture and routing (skip rows on every 5th token from the 5th) as tests/gpu/test_moe_gpu.py: norm-relative
error vs the fp32 reference <= 1e-2 and no worse than 1.2x the
torch bf16 path's. Both must be bit-identical run to run and between eager calls and a CUDA-graph replay, and must
not sync the host; a token's expert rows must not depend on the other tokens of the batch.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.ops.reference import moe as moe_reference
from tests.gpu.sync import no_host_sync
from tests.gpu.test_moe_gpu import _rel, _routing, experts  # noqa: F401  (experts: the fixture of both MoE shapes)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")

# name: (K, N, bias)
LINEAR_SHAPES = {
    "zaya1 q|k|v|v": (2048, 1536, False), "zaya1 o_proj": (1024, 2048, False),
    "ling Q|K|V|G": (4096, 16384, False), "ling dense (o)": (4096, 4096, False),
    "ling MLA q_a|kv_a": (4096, 2112, False), "ling MLA q_b": (1536, 6144, False),
    "ling dense FFN gate|up": (4096, 18432, False), "ling dense FFN down": (9216, 4096, False),
    "ling shared expert gate|up": (4096, 2048, False), "ling shared expert down": (1024, 4096, False),
    "with bias": (2048, 1000, True),
}


def _graphed(fn, static_inputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
    """fn(*static_inputs) captured in a CUDA graph (after one eager call that compiles), replayed on `inputs`."""
    fn(*static_inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static_inputs)
    for static, value in zip(static_inputs, inputs):
        static.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("tokens", [1, 2, 5, 16])
@pytest.mark.parametrize("shape", list(LINEAR_SHAPES))
def test_linear_bf16_within_one_rounding(shape: str, tokens: int) -> None:
    from hybridserve.ops.triton import linear as kernel
    k, n, has_bias = LINEAR_SHAPES[shape]
    gen = torch.Generator(device=CUDA).manual_seed(tokens)
    x = torch.randn(tokens, k, device=CUDA, generator=gen).bfloat16()
    w = (torch.randn(n, k, device=CUDA, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, device=CUDA, generator=gen).bfloat16() if has_bias else None
    got = kernel.linear(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    err = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16 and (err <= exact.abs() * 2.0**-7 + 1e-6 * exact.abs().max()).all()
    assert torch.equal(got, kernel.linear(x, w, b))
    if tokens in (1, 16):
        static = [torch.zeros_like(x)]
        assert torch.equal(_graphed(lambda v: kernel.linear(v, w, b), static, [x]), got)


@pytest.mark.parametrize("reduce", [True, False])
def test_experts_bf16_match_reference_deterministic_and_graphed(experts, reduce: bool) -> None:  # noqa: F811
    from hybridserve.ops.triton import moe_gemv as kernel
    name, top_k, w13, w2 = experts
    hidden = w13.shape[2]
    for tokens in sorted({t for t in (1, 2, 5, kernel.MAX_PAIRS // top_k) if t * top_k <= kernel.MAX_PAIRS}):
        gen = torch.Generator(device=CUDA).manual_seed(tokens)
        x = torch.randn(tokens, hidden, device=CUDA, generator=gen).bfloat16()
        ids, weights = _routing(tokens, w13.shape[0], top_k, seed=tokens)
        got = kernel.fused_experts(x, w13, w2, ids, weights, reduce=reduce)
        summed = got.float().sum(1) if not reduce else got.float()
        want = moe_reference.experts_sorted(x.float(), w13.float(), w2.float(), ids, weights)
        torch_bf16 = moe_reference.fused_experts(x, w13, w2, ids, weights)
        err, torch_err = _rel(summed, want), _rel(torch_bf16, want)
        print(f"{name} T={tokens} reduce={reduce}: kernel {err:.2e}, torch bf16 {torch_err:.2e}")
        assert err <= 1e-2 and err <= 1.2 * torch_err
        if top_k == 1:
            assert not got[4::5].any()  # _routing's skip rows: exact zeros
        assert torch.equal(got, kernel.fused_experts(x, w13, w2, ids, weights, reduce=reduce))
        # the first token's row(s) alone: the same bits (tiles from the weight shapes only)
        assert torch.equal(kernel.fused_experts(x[:1], w13, w2, ids[:1], weights[:1], reduce=reduce), got[:1])
        static = [torch.zeros_like(x), torch.zeros_like(ids), torch.zeros_like(weights)]
        graphed = _graphed(lambda v, i, w: kernel.fused_experts(v, w13, w2, i, w, reduce=reduce), static,
                           [x, ids, weights])
        assert torch.equal(graphed, got)


def test_no_device_to_host_sync(experts) -> None:  # noqa: F811  (the fixture)
    from hybridserve.ops.triton import linear as linear_kernel
    from hybridserve.ops.triton import moe_gemv as kernel
    _, top_k, w13, w2 = experts
    x = torch.randn(2, w13.shape[2], device=CUDA).bfloat16()
    ids, weights = _routing(2, w13.shape[0], top_k, seed=3)
    w = torch.randn(512, w13.shape[2], device=CUDA).bfloat16()

    def calls():
        kernel.fused_experts(x, w13, w2, ids, weights)
        kernel.fused_experts(x, w13, w2, ids, weights, reduce=False)
        linear_kernel.linear(x, w)

    calls()
    with no_host_sync():
        calls()


@pytest.fixture
def pdl_switch(monkeypatch: pytest.MonkeyPatch):
    """set(on): launch the decode kernels with programmatic dependent launch on or off from here."""
    from hybridserve.ops.triton import pdl

    def switch(on: bool) -> None:
        monkeypatch.setenv("HYBRIDSERVE_PDL", "1" if on else "0")
        pdl._enabled.cache_clear()
        assert pdl.launch(CUDA)["USE_PDL"] is on
    yield switch
    pdl._enabled.cache_clear()


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_weights_loaded_before_the_pdl_wait_change_no_bit(pdl_switch, tokens: int) -> None:
    """With PDL a decode GEMV or router launch loads its weight tile before griddepcontrol.wait (gemv.dot_rows,
    zaya_router._rows_times_cols, WAIT): only where the loads are issued moves, so every bit equals the launch
    without PDL (which has no such path), for 16-bit and e4m3 weights (both scale schemes), the router and
    ZAYA1-8B's top-1 experts (whose down launch loads its expert's rows before the wait, a skip token's masked
    off)."""
    from hybridserve.ops.triton import fp8_linear, linear, moe_gemv, zaya_router
    from tests.gpu.test_fp8_kernels_gpu import SCHEMES, _quantized
    from tests.gpu.test_zaya_kernels_gpu import EXPERTS, HIDDEN, ROUTER
    from tests.ops.test_zaya_router_kernel import router_inputs
    gen = torch.Generator(device=CUDA).manual_seed(tokens)
    x = torch.randn(tokens, 2048, device=CUDA, generator=gen).bfloat16()
    dense = (torch.randn(1536, 2048, device=CUDA, generator=gen) / 2048**0.5).bfloat16()
    quantized = [(scheme, *_quantized(1536, 2048, scheme, gen))
                 for scheme in (SCHEMES["channel/token"], SCHEMES["block/group"])]
    route = {k: v.cuda() if isinstance(v, torch.Tensor) else v
             for k, v in router_inputs(tokens, HIDDEN, ROUTER, EXPERTS, skip_bias=0.05, device="cpu").items()}

    w13 = (torch.randn(16, 4096, 2048, device=CUDA, generator=gen) / 2048**0.5).bfloat16()
    w2 = (torch.randn(16, 2048, 2048, device=CUDA, generator=gen) / 2048**0.5).bfloat16()
    ids = torch.randint(0, 16, (tokens, 1), device=CUDA, generator=gen)
    weights = torch.rand(tokens, 1, device=CUDA, generator=gen)
    weights[0] = 0.0  # a skip token: expert 0, weight 0

    def outputs() -> list[torch.Tensor]:
        got = [linear.linear(x, dense), moe_gemv.fused_experts(x, w13, w2, ids, weights)]
        got += [fp8_linear.fp8_linear(x, w, s, scheme, None, None) for scheme, w, s in quantized]
        return got + list(zaya_router.eda_route(**route).tensors())
    pdl_switch(False)
    without = outputs()
    pdl_switch(True)
    for got, want in zip(outputs(), without, strict=True):
        assert torch.equal(got, want)
