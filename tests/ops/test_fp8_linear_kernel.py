"""FP8 (e4m3) linear kernels (`ops.triton.fp8_linear`: the weight-only GEMV decode form in `ops.triton.linear` for
the fewest tokens, the tl.dot GEMM with x as it is for the other decode sizes, the W8A8 quantization launch + the same
GEMM beyond) vs `ops.reference.fp8`, and the e4m3 rounding they share.

Exactness. The kernels round to e4m3 in fp32 arithmetic (`fp8_quant.round_to_e4m3`) and divide correctly rounded,
so their e4m3 values and scales are the reference's bit for bit: checked against torch's own conversion on every
e4m3 value, every midpoint between neighbours and the fp32 values either side of it; the quantization launch
against `quantize_activations`; and how the GEMV and GEMM launches take x through an identity weight, whose product
must be x itself (both weight-only forms) and `fake_quantize(x)` (W8A8) exactly: one nonzero term per output,
scaled as the reference scales it.

Tolerance of the products. The products are exact in fp32 in both (e4m3 by e4m3, or by 16-bit x; an fp32 x's
product rounds once, as the reference's); the kernels sum them in another order
(per K lane, per tl.dot tile) and multiply the scales at another place (after the sum, or on a tile), each an fp32
rounding, so before the last rounding the two differ by about K * 2^-24 of the sum of the terms' magnitudes. Both
then round once to x's dtype: within one unit in the last place of each other (2^-10 relative in fp16), plus 1e-5
of the largest output for the fp32 differences (which alone bound the fp32 case). On the GPU the FP8 tensor cores
add a tile's products with fewer bits than fp32 (about 14 kept, as measured for DeepSeek-V3; the GEMM adds each
BLOCK_K tile to fp32), so the W8A8 GEMM form is allowed 2^-10 of the sum of the products' magnitudes more there, and
the weight-only GEMM, whose 16-bit MMA adds a K step's products in fp32 without rounding each sum to nearest, 2^-16
(the interpreter's tl.dot is fp32). The interpreter runs fp32 / fp16 activations only (bf16 is not emulated faithfully
there; tests/gpu/test_fp8_kernels_gpu.py covers it at real widths).
"""
from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import DEVICE, KERNEL_DTYPES, ON_GPU
from tests.ops.fp8_cases import BLOCK, MANTISSA_BITS, SCHEMES, gemm_config, nan_padded
from tests.ops.test_decode_gemv_kernel import _assert_same, _exact, _pending, _residual_norm, _standalone
from hybridserve.core.quant import FP8_DTYPE, FP8_MAX, WEIGHT_ONLY_MAX_ROWS, Fp8Scales, Fp8Scheme, dequantize, \
    linear_weight_only
from hybridserve.ops import backends
from hybridserve.ops import linear as linear_op
from hybridserve.ops.reference import fp8 as reference
from hybridserve.ops.triton import fp8_linear, fp8_quant, gemv
from hybridserve.ops.triton import linear as gemv_linear
from hybridserve.ops.triton.gemv import Tiles

pytestmark = pytest.mark.heavy  # scheduled first: tests/conftest.py

