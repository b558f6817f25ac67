"""FP8 (e4m3) kernels on CUDA at the real model widths, bf16 activations, both weight-scale layouts (per row,
per 128x128 block with per-group activations) and a static activation scale: the linear layers
(`ops.triton.fp8_linear`: weight-only GEMV, weight-only tl.dot GEMM and W8A8 GEMM forms) and the routed experts (`ops.triton.fp8_moe`,
weight-only GEMV and W8A8 grouped forms) vs the torch references of `ops.reference.fp8`, which compute in fp32 on
the same e4m3 values (weight-only where the kernels are).

Linear bound: the e4m3 values are the reference's bit for bit (tests/ops/test_fp8_linear_kernel.py), the products
exact (e4m3 by e4m3, or by bf16 x), so both round nearly the same fp32 value once to bf16: within one bf16 ulp of each other plus 1e-5 of the
largest output; the W8A8 GEMM form also 2^-10 of the sum of the products' magnitudes, for the FP8 tensor cores'
narrower accumulation inside a K tile (about 14 bits measured for DeepSeek-V3; each tile is then added in fp32).
The printed errors say how much of that bound is used.
Experts bound: norm-relative error vs the reference <= 1e-2 (the kernels round the SwiGLU rows and each weighted
row to bf16 before the fp32 sum, and a requantized SwiGLU value next to an e4m3 midpoint may round the other way:
see tests/ops/test_fp8_moe_kernel.py); skip rows exact zeros; unreduced rows sum to the reduced output.
Everything must be bit-identical run to run and between eager calls and a CUDA-graph replay, and must not sync the
host.
"""
from __future__ import annotations

import pytest
import torch

from hybridserve.core.quant import WEIGHT_ONLY_MAX_PAIRS, Fp8Scheme, dequantize, linear_weight_only
from hybridserve.ops.reference import fp8 as reference
from tests.gpu.sync import no_host_sync
from tests.gpu.test_decode_gemv_gpu import _graphed
from tests.gpu.test_moe_gpu import _rel, _routing

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SCHEMES = {"channel/token": Fp8Scheme("channel", "token"), "block/group": Fp8Scheme("block", "group", (128, 128)),
           "tensor/static": Fp8Scheme("tensor", "static")}
# name: (K, N)
LINEAR_SHAPES = {"zaya1 q|k|v|v": (2048, 1536), "zaya1 o_proj": (1024, 2048), "ling Q|K|V|G": (4096, 16384),
                 "ling shared expert gate|up": (4096, 2048), "ling shared expert down": (1024, 4096)}
GEMV_TOKENS, GEMM_TOKENS = (1, 2), (3, 5, 16, 17, 64, 512, 4096)  # GEMM: weight-only up to 16 tokens
# name: (experts, top_k, hidden, intermediate)
MOE_SHAPES = {"zaya1-8b": (16, 1, 2048, 2048), "ling-2.6-flash": (256, 8, 4096, 1024)}
MOE_TOKENS = {"zaya1-8b": (1, 5, 8, 16, 256, 2048), "ling-2.6-flash": (1, 16, 256, 1024)}
STATIC_SCALE = 0.02  # the static activation scale: bf16 randn activations reach about 448 * 0.02


def _input_scale(scheme: Fp8Scheme) -> torch.Tensor | None:
    return torch.tensor(STATIC_SCALE, device=CUDA) if scheme.activation == "static" else None


