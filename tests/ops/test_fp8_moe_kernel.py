"""FP8 (e4m3) routed experts (`ops.triton.fp8_moe`: the weight-only GEMV decode form through `ops.triton.moe_gemv`,
the W8A8 grouped form) vs `ops.reference.fp8.fp8_fused_experts` (weight-only for the GEMV form); the entry points'
switches.

Why most data here are a lattice. In W8A8 the SwiGLU rows are quantized again before the down projection, and a
value within an fp32 rounding of an e4m3 midpoint rounds one way or the other depending on the order of its gate and
up sums (and on SiLU's formula): a one-step change of one activation, which moves its token's whole output row by about 1% at
these widths. No tight bound holds on random data. So the exactness tests take x and gate/up weights whose e4m3
values are small integers (x: |q| <= 4, and 448 on the first column of each 128-column group, so every dynamic
scale is exactly 2^-4; gate/up weights |q| <= 1, the gates' column 0 14) with power-of-two weight scales: every
gate/up product and partial sum is an integer below 2^13, exact in fp32 in any order (and in the FP8 tensor cores'
narrower accumulator on the GPU), and the gates lie in [146, 442], where SiLU(g) = g exactly in fp32 (exp(-g)
underflows). Kernel and reference then make the same SwiGLU bits, hence the same e4m3 values for the down
projection, whose weights are random. What remains is the fp32 order of the down sums and the roundings of rows:
- fp32: nothing rounds but fp32 arithmetic: 1e-5 of the largest output;
- 16-bit dtypes: the kernels round each of a token's K weighted rows to x's dtype before their fp32 sum and round
  that once (the 16-bit kernels' contract, which `reduce=False` hands to the consumer), the reference rounds once:
  |got - want| <= 2^-m (sum_k |row_k| + |want|) + 1e-5 max|want|, the rows taken from the reference choice by choice.
On the GPU the grouped form's down GEMM adds its products in the FP8 tensor cores' narrower accumulator (a BLOCK_K
tile at a time, then in fp32): 2^-8 of the largest output more there. Random data (negative gates, SiLU's curve,
arbitrary magnitudes) are held to a norm-relative error of 1e-2: room for one-step flips, while a wrong row, expert or
scale costs far more.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tests.ops.conftest import DEVICE, KERNEL_DTYPES, ON_GPU
from tests.ops.fp8_cases import BLOCK, MANTISSA_BITS, SCHEMES, gemm_config, nan_padded
from tests.ops.test_decode_gemv_kernel import _assert_same, _exact, _residual_norm, _standalone
from hybridserve.core.quant import FP8_DTYPE, WEIGHT_ONLY_MAX_PAIRS, Fp8Scales, Fp8Scheme
from hybridserve.ops import backends
from hybridserve.ops import moe as moe_op
from hybridserve.ops.reference import fp8 as reference
from hybridserve.ops.triton import fp8_moe, gemv, moe_gemv, pdl
from hybridserve.ops.triton.gemv import Tiles

X_SCALE = 2.0 ** -4  # every dynamic scale of lattice x (448 * 2^-4 on each group's first column), and the static one
DOWN_STATIC_SCALE = 64.0  # the static scale of the SwiGLU rows (lattice gates up to 442 times ups up to 50)
MMA_SLACK = 2.0 ** -8 if ON_GPU else 0.0  # the grouped form's, of the largest output (module docstring)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _leading(hidden: int) -> torch.Tensor:
    """The first column of each 128-column group."""
    return torch.arange(hidden) % BLOCK[1] == 0


def _lattice_x(tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    q = torch.randint(-4, 5, (tokens, hidden), generator=_gen(seed)).float()
    q[:, _leading(hidden)] = 448.0
    return (q * X_SCALE).to(DEVICE, dtype)


def _power_of_two_scales(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return 2.0 ** -torch.randint(0, 2, shape, generator=_gen(seed)).float()


def _stack_scales(scheme: Fp8Scheme, experts: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Power-of-two scales of a lattice stack as the scheme keeps them, NaN after them in memory."""
    if scheme.weight == "block":
        scales = _power_of_two_scales((experts, -(-rows // BLOCK[0]), -(-cols // BLOCK[1])), seed)
    elif scheme.weight == "tensor":  # one per expert's checkpoint tensor, kept per row
        scales = _power_of_two_scales((experts, 1), seed).expand(experts, rows)
    else:
        scales = _power_of_two_scales((experts, rows), seed)
    return nan_padded(scales.to(DEVICE))


def _random_stack(experts: int, rows: int, cols: int, scheme: Fp8Scheme, seed: int):
    """e4m3 weights [E, rows, cols] of random values and their scales as the scheme keeps them (NaN after them)."""
    w = torch.randn(experts, rows, cols, generator=_gen(seed)) * cols ** -0.5
    values, scales = zip(*(reference.quantize_weight(w[e], scheme) for e in range(experts)))
    return torch.stack(values).to(DEVICE), nan_padded(torch.stack(scales).to(DEVICE))


def _lattice_stacks(experts: int, hidden: int, inter: int, scheme: Fp8Scheme, seed: int):
    """(w13, s13, w2, s2): gate/up on the lattice of the module docstring, down random."""
    assert hidden <= 2 * BLOCK[1]  # keeps every gate/up partial sum below 2^13 and the gates above 110
    lead = _leading(hidden)
    gate = torch.randint(-1, 2, (experts, inter, hidden), generator=_gen(seed)).float()
    gate[..., lead] = 0.0
    gate[..., 0] = 14.0
    up = torch.randint(-1, 2, (experts, inter, hidden), generator=_gen(seed + 1)).float()
    up[..., lead] = 0.0
    w13 = torch.cat([gate, up], dim=1).to(DEVICE, FP8_DTYPE)
    s13 = _stack_scales(scheme, experts, 2 * inter, hidden, seed + 2)
    return (w13, s13, *_random_stack(experts, hidden, inter, scheme, seed + 3))


def _input_scales(scheme: Fp8Scheme) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if scheme.activation != "static":
        return None, None
    return torch.tensor(X_SCALE, device=DEVICE), torch.tensor(DOWN_STATIC_SCALE, device=DEVICE)


def _scales(s13: torch.Tensor, s2: torch.Tensor, scheme: Fp8Scheme) -> tuple[Fp8Scales, Fp8Scales]:
    up_static, down_static = _input_scales(scheme)
    return Fp8Scales(s13, scheme, up_static), Fp8Scales(s2, scheme, down_static)


def _routing_weights(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return (0.1 + 0.9 * torch.rand(shape, generator=_gen(seed))).to(DEVICE)


def _run(form: str, x, w13, w2, ids, weights, fp8, reduce: bool, config):
    """The experts in one form; `config`: (GEMV tiles, grouped config), either None for the defaults."""
    if form == "gemv":
        return moe_gemv.fused_experts(x, w13, w2, ids, weights, reduce=reduce, config=config[0], fp8=fp8)
    return fp8_moe.grouped_experts(x, w13, w2, ids, weights, fp8, reduce, config[1])


def _reference(form: str, x, w13, s13, w2, s2, ids, weights, scheme) -> torch.Tensor:
    """The reference of `form`: weight-only for the GEMV form, W8A8 for the grouped one."""
    return reference.fp8_fused_experts(x, w13, s13, w2, s2, ids, weights, scheme, _input_scales(scheme),
                                       weight_only=form == "gemv")


def _choice_sum(rows: torch.Tensor) -> torch.Tensor:
    """[T, K, H] rows summed in choice order in fp32 (what ops.ling_norm.add_rms_norm does with them)."""
    total = rows[:, 0].float()
    for k in range(1, rows.shape[1]):
        total = total + rows[:, k].float()
    return total


def _check_lattice(form: str, x, w13, s13, w2, s2, ids, weights, scheme, config) -> None:
    """Reduced and unreduced outputs vs the reference within the module docstring's bounds; the unreduced rows
    summed in choice order and rounded once equal the reduced output (bit for bit in 16-bit dtypes)."""
    fp8 = _scales(s13, s2, scheme)
    got = _run(form, x, w13, w2, ids, weights, fp8, True, config)
    rows = _run(form, x, w13, w2, ids, weights, fp8, False, config)
    assert got.shape == x.shape and rows.shape == (*ids.shape, x.shape[1]) and got.dtype == rows.dtype == x.dtype
    want = _reference(form, x, w13, s13, w2, s2, ids, weights, scheme).double()
    alone = [_reference(form, x, w13, s13, w2, s2, ids[:, k:k + 1], weights[:, k:k + 1], scheme).double()
             for k in range(ids.shape[1])]
    ulp, slack = 2.0 ** -MANTISSA_BITS[x.dtype], (1e-5 + (MMA_SLACK if form == "grouped" else 0)) * want.abs().max()
    for k, row in enumerate(alone):
        assert ((rows[:, k].double() - row).abs() <= ulp * row.abs() + slack).all(), k
    bound = (ulp * (sum(row.abs() for row in alone) + want.abs()) if x.dtype != torch.float32 else 0) + slack
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() - bound).max()
    total = _choice_sum(rows)
    if x.dtype == torch.float32:  # no rounding between a row's product and the sum: the GPU may fuse them (FMA)
        torch.testing.assert_close(got, total, rtol=1e-6, atol=1e-6 * total.abs().max().item())
    else:
        assert torch.equal(total.to(x.dtype), got)


# experts, hidden, inter, expert ids [T][K], (GEMV tiles (gate/up, down), grouped config); at most MAX_PAIRS pairs
CASES = {
    "one token top-1 on the last expert, ragged H and I, partial blocks, a gate/up chunk past H": (
        4, 200, 72, [[3]], ((Tiles(1, 16, 512, 1), Tiles(1, 64, 128, 1)), gemm_config(16, 32, 64))),
    "top-2, experts repeated across tokens and within one, two unchosen": (
        6, 136, 72, [[1, 4], [4, 1], [1, 1], [0, 5]],
        ((Tiles(1, 128, 128, 2), Tiles(1, 128, 128, 1)), gemm_config(16, 64, 128))),
    "5 tokens top-1, default tiles": (8, 136, 32, [[e % 3 * 2] for e in range(5)], (None, None)),
}


# In fp32 every scheme but block/token (its pieces are covered by the others here and by the linear tests), the two
# checkpoint formats' in the 16-bit dtypes; the default tiles in two of them (the interpreter's run time).
SCHEME_DTYPES = [(scheme, torch.float32) for scheme in SCHEMES if scheme != "block/token"] + [
    (scheme, dtype) for dtype in KERNEL_DTYPES if dtype != torch.float32 for scheme in ("channel/token", "block/group")]
DEFAULT_TILE_SCHEME_DTYPES = [("channel/token", torch.float32), ("block/group", KERNEL_DTYPES[-1])]
FORM_CASES = [(form, case, scheme, dtype) for form in ("gemv", "grouped") for case in CASES
              for scheme, dtype in (SCHEME_DTYPES if CASES[case][4] != (None, None) else DEFAULT_TILE_SCHEME_DTYPES)]


@pytest.mark.parametrize("form, case, scheme, dtype", FORM_CASES,
                         ids=[f"{f}: {c}-{s}-{d}".replace("torch.", "") for f, c, s, d in FORM_CASES])
def test_forms_match_reference(form: str, case: str, scheme: str, dtype: torch.dtype) -> None:
    experts, hidden, inter, table, config = CASES[case]
    scheme = SCHEMES[scheme]
    ids = torch.tensor(table, device=DEVICE)
    w13, s13, w2, s2 = _lattice_stacks(experts, hidden, inter, scheme, seed=len(table))
    x = _lattice_x(ids.shape[0], hidden, dtype, seed=11)
    _check_lattice(form, x, w13, s13, w2, s2, ids, _routing_weights(ids.shape, seed=12), scheme, config)


@pytest.mark.parametrize("scheme, dtype", [("channel/token", torch.float32), ("block/static", torch.float32),
                                           ("block/group", torch.float16)])
def test_grouped_form_many_tokens(scheme: str, dtype: torch.dtype) -> None:
    """14 tokens top-2 over 3 of 8 experts (the others empty): 16-row blocks, several a used expert, grouped by 2."""
    scheme = SCHEMES[scheme]
    gen = _gen(13)
    ids = torch.tensor([2, 5, 7])[torch.rand(14, 3, generator=gen).topk(2, dim=-1).indices].to(DEVICE)
    w13, s13, w2, s2 = _lattice_stacks(8, 136, 136, scheme, seed=14)
    x = _lattice_x(14, 136, dtype, seed=15)
    _check_lattice("grouped", x, w13, s13, w2, s2, ids, _routing_weights(ids.shape, seed=16), scheme,
                   (None, gemm_config(16, 32, 64, 2)))


@pytest.mark.parametrize("form", ["gemv", "grouped"])
@pytest.mark.parametrize("scheme", ["channel/token", "block/group"])
def test_random_data_norm_error(form: str, scheme: str) -> None:
    """Random x and weights (module docstring: norm-relative error at most 1e-2), top-2 of 6, fp32."""
    scheme = SCHEMES[scheme]
    w13, s13 = _random_stack(6, 144, 160, scheme, seed=17)
    w2, s2 = _random_stack(6, 160, 72, scheme, seed=18)
    ids = torch.tensor([[0, 3], [5, 3], [2, 1], [4, 0]], device=DEVICE)
    weights = _routing_weights(ids.shape, seed=19)
    x = torch.randn(4, 160, generator=_gen(20)).to(DEVICE)
    got = _run(form, x, w13, w2, ids, weights, _scales(s13, s2, scheme), True, (None, None))
    want = _reference(form, x, w13, s13, w2, s2, ids, weights, scheme)
    assert ((got - want).norm() / want.norm()).item() <= 1e-2


@pytest.mark.parametrize("form", ["gemv", "grouped"])
def test_skip_rows_are_exact_zeros(form: str) -> None:
    """ZAYA1's MOD skip (expert 0 at weight 0.0) gives exact zero rows even with expert 0's e4m3 weights and
    scales NaN (the GEMV form reads none of them, the grouped form's weighted store zeroes them); the other
    tokens as the reference on clean weights."""
    scheme = SCHEMES["block/group"]
    w13, s13, w2, s2 = _lattice_stacks(4, 136, 72, scheme, seed=21)
    poisoned = [t.clone() for t in (w13, s13, w2, s2)]
    for t in poisoned:
        t[0] = float("nan")
    ids = torch.tensor([[0], [2], [0], [3], [1], [0]], device=DEVICE)
    weights = torch.tensor([[0.0], [0.7], [0.0], [0.4], [0.9], [0.0]], device=DEVICE)
    x = _lattice_x(6, 136, torch.float32, seed=22)
    skip = (ids == 0)[:, 0]
    w13p, s13p, w2p, s2p = poisoned
    for reduce in (True, False):
        got = _run(form, x, w13p, w2p, ids, weights, _scales(s13p, s2p, scheme), reduce, (None, None))
        assert not got[skip].any() and not got.isnan().any()
    _check_lattice(form, x[~skip], w13, s13, w2, s2, ids[~skip], weights[~skip], scheme, (None, None))


@triton.jit
def _no_wait(USE_PDL: tl.constexpr):
    pass


@pytest.mark.skipif(ON_GPU, reason="on the GPU test_skip_rows_are_exact_zeros runs this form (PDL is on there)")
def test_gemv_skip_rows_read_nothing_in_the_pdl_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """test_skip_rows_are_exact_zeros through the down launch's PDL form, which the GPU runs and the interpreter
    otherwise never does: one choice a token, the weights loaded before the wait, so a skip pair masks its loads
    (weights, block scales, act) instead of branching around them. Here with the wait a no-op (the interpreter has
    no griddepcontrol)."""
    monkeypatch.setattr(pdl, "launch", lambda device: {"USE_PDL": True})
    monkeypatch.setattr(gemv, "wait_for_previous", _no_wait)
    monkeypatch.setattr(moe_gemv, "wait_for_previous", _no_wait)
    test_skip_rows_are_exact_zeros("gemv")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_gemv_norm_epilogue_equals_the_norm_kernel(dtype: torch.dtype) -> None:
    """The residual norm in the FP8 down launch, row by row (a skip token among them): what the standalone norm
    kernel makes of the stored update."""
    scheme = SCHEMES["channel/token"]
    w13, s13, w2, s2 = _lattice_stacks(4, 136, 72, scheme, seed=23)
    fp8 = _scales(s13, s2, scheme)
    ids = torch.tensor([[2], [0], [1]], device=DEVICE)
    weights = torch.tensor([[0.8], [0.0], [0.5]], device=DEVICE)
    x = _lattice_x(3, 136, dtype, seed=24)
    config = (Tiles(1, 32, 128, 2), Tiles(1, 64, 128, 2))  # three down programs a row, the last one ragged
    norm = _residual_norm(3, 136, dtype, seed=25, skip=True, fp32_copy=False)
    want = _standalone(norm, moe_gemv.fused_experts(x, w13, w2, ids, weights, config=config, fp8=fp8))
    _assert_same(moe_gemv.fused_experts(x, w13, w2, ids, weights, config=config, norm=norm, fp8=fp8), want,
                 _exact(dtype))


def test_e4m3_pipelined_tiles_keep_the_bytes_in_flight() -> None:
    """e4m3 experts' pipelined tiles run twice the 16-bit stages (a chunk of half the bytes); one-chunk tiles stay
    unpipelined and 16-bit experts keep theirs."""
    block = Fp8Scales(torch.ones(1), SCHEMES["block/group"])
    rows = Fp8Scales(torch.ones(1), SCHEMES["channel/token"])
    # Ling-2.6-flash's widths, 8 choices a token: 32 rows x 256 e4m3 a chunk (8 KB), 8 chunks in flight
    assert moe_gemv.gate_up_tiles(1024, 4096, block, top_k=8) == Tiles(1, 32, 256, 2 * gemv.PIPELINE_STAGES)
    assert moe_gemv.down_tiles(4096, 1024, block, top_k=8) == Tiles(1, 32, 256, 2 * gemv.PIPELINE_STAGES)
    for fp8 in (block, rows):  # ZAYA1-8B's widths, one choice a token
        assert moe_gemv.gate_up_tiles(2048, 2048, fp8).STAGES == 2 * gemv.PIPELINE_STAGES
    assert moe_gemv.gate_up_tiles(1024, 4096, top_k=8).STAGES == gemv.PIPELINE_STAGES  # 16-bit: as `tiles` gives
    assert moe_gemv.gate_up_tiles(4, 128, block).STAGES == 1  # a K of one chunk: nothing to pipeline


def test_bad_input_is_refused() -> None:
    scheme = SCHEMES["block/static"]
    w13, s13, w2, s2 = _lattice_stacks(2, 136, 72, scheme, seed=26)
    x = _lattice_x(1, 136, torch.float32, seed=27)
    ids, weights = torch.zeros(1, 1, dtype=torch.long, device=DEVICE), torch.ones(1, 1, device=DEVICE)
    up_static = torch.tensor(X_SCALE, device=DEVICE)
    for form in ("gemv", "grouped"):
        with pytest.raises(ValueError, match="input_scale"):  # the down projection's static scale missing
            _run(form, x, w13, w2, ids, weights, (Fp8Scales(s13, scheme, up_static), Fp8Scales(s2, scheme)), True,
                 (None, None))
        with pytest.raises(ValueError, match="fp32 scales"):
            _run(form, x, w13, w2, ids, weights, _scales(s13[:, :1], s2, scheme), True, (None, None))
    assert fp8_moe.grouped_experts(x[:0], w13, w2, ids[:0], weights[:0], _scales(s13, s2, scheme),
                                   reduce=False).shape == (0, 1, 136)


def test_entry_points_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_moe.fused_experts: the GEMV form up to WEIGHT_ONLY_MAX_PAIRS pairs, the grouped form beyond; ops.moe: the
    FP8 kernels where the backend says so (the norm in the GEMV launch), the reference otherwise ([T, 1, H]
    unreduced), weight-only at the same sizes."""
    scheme = SCHEMES["channel/token"]
    w13, s13, w2, s2 = _lattice_stacks(4, 16, 8, scheme, seed=28)
    fp8 = _scales(s13, s2, scheme)
    calls: list[str] = []
    monkeypatch.setattr(moe_gemv, "fused_experts",
                        lambda *a, **k: calls.append("gemv" + ("+norm" * ("norm" in k)) + ("+fp8" * ("fp8" in k))))
    monkeypatch.setattr(fp8_moe, "grouped_experts", lambda *a, **k: calls.append("grouped"))
    for tokens in (WEIGHT_ONLY_MAX_PAIRS // 2, WEIGHT_ONLY_MAX_PAIRS // 2 + 1):
        ids = torch.zeros(tokens, 2, dtype=torch.long, device=DEVICE)
        fp8_moe.fused_experts(torch.zeros(tokens, 16, device=DEVICE), w13, s13, w2, s2, ids, ids.float(), scheme)
    assert calls == ["gemv+fp8", "grouped"]
    x, ids, weights = _lattice_x(2, 16, torch.float32, seed=29), torch.tensor([[1], [3]], device=DEVICE), \
        torch.tensor([[0.5], [0.25]], device=DEVICE)
    norm = _residual_norm(2, 16, torch.float32, seed=30, skip=False, fp32_copy=False)
    monkeypatch.setattr(backends, "use_triton", lambda op, device: op == "fp8_moe")
    calls.clear()
    moe_op.fused_experts(x, w13, w2, ids, weights, fp8=fp8)
    moe_op.fused_experts_residual_norm(x, w13, w2, ids, weights, norm, fp8)
    assert calls == ["gemv+fp8", "gemv+norm+fp8"]
    monkeypatch.setattr(backends, "use_triton", lambda op, device: False)
    want = reference.fp8_fused_experts(x, w13, s13, w2, s2, ids, weights, scheme, weight_only=True)
    assert torch.equal(moe_op.fused_experts(x, w13, w2, ids, weights, reduce=False, fp8=fp8), want[:, None])
    many = torch.tensor([[1]] * (WEIGHT_ONLY_MAX_PAIRS + 1), device=DEVICE)
    x = _lattice_x(many.shape[0], 16, torch.float32, seed=31)
    assert torch.equal(moe_op.fused_experts(x, w13, w2, many, many.float(), fp8=fp8),
                       reference.fp8_fused_experts(x, w13, s13, w2, s2, many, many.float(), scheme))
    assert calls == ["gemv+fp8", "gemv+norm+fp8"]