MMA_SLACK = 2.0 ** -10 if ON_GPU else 0.0  # the W8A8 GEMM form's, of the products' magnitudes (module docstring)
HMMA_SLACK = 2.0 ** -16 if ON_GPU else 0.0  # the weight-only GEMM form's


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _weight(n: int, k: int, scheme: Fp8Scheme, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight [n, k] and its scales as the scheme keeps them at run time (per row, or per block), NaN
    after them in memory."""
    w = _randn(n, k, seed=seed, scale=k ** -0.5)
    if scheme.weight == "tensor":  # one checkpoint scale, kept per row
        values, scale = reference.quantize_weight_rows(w.flatten()[None])
        values, scale = values.view(n, k), scale.expand(n)
    else:
        values, scale = reference.quantize_weight(w, scheme)
    return values.to(DEVICE), nan_padded(scale.to(DEVICE))


def _scales(scheme: Fp8Scheme, scale: torch.Tensor) -> Fp8Scales:
    return Fp8Scales(scale, scheme, torch.tensor(0.011, device=DEVICE) if scheme.activation == "static" else None)


def _magnitudes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme,
                input_scale: torch.Tensor | None = None, weight_only: bool = False) -> torch.Tensor:
    """The sum of the magnitudes of each output's products (for the GEMM forms' slack on the GPU)."""
    x = x.float() if weight_only else reference.fake_quantize(x, scheme, input_scale)
    return (x.abs() @ dequantize(weight, scale, scheme).abs().T).double()


def _slack(x: torch.Tensor, weight: torch.Tensor, fp8: Fp8Scales, weight_only: bool) -> torch.Tensor:
    """A GEMM form's slack on the GPU: HMMA_SLACK weight-only, MMA_SLACK W8A8, of the products' magnitudes."""
    return (HMMA_SLACK if weight_only else MMA_SLACK) * _magnitudes(x, weight, fp8.scale, fp8.scheme, fp8.input_scale,
                                                                    weight_only)


def _assert_close(got: torch.Tensor, want: torch.Tensor, slack: torch.Tensor | float = 0.0) -> None:
    """Within one ulp of each other in got's dtype, plus 1e-5 of the largest value and `slack` (module docstring)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).abs()
    bound = want.double().abs() * 2.0 ** -MANTISSA_BITS[got.dtype] + 1e-5 * want.double().abs().max() + slack
    assert (err <= bound).all(), (err - bound).max()


# ----------------------------------------------------------------------------------------------------- e4m3 rounding


def _rounding_probe() -> torch.Tensor:
    """Every finite e4m3 value, each midpoint between neighbours and the fp32 values either side of it, the values
    the interpreter's own conversion gets wrong (1.96, 7.92), -0.0, random values over the range and near zero."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(-float("inf"))
    gen = torch.Generator().manual_seed(0)
    return torch.cat([values, mids, mids.nextafter(up), mids.nextafter(down), torch.tensor([1.96, 7.92, -0.0]),
                      (torch.rand(4000, generator=gen) * 2 - 1) * FP8_MAX, torch.randn(2000, generator=gen) * 0.01])


def test_rounding_equals_torch_on_every_edge() -> None:
    """The quantization launch with a static scale of 1 (x / 1 = x) rounds each value as torch's conversion."""
    x = _rounding_probe()
    q, _ = fp8_quant.quantize_activations(x[None].to(DEVICE), SCHEMES["tensor/static"],
                                          torch.tensor(1.0, device=DEVICE))
    assert torch.equal(q[0].cpu().view(torch.uint8), x.to(FP8_DTYPE).view(torch.uint8))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("scheme", ["channel/token", "block/group", "tensor/static"])
def test_quantization_launch_equals_reference(scheme: str, dtype: torch.dtype) -> None:
    """Bit for bit: e4m3 values and scales, rows of very different ranges, an all-zero row (floored scale: zeros),
    values beyond 448 times the static scale (clamped), 300 columns (a partial last group), x a column slice."""
    scheme = SCHEMES[scheme]
    wide = _randn(6, 310, seed=1)
    wide[1] *= 1e3
    wide[2] *= 1e-3
    wide[3] = 0
    x = wide[:, 5:305].to(DEVICE, dtype)
    input_scale = torch.tensor(0.004, device=DEVICE) if scheme.activation == "static" else None
    q, scales = fp8_quant.quantize_activations(x, scheme, input_scale)
    want_q, want_scales = reference.quantize_activations(x, scheme, input_scale)
    assert q.dtype == FP8_DTYPE and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_scales)