def _quantized(rows: int, cols: int, scheme: Fp8Scheme, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.quantize_weight(torch.randn(rows, cols, device=CUDA, generator=gen) / cols**0.5, scheme)


def _stack(experts: int, rows: int, cols: int, scheme: Fp8Scheme, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights [E, rows, cols] and their scales, quantized an expert at a time (Ling's fp32 stack: 8 GB)."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    values, scales = zip(*(_quantized(rows, cols, scheme, gen) for _ in range(experts)))
    return torch.stack(values), torch.stack(scales)


def _within_one_rounding(got: torch.Tensor, want: torch.Tensor, magnitudes: torch.Tensor | None) -> float:
    """Asserts the linear bound (module docstring); returns the largest share of it an element uses."""
    err = (got.double() - want.double()).abs()
    bound = want.double().abs() * 2.0**-7 + 1e-5 * want.double().abs().max()
    if magnitudes is not None:
        bound = bound + 2.0**-10 * magnitudes.double()
    assert got.dtype == torch.bfloat16 and (err <= bound).all(), (err - bound).max()
    return (err / bound).max().item()


@pytest.fixture(scope="module", params=[(shape, scheme) for shape in LINEAR_SHAPES for scheme in SCHEMES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def linear_weight(request):
    shape, scheme = request.param
    k, n = LINEAR_SHAPES[shape]
    weight, scale = _quantized(n, k, SCHEMES[scheme], torch.Generator(device=CUDA).manual_seed(n))
    return shape, SCHEMES[scheme], weight, scale


@pytest.mark.parametrize("tokens", GEMV_TOKENS + GEMM_TOKENS)
def test_linear_within_one_rounding_deterministic_and_graphed(linear_weight, tokens: int) -> None:
    from hybridserve.ops.triton import fp8_linear as kernel
    name, scheme, weight, scale = linear_weight
    x = torch.randn(tokens, weight.shape[1], device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(tokens))
    x = x.bfloat16()
    input_scale = _input_scale(scheme)
    got = kernel.fp8_linear(x, weight, scale, scheme, None, input_scale)
    weight_only = linear_weight_only(x)
    want = reference.fp8_linear(x, weight, scale, scheme, None, input_scale, weight_only=weight_only)
    magnitudes = None if weight_only else \
        reference.fake_quantize(x, scheme, input_scale).abs() @ dequantize(weight, scale, scheme).abs().T
    used = _within_one_rounding(got, want, magnitudes)
    form = "GEMV" if kernel.takes_gemv(x) else "weight-only GEMM" if weight_only else "W8A8 GEMM"
    print(f"{name} {scheme.weight}/{scheme.activation} T={tokens} ({form}): {used:.0%} of the bound at most")
    assert torch.equal(got, kernel.fp8_linear(x, weight, scale, scheme, None, input_scale))
    if tokens in (1, 5, 16, 64):
        static = [torch.zeros_like(x)]
        graphed = _graphed(lambda v: kernel.fp8_linear(v, weight, scale, scheme, None, input_scale), static, [x])
        assert torch.equal(graphed, got)


def test_linear_bias_and_strided_x() -> None:
    """A bias (fp32 add before the one rounding) and x a column slice, all three forms."""
    from hybridserve.ops.triton import fp8_linear as kernel
    scheme = SCHEMES["block/group"]
    gen = torch.Generator(device=CUDA).manual_seed(1)
    weight, scale = _quantized(1000, 2048, scheme, gen)
    bias = torch.randn(1000, device=CUDA, generator=gen).bfloat16()
    wide = torch.randn(300, 2100, device=CUDA, generator=gen).bfloat16()
    for tokens in (1, 7, 300):
        x = wide[:tokens, 20:2068]
        got = kernel.fp8_linear(x, weight, scale, scheme, bias)
        want = reference.fp8_linear(x, weight, scale, scheme, bias, weight_only=linear_weight_only(x))
        magnitudes = reference.fake_quantize(x, scheme).abs() @ dequantize(weight, scale, scheme).abs().T
        _within_one_rounding(got, want, None if linear_weight_only(x) else magnitudes)


@pytest.fixture(scope="module", params=[(shape, scheme) for shape in MOE_SHAPES for scheme in SCHEMES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def fp8_experts(request):
    shape, scheme_name = request.param
    experts, top_k, hidden, inter = MOE_SHAPES[shape]
    scheme = SCHEMES[scheme_name]
    w13, s13 = _stack(experts, 2 * inter, hidden, scheme, seed=0)
    w2, s2 = _stack(experts, hidden, inter, scheme, seed=1)
    # static: SiLU(gate) * up of these weights stays within about 448 * 0.04
    input_scales = (_input_scale(scheme), torch.tensor(0.04, device=CUDA) if scheme.activation == "static" else None)
    return shape, top_k, scheme, w13, s13, w2, s2, input_scales


def test_experts_match_reference_deterministic_and_graphed(fp8_experts) -> None:
    from hybridserve.ops.triton import fp8_moe as kernel
    name, top_k, scheme, w13, s13, w2, s2, input_scales = fp8_experts
    hidden = w13.shape[2]

    def run(x, ids, weights, reduce=True):
        return kernel.fused_experts(x, w13, s13, w2, s2, ids, weights, scheme, input_scales, reduce=reduce)

    for tokens in MOE_TOKENS[name]:
        gen = torch.Generator(device=CUDA).manual_seed(tokens)
        x = torch.randn(tokens, hidden, device=CUDA, generator=gen).bfloat16()
        ids, weights = _routing(tokens, w13.shape[0], top_k, seed=tokens)
        got = run(x, ids, weights)
        rows = run(x, ids, weights, reduce=False)
        gemv = tokens * top_k <= WEIGHT_ONLY_MAX_PAIRS
        want = reference.fp8_fused_experts(x, w13, s13, w2, s2, ids, weights, scheme, input_scales, weight_only=gemv)
        form = "GEMV" if gemv else "grouped"
        err = _rel(got, want)
        print(f"{name} {scheme.weight}/{scheme.activation} T={tokens} ({form}): {err:.2e}")
        assert got.dtype == torch.bfloat16 and got.shape == x.shape and err <= 1e-2
        total = rows.float().sum(1)
        torch.testing.assert_close(got.float(), total, rtol=2.0**-7, atol=1e-6 * total.abs().max().item())
        if top_k == 1 and tokens >= 5:
            assert not got[4::5].any() and not rows[4::5].any()  # _routing's skip rows
        assert torch.equal(got, run(x, ids, weights))
        if tokens in (1, 16, 256):
            static = [torch.zeros_like(x), torch.zeros_like(ids), torch.zeros_like(weights)]
            assert torch.equal(_graphed(run, static, [x, ids, weights]), got)


def test_no_device_to_host_sync(fp8_experts) -> None:
    from hybridserve.ops.triton import fp8_linear, fp8_moe
    _, top_k, scheme, w13, s13, w2, s2, input_scales = fp8_experts
    hidden = w13.shape[2]
    weight, scale = _quantized(1536, hidden, scheme, torch.Generator(device=CUDA).manual_seed(2))
    x = torch.randn(64, hidden, device=CUDA).bfloat16()
    ids, weights = _routing(64, w13.shape[0], top_k, seed=3)

    def calls():
        for tokens in (1, 64):  # both forms of each
            fp8_linear.fp8_linear(x[:tokens], weight, scale, scheme, None, input_scales[0])
            fp8_moe.fused_experts(x[:tokens], w13, s13, w2, s2, ids[:tokens], weights[:tokens], scheme,
                                  input_scales)
            fp8_moe.fused_experts(x[:tokens], w13, s13, w2, s2, ids[:tokens], weights[:tokens], scheme,
                                  input_scales, reduce=False)

    calls()
    with no_host_sync():
        calls()