@pytest.mark.parametrize("scheme", ["channel/token", "block/group", "block/token", "tensor/static"])
def test_launches_take_x_as_the_reference(scheme: str) -> None:
    """Through an identity weight (e4m3 ones, unit scales) each output is one product: x itself in the weight-only
    GEMV and GEMM forms, q * scale as the reference's `fake_quantize` makes it in the W8A8 GEMM form, bit for bit in
    fp32."""
    scheme = SCHEMES[scheme]
    k = 300
    eye = torch.eye(k).to(DEVICE, FP8_DTYPE)
    ones = torch.ones(k if scheme.weight != "block" else (3, 3), device=DEVICE)
    fp8 = _scales(scheme, ones)
    x = _randn(3, k, seed=2).to(DEVICE)
    x[1] *= 50
    assert torch.equal(gemv_linear.linear(x, eye, fp8=fp8, config=Tiles(4, 64, 128, 2)), x)
    assert torch.equal(fp8_linear.gemm(x, eye, fp8, config=gemm_config(16, 64, 64), weight_only=True), x)
    assert torch.equal(fp8_linear.gemm(x, eye, fp8, config=gemm_config(16, 64, 64)),
                       reference.fake_quantize(x, scheme, fp8.input_scale))


@pytest.mark.parametrize("scheme", ["channel/token", "block/group"])
def test_gemv_widens_every_e4m3_value_exactly(scheme: str) -> None:
    """Every finite e4m3 byte, subnormals and -0 included, in each of the 4 byte lanes of a 32-bit word, comes out
    of the weight-only GEMV as its exact fp32 value: row r holds one value in lane r % 4 and zeros elsewhere, x is
    ones and the scales are 1 (on the GPU: no subnormal flushed by the integer widening's multiply)."""
    scheme = SCHEMES[scheme]
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[codes.view(FP8_DTYPE).float().isfinite()]
    rows = codes.numel() * 4
    weight = torch.zeros(rows, 4, dtype=torch.uint8)
    weight[torch.arange(rows), torch.arange(rows) % 4] = codes.repeat_interleave(4)
    weight = weight.view(FP8_DTYPE).to(DEVICE)
    ones = torch.ones(rows if scheme.weight != "block" else (-(-rows // 128), 1), device=DEVICE)
    got = gemv_linear.linear(torch.ones(1, 4, device=DEVICE), weight, fp8=_scales(scheme, ones))
    assert torch.equal(got[0].cpu(), codes.repeat_interleave(4).view(FP8_DTYPE).float())


# ----------------------------------------------------------------------------------------------------- products

# tokens, N, K, bias, GEMV tiles (None: the shape's own)
GEMV_CASES = {
    "one token, ragged N and K (partial last blocks), pipelined": (1, 150, 300, True, Tiles(1, 32, 128, 2)),
    "5 of 8 token lanes, chunks of two 128-column blocks": (5, 40, 400, False, Tiles(8, 4, 256, 2)),
    "16 tokens, one chunk longer than K": (16, 24, 100, True, Tiles(16, 8, 128, 1)),
    "2 tokens, one chunk of four 128-column pieces, the last past K": (2, 24, 300, True, Tiles(2, 8, 512, 1)),
    "default tiles": (3, 64, 200, False, None),
}
# tokens, N, K, bias, GEMM config (None: fp8_linear.gemm_config's)
GEMM_CASES = {
    "one token, 16x16 tiles, K tiles of 32": (1, 150, 300, True, gemm_config(16, 16, 32)),
    "40 tokens, the config of decode-like sizes": (40, 150, 300, False, None),
    "100 tokens, 32-row blocks grouped by 2": (100, 72, 200, True, gemm_config(32, 32, 64, 2)),
    "80 tokens, the config beyond 64 tokens": (80, 40, 130, True, None),
}


# tokens, N, K, bias, GEMM config: the weight-only GEMM (x as it is) at decode sizes
WEIGHT_ONLY_GEMM_CASES = {
    "5 tokens, 16x16 tiles, K tiles of 32, partial last blocks": (5, 150, 300, True, gemm_config(16, 16, 32)),
    "16 tokens, the config of decode-like sizes": (16, 150, 300, False, None),
    "3 tokens, 16x32 tiles, K tiles of 128": (3, 72, 260, True, gemm_config(16, 32, 128)),
}
FORMS = {"gemv": GEMV_CASES, "weight-only gemm": WEIGHT_ONLY_GEMM_CASES, "gemm": GEMM_CASES}
FORM_CASES = [(form, case) for form, cases in FORMS.items() for case in cases]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("form, case", FORM_CASES, ids=[f"{form}: {case}" for form, case in FORM_CASES])
def test_forms_match_reference(form: str, case: str, scheme: str, dtype: torch.dtype) -> None:
    tokens, n, k, has_bias, config = FORMS[form][case]
    scheme = SCHEMES[scheme]
    weight, scale = _weight(n, k, scheme, seed=n + k)
    x = _randn(tokens, k, seed=tokens).to(DEVICE, dtype)
    bias = _randn(n, seed=3).to(DEVICE, dtype) if has_bias else None
    fp8 = _scales(scheme, scale)

    def run() -> torch.Tensor:
        if form == "gemv":
            return gemv_linear.linear(x, weight, bias, config=config, fp8=fp8)
        return fp8_linear.gemm(x, weight, fp8, bias, config=config, weight_only=weight_only)

    weight_only = form != "gemm"
    got = run()
    slack = _slack(x, weight, fp8, weight_only) if form != "gemv" else 0.0
    want = reference.fp8_linear(x, weight, scale, scheme, bias, fp8.input_scale, weight_only=weight_only)
    _assert_close(got, want, slack)
    assert torch.equal(got, run())  # deterministic


@pytest.mark.parametrize("scheme", ["channel/token", "block/group"])
def test_strided_and_batched_x(scheme: str) -> None:
    """x rows further apart than K (a column slice) and leading dims [2, 3] flattened and restored, the three forms
    through `fp8_linear`; a last stride other than 1 takes its form on a copy."""
    scheme = SCHEMES[scheme]
    weight, scale = _weight(20, 136, scheme, seed=4)
    fp8 = _scales(scheme, scale)
    wide = _randn(136, 150, seed=5).to(DEVICE)
    for rows in (2, 6, 40):
        for x in (wide[:rows, 7:143], wide[:136, :rows].t()):  # the second: a unit row stride
            weight_only = linear_weight_only(x)
            slack = 0.0 if fp8_linear.takes_gemv(x) else _slack(x, weight, fp8, weight_only)
            _assert_close(fp8_linear.fp8_linear(x, weight, scale, scheme),
                          reference.fp8_linear(x, weight, scale, scheme, weight_only=weight_only), slack)
    batched = fp8_linear.fp8_linear(wide[:6, 7:143].reshape(2, 3, 136), weight, scale, scheme)
    assert batched.shape == (2, 3, 20) and torch.equal(batched.reshape(6, 20),
                                                       fp8_linear.fp8_linear(wide[:6, 7:143], weight, scale, scheme))


def test_one_token_of_pipelined_e4m3_rows_takes_half_tiles_twice_as_deep() -> None:
    """One token against e4m3 rows of several K chunks: half-sized product tiles (twice the programs) at the
    experts' e4m3 depth. Rows of one chunk, several tokens and 16-bit weights keep `gemv.tiles`' choice."""
    block = Fp8Scales(torch.ones(1), SCHEMES["block/group"])
    rows = Fp8Scales(torch.ones(1), SCHEMES["channel/token"])
    for fp8 in (block, rows):
        for n, k in ((16384, 4096), (4096, 4096), (4096, 1024)):  # Ling-2.6-flash's Q|K|V|G, o_proj, shared down
            chosen = gemv_linear.linear_tiles(1, n, k, fp8)
            as_16_bit = gemv.tiles(1, n, k, min_chunk=gemv.min_chunk(fp8))
            assert as_16_bit.STAGES == gemv.PIPELINE_STAGES and chosen.STAGES == 2 * gemv.PIPELINE_STAGES
            assert chosen.BN * chosen.BK == gemv_linear.E4M3_TILE_ELEMENTS == gemv.TILE_ELEMENTS // 2
            assert chosen.BK >= gemv.min_chunk(fp8) and -(-n // chosen.BN) >= gemv.PROGRAMS
        # one token of one-chunk rows (ZAYA1-8B's q|k|v|v), then several tokens
        for tokens, n, k in ((1, 1536, 2048), (4, 16384, 4096), (16, 4096, 4096)):
            as_16_bit = gemv.tiles(tokens, n, k, min_chunk=gemv.min_chunk(fp8))
            assert gemv_linear.linear_tiles(tokens, n, k, fp8) == as_16_bit
    assert gemv_linear.linear_tiles(1, 16384, 4096) == gemv.tiles(1, 16384, 4096)


def test_bad_input_is_refused() -> None:
    weight, scale = _weight(20, 200, SCHEMES["block/group"], seed=6)
    block = _scales(SCHEMES["block/group"], scale)
    x = _randn(2, 200, seed=7).to(DEVICE)
    with pytest.raises(ValueError, match="input_scale"):
        fp8_linear.fp8_linear(x, weight, scale, Fp8Scheme("block", "static", BLOCK))
    with pytest.raises(ValueError, match="128x128"):
        fp8_linear.fp8_linear(x, weight, scale, Fp8Scheme("block", "group", (64, 64)))
    with pytest.raises(ValueError, match="fp32 scales"):
        fp8_linear.fp8_linear(x, weight, scale[:, :1], SCHEMES["block/group"])
    with pytest.raises(ValueError, match="split the 128-column"):
        gemv_linear.linear(x, weight, fp8=block, config=Tiles(2, 4, 64, 2))
    with pytest.raises(ValueError, match="BLOCK_K"):
        fp8_linear.gemm(x, weight, block, config=gemm_config(16, 16, 256))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear.gemm(x, weight.float(), block)
    assert fp8_linear.fp8_linear(x[:0], weight, scale, SCHEMES["block/group"]).shape == (0, 20)
    assert fp8_linear.gemm(x[:0], weight, block).shape == (0, 20)


def test_weight_only_gemm_tiles_stay_narrow() -> None:
    """The weight-only form (3-16 tokens) cuts the columns 32 wide, or 16 where 32 gives under 128 programs (an
    H100's tune-fp8-linear: wider tiles lost on every Ling-2.6-flash shape); the W8A8 form starts at 128."""
    for n, block_n in ((2048, 16), (4096, 32), (16384, 32), (18432, 32)):
        for tokens in (3, WEIGHT_ONLY_MAX_ROWS):
            config = fp8_linear.gemm_config(tokens, n, weight_only=True)
            assert (config["BLOCK_N"], config["BLOCK_M"]) == (block_n, 16), (n, tokens)
    for tokens in (3, WEIGHT_ONLY_MAX_ROWS, WEIGHT_ONLY_MAX_ROWS + 1):
        assert fp8_linear.gemm_config(tokens, 16384)["BLOCK_N"] == 128


# ----------------------------------------------------------------------------------------------------- entry points


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("scheme", ["channel/token", "block/group"])
def test_norm_epilogue_equals_the_norm_kernel(scheme: str, dtype: torch.dtype) -> None:
    """The GEMV launch's residual norm after an FP8 projection: what the standalone norm kernel makes of the
    stored update (bit for bit where tests/ops/test_decode_gemv_kernel.py requires it)."""
    scheme = SCHEMES[scheme]
    weight, scale = _weight(40, 136, scheme, seed=8)
    fp8 = _scales(scheme, scale)
    x = _randn(3, 136, seed=9).to(DEVICE, dtype)
    config = Tiles(4, 8, 128, 2)  # five programs
    norm = _residual_norm(3, 40, dtype, seed=10, skip=True, fp32_copy=True)
    want = _standalone(norm, gemv_linear.linear(x, weight, config=config, fp8=fp8))
    _assert_same(gemv_linear.linear(x, weight, config=config, norm=norm, fp8=fp8), want, _exact(dtype))


@pytest.mark.parametrize("scheme", ["channel/token", "block/group"])
def test_gemv_finishes_a_pending_norm(scheme: str) -> None:
    """An FP8 projection of a PendingNorm's h, made in the GEMV launch (the word path reads each x lane with its
    norm weight): what it gives for PendingNorm.h(), up to fp32 sum-order differences."""
    scheme = SCHEMES[scheme]
    weight, scale = _weight(40, 256, scheme, seed=12)
    fp8 = _scales(scheme, scale)
    pending = _pending(3, 256, 4, torch.float32, seed=13)
    config = Tiles(4, 8, 128, 2)
    want = gemv_linear.linear(pending.h(), weight, config=config, fp8=fp8)
    got = gemv_linear.linear(pending, weight, config=config, fp8=fp8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_entry_points_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_linear: the GEMV form up to E4M3_GEMV_MAX_TOKENS rows (a last stride other than 1 on a copy), the
    weight-only GEMM up to WEIGHT_ONLY_MAX_ROWS, the W8A8 GEMM beyond; ops.linear: the kernels where the backend
    says so (the norm in the GEMV launch, and a pending norm only where the GEMV runs), the reference otherwise,
    weight-only at the same sizes."""
    scheme = SCHEMES["channel/token"]
    weight, scale = _weight(8, 16, scheme, seed=11)
    fp8 = _scales(scheme, scale)
    calls: list[str] = []
    monkeypatch.setattr(gemv_linear, "linear", lambda *a, **k: calls.append("gemv" + ("+norm" * ("norm" in k))))
    monkeypatch.setattr(fp8_linear, "gemm", lambda *a, **k: calls.append("gemm" + "/x as is" * k["weight_only"]))
    most, gemv_most = WEIGHT_ONLY_MAX_ROWS, gemv_linear.E4M3_GEMV_MAX_TOKENS
    for tokens in (1, gemv_most, gemv_most + 1, most, most + 1):
        fp8_linear.fp8_linear(torch.zeros(tokens, 16, device=DEVICE), weight, scale, scheme)
    fp8_linear.fp8_linear(torch.zeros(16, 2, device=DEVICE).t(), weight, scale, scheme)  # last stride 2
    assert calls == ["gemv", "gemv", "gemm/x as is", "gemm/x as is", "gemm", "gemv"]
    x = torch.zeros(gemv_most, 16, device=DEVICE)
    norm = _residual_norm(gemv_most, 8, torch.float32, seed=12, skip=False, fp32_copy=False)
    monkeypatch.setattr(backends, "use_triton", lambda op, device: op == "fp8_linear")
    calls.clear()
    linear_op.linear(x, weight, fp8=fp8)
    linear_op.linear_residual_norm(x, weight, None, norm, fp8)
    assert calls == ["gemv", "gemv+norm"]
    assert [linear_op.takes_pending(t, weight, fp8) for t in (gemv_most, gemv_most + 1)] == [True, False]
    monkeypatch.setattr(backends, "use_triton", lambda op, device: False)
    assert torch.equal(linear_op.linear(x, weight, fp8=fp8), reference.fp8_linear(x, weight, scale, scheme,
                                                                                  weight_only=True))
    wide = torch.ones(most + 1, 16, device=DEVICE)
    assert torch.equal(linear_op.linear(wide, weight, fp8=fp8), reference.fp8_linear(wide, weight, scale, scheme))
    assert calls == ["gemv", "gemv+norm"]
