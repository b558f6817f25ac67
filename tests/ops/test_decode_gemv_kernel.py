"""Decode GEMV kernels: the dense small-M linear (`ops.triton.linear`) vs F.linear, and the few-pair routed experts
(`ops.triton.moe_gemv`) vs the MoE reference; the op entry points' switches.

Tolerances. Both kernels multiply in fp32 (exact for 16-bit operands) and accumulate in fp32, so against an fp64
reference on the same inputs they differ by the fp32 sum order (~1e-7 relative) plus their roundings:
- linear: one rounding to the output dtype, so every element lies within one unit in the last place of its
  exact value (fp32: 1e-5 of the largest output instead, the sum order alone);
- experts: the reference in fp32 on the rounded inputs, as tests/ops/test_moe_kernel.py, relative to the largest
  output: fp32 1e-5; fp16 4e-3 (SwiGLU activations, weighted rows and their sum each rounded to fp16).
Shapes are small with explicit tiles (the interpreter runs every program in Python) chosen to hit every edge:
ragged last column block and K chunk, pipelined and single-chunk K loops, masked token lanes, T = 1 to the bound.

The residual-norm epilogue (`ops.norm.ResidualNorm` run by the last program of a launch or row) must give what the
standalone norm kernel gives on the stored update: bit for bit in 16-bit dtypes (the same code on the same rounded
bits); in fp32 on the GPU, where nothing rounds the update, the two compiled kernels may contract other products
into FMAs (measured on the H200: ulp-level differences), so 1e-6 relative there (the interpreter: bit for bit).
"""
from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import triton

from tests.ops.conftest import DEVICE, KERNEL_DTYPES, ON_GPU
from hybridserve.ops import backends
from hybridserve.ops import linear as linear_op
from hybridserve.ops import moe as moe_op
from hybridserve.ops.norm import PendingNorm, ResidualNorm
from hybridserve.ops.reference import moe as reference
from hybridserve.ops.triton import linear as linear_kernel
from hybridserve.ops.triton import norm as norm_kernel
from hybridserve.ops.triton.counters import arrival_counters
from hybridserve.ops.triton import moe as grouped
from hybridserve.ops.triton import moe_gemv
from hybridserve.ops.triton.gemv import Tiles, tiles

MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}
MOE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def _assert_one_rounding(got: torch.Tensor, exact: torch.Tensor) -> None:
    """Every element within one ulp of the exact (fp64) value in got's dtype; fp32: 1e-5 of the largest value."""
    err = (got.double() - exact).abs()
    if got.dtype == torch.float32:
        assert err.max() <= 1e-5 * exact.abs().max(), err.max()
    else:
        ulp = exact.abs() * 2.0 ** -MANTISSA_BITS[got.dtype]
        assert (err <= ulp + 1e-6 * exact.abs().max()).all(), (err - ulp).max()


# ----------------------------------------------------------------------------------------------------- linear

# tokens, N, K, bias, tiles (None: the shape's own `gemv.tiles`)
LINEAR_CASES = {
    "one token, ragged N and K, pipelined": (1, 37, 100, True, Tiles(1, 8, 32, 2)),
    "5 of 8 token lanes, 4-row blocks": (5, 20, 48, False, Tiles(8, 4, 16, 3)),
    "16 tokens, one block wider than N, one chunk longer than K": (16, 9, 40, True, Tiles(16, 16, 64, 1)),
    "default tiles": (3, 24, 64, True, None),
}


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_linear_matches_reference(case: str, dtype: torch.dtype) -> None:
    tokens, n, k, has_bias, config = LINEAR_CASES[case]
    x = _randn(tokens, k, seed=1, dtype=dtype)
    w = _randn(n, k, seed=2, dtype=dtype, scale=k ** -0.5)
    b = _randn(n, seed=3, dtype=dtype) if has_bias else None
    got = linear_kernel.linear(x, w, b, config)
    assert got.shape == (tokens, n) and got.dtype == dtype
    _assert_one_rounding(got, F.linear(x.double(), w.double(), None if b is None else b.double()))
    assert torch.equal(got, linear_kernel.linear(x, w, b, config))  # deterministic


def test_ling_router_logits_in_one_preloaded_chunk() -> None:
    """Ling-2.6-flash's router logits (ops.linear takes fp32 weights too): 256 experts of 4096 fp32 at one token are
    rows of one K chunk, 2 a program (the tile a program loads before the PDL wait), within 1e-5 of the exact value."""
    x = _randn(1, 4096, seed=40, dtype=torch.float32)
    w = _randn(256, 4096, seed=41, dtype=torch.float32, scale=4096 ** -0.5)
    assert tiles(1, 256, 4096) == Tiles(1, 2, 4096, 1)
    _assert_one_rounding(linear_kernel.linear(x, w), F.linear(x.double(), w.double()))


def test_linear_strided_and_batched_inputs() -> None:
    """x rows further apart than K (a column slice), and leading dims [2, 3] flattened to 6 tokens and back."""
    wide = _randn(6, 80, seed=4, dtype=torch.float32)
    w = _randn(12, 64, seed=5, dtype=torch.float32, scale=0.125)
    config = Tiles(8, 4, 32, 2)
    sliced = linear_kernel.linear(wide[:, 8:72], w, None, config)
    _assert_one_rounding(sliced, F.linear(wide[:, 8:72].double(), w.double()))
    batched = linear_kernel.linear(wide[:, 8:72].reshape(2, 3, 64), w, None, config)
    assert batched.shape == (2, 3, 12) and torch.equal(batched.reshape(6, 12), sliced)


def test_linear_rejects_bad_input() -> None:
    w = _randn(8, 16, seed=6, dtype=torch.float16)
    x = _randn(2, 16, seed=7, dtype=torch.float16)
    with pytest.raises(ValueError, match="at most"):
        linear_kernel.linear(_randn(linear_kernel.MAX_TOKENS + 1, 16, seed=8, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="float32"):
        linear_kernel.linear(x.float(), w)
    with pytest.raises(ValueError, match="bias"):
        linear_kernel.linear(x, w, _randn(9, seed=9, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous weight"):
        linear_kernel.linear(x, _randn(16, 8, seed=10, dtype=torch.float16).t())
    with pytest.raises(ValueError, match="fewer than"):
        linear_kernel.linear(x, w, None, Tiles(1, 8, 16, 1))
    with pytest.raises(ValueError, match="power of two"):
        Tiles(1, 6, 16, 1)
    assert linear_kernel.linear(x[:0], w).shape == (0, 8)


def test_tiles_fill_the_gpu_at_real_shapes() -> None:
    """About PROGRAMS programs where the shape allows, whole weight rows read once: ZAYA1's q|k|v|v and o_proj,
    Ling's Q|K|V|G and shared-expert down; the MoE forms at one ZAYA1 / Ling-flash token."""
    for tokens in (1, 16):
        for n, k in ((1536, 2048), (2048, 1024), (16384, 4096), (4096, 1024)):
            t = tiles(tokens, n, k)
            assert t.BT >= tokens and t.BT * t.BN * t.BK <= 8192 and -(-n // t.BN) >= 256, (n, k, t)
            assert (t.STAGES > 1) == (t.BK < k)  # pipelined exactly when the K loop has several chunks
    # ZAYA1's gate|up: 4 interleaved rows (2 intermediate columns) of one K chunk, 1024 programs a pair; Ling's 8
    # choices a token keep the pipelined chunks
    assert moe_gemv.gate_up_tiles(2048, 2048) == Tiles(1, 4, 2048, 1) == tiles(1, 4096, 2048, one_chunk=True)
    assert moe_gemv.gate_up_tiles(1024, 4096, top_k=8).STAGES > 1
    assert moe_gemv.down_tiles(4096, 1024, top_k=8).BN == 16  # Ling: 256 programs a row (a pair, or a token's 8)
    # ZAYA1's one expert a token: a K of one chunk (4 rows of 2048, 512 programs), loaded before the PDL wait
    assert moe_gemv.down_tiles(2048, 2048) == Tiles(1, 4, 2048, 1) == tiles(1, 2048, 2048, one_chunk=True)
    assert tiles(2, 2048, 2048, one_chunk=True) == tiles(2, 2048, 2048)  # 2 rows a program would be too thin
    assert moe_gemv.gate_up_tiles(4, 8).BN == 64  # tiny rows: one program streams them all
    assert tiles(1, 4096, 64).BN == 64 and tiles(16, 4096, 64).BN == 8  # ... as far as the tile allows
    for tokens in (3, 5, 7, 12):  # the warm-up ladder's variants, and those of a batch padded for a CUDA graph
        assert tiles(tokens, 1536, 2048) == tiles(triton.next_power_of_2(tokens), 1536, 2048)


# ----------------------------------------------------------------------------------------------------- experts


def _experts(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    return (_randn(experts, 2 * inter, hidden, seed=seed, dtype=dtype, scale=hidden ** -0.5),
            _randn(experts, hidden, inter, seed=seed + 1, dtype=dtype, scale=inter ** -0.5))


def _reference(x, w13, w2, ids, weights) -> torch.Tensor:
    return reference.experts_sorted(x.float().cpu(), w13.float().cpu(), w2.float().cpu(), ids.cpu(),
                                    weights.float().cpu())


def _check_moe(x, w13, w2, ids, weights, config) -> torch.Tensor:
    """Reduced output vs the reference; unreduced rows vs the reference choice by choice; reduced == the rows
    summed in choice order in fp32 and rounded once (what ops.ling_norm does with them), bit for bit in 16-bit
    dtypes."""
    got = moe_gemv.fused_experts(x, w13, w2, ids, weights, config=config)
    rows = moe_gemv.fused_experts(x, w13, w2, ids, weights, reduce=False, config=config)
    assert got.shape == x.shape and rows.shape == (*ids.shape, x.shape[1]) and got.dtype == rows.dtype == x.dtype
    tol = MOE_TOLERANCE[x.dtype]
    want = _reference(x, w13, w2, ids, weights)
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol * want.abs().max().item())
    for k in range(ids.shape[1]):
        alone = _reference(x, w13, w2, ids[:, k:k + 1], weights[:, k:k + 1])
        torch.testing.assert_close(rows[:, k].float().cpu(), alone, rtol=tol, atol=tol * alone.abs().max().item())
    total = rows[:, 0].float()
    for k in range(1, ids.shape[1]):
        total += rows[:, k].float()
    if x.dtype == torch.float32:  # no rounding between a row's product and the sum: the GPU may fuse them (FMA)
        torch.testing.assert_close(got, total, rtol=1e-6, atol=1e-6 * total.abs().max().item())
    else:
        assert torch.equal(total.to(x.dtype), got)
    assert torch.equal(got, moe_gemv.fused_experts(x, w13, w2, ids, weights, config=config))  # deterministic
    return got


def _ids(table: list[list[int]]) -> torch.Tensor:
    return torch.tensor(table, device=DEVICE)


# experts, hidden, inter, expert ids [T][K], (gate/up tiles, down tiles)
MOE_CASES = {
    "one token top-1, ragged H and I, pipelined": (4, 40, 24, [[2]], (Tiles(1, 16, 16, 2), Tiles(1, 16, 16, 2))),
    "top-4, experts repeated across tokens and within one": (
        6, 32, 16, [[1, 4, 1, 0], [4, 5, 2, 3], [0, 1, 4, 5]], (Tiles(1, 32, 32, 1), Tiles(1, 32, 16, 1))),
    "16 tokens top-1, 8 experts": (
        8, 16, 8, [[e % 8] for e in range(5, 21)], (Tiles(1, 16, 16, 1), Tiles(1, 16, 8, 1))),
    "top-8 of 16, two tokens": (16, 32, 8, [[3, 1, 4, 15, 9, 2, 6, 5], [3, 5, 8, 9, 7, 0, 12, 1]],
                                (Tiles(1, 16, 32, 1), Tiles(1, 32, 8, 1))),
    "default tiles": (4, 32, 8, [[0, 3]], None),
    "one token top-1, default tiles: gate|up of one K chunk": (4, 512, 64, [[3]], None),
}


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_experts_match_reference(case: str, dtype: torch.dtype) -> None:
    experts, hidden, inter, table, config = MOE_CASES[case]
    if case.endswith("one K chunk"):  # the form ZAYA1's real widths take (4 rows of 2048)
        assert moe_gemv.gate_up_tiles(inter, hidden) == Tiles(1, 16, hidden, 1)
    ids = _ids(table)
    w13, w2 = _experts(experts, hidden, inter, dtype, seed=len(table))
    x = _randn(ids.shape[0], hidden, seed=11, dtype=dtype)
    weights = (0.1 + 0.9 * torch.rand(ids.shape, generator=torch.Generator().manual_seed(12))).to(DEVICE)
    _check_moe(x, w13, w2, ids, weights, config)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_skipped_pairs_read_nothing_and_give_exact_zeros(dtype: torch.dtype) -> None:
    """ZAYA1's MOD skip (expert 0, weight 0.0) and ids outside [0, E) give exact zero rows, reduced or not, even
    with expert 0's weights and every unchosen expert's poisoned (NaN): no program reads them."""
    experts, hidden, inter = 6, 32, 16
    w13, w2 = _experts(experts, hidden, inter, dtype, seed=13)
    ids = _ids([[0, 2], [3, 0], [6, -1], [4, 2]])
    weights = torch.tensor([[0.0, 0.5], [0.7, 0.0], [0.3, 0.9], [0.2, 0.6]], device=DEVICE)
    poisoned13, poisoned2 = w13.clone(), w2.clone()
    for unread in (0, 1, 5):
        poisoned13[unread], poisoned2[unread] = float("nan"), float("nan")
    config = (Tiles(1, 32, 32, 1), Tiles(1, 32, 16, 1))
    rows = moe_gemv.fused_experts(_randn(4, hidden, seed=14, dtype=dtype), poisoned13, poisoned2, ids, weights,
                                  reduce=False, config=config)
    dead = torch.tensor([[True, False], [False, True], [True, True], [False, False]], device=DEVICE)
    assert torch.equal(rows[dead], torch.zeros_like(rows[dead])) and not rows.isnan().any()
    x = _randn(4, hidden, seed=14, dtype=dtype)
    live = torch.where(dead, 0, ids)  # the live pairs alone, on clean weights, against the reference
    _check_moe(x, w13, w2, live, torch.where(dead, 0.0, weights), config)


def test_experts_rows_do_not_depend_on_the_batch() -> None:
    """A token's rows are the same bits alone, among others, and with padding rows (expert 0 at weight 0, as a
    CUDA-graph decode step pads): the default tiles depend on the weight shapes only."""
    w13, w2 = _experts(8, 32, 16, torch.float16, seed=16)
    x = _randn(4, 32, seed=17, dtype=torch.float16)
    ids = _ids([[1, 6], [6, 2], [3, 1], [0, 0]])
    weights = torch.tensor([[0.4, 0.6], [0.5, 0.5], [0.9, 0.1], [0.0, 0.0]], device=DEVICE)
    together = moe_gemv.fused_experts(x, w13, w2, ids, weights, reduce=False)
    for token in range(3):
        alone = moe_gemv.fused_experts(x[token:token + 1], w13, w2, ids[token:token + 1], weights[token:token + 1],
                                       reduce=False)
        assert torch.equal(alone[0], together[token])


def test_experts_reject_bad_input() -> None:
    w13, w2 = _experts(4, 16, 8, torch.float32, seed=15)
    one = torch.zeros(1, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="expert weights"):
        moe_gemv.fused_experts(torch.zeros(1, 8, device=DEVICE), w13, w2, one, one.float())
    with pytest.raises(ValueError, match="BT = 1"):
        moe_gemv.fused_experts(torch.zeros(1, 16, device=DEVICE), w13, w2, one, one.float(),
                               config=(Tiles(1, 1, 16, 1), Tiles(1, 8, 8, 1)))
    assert moe_gemv.fused_experts(torch.zeros(0, 16, device=DEVICE), w13, w2, one[:0], one[:0].float(),
                                  reduce=False).shape == (0, 1, 16)


# ----------------------------------------------------------------------------------------------------- norm epilogue


def _residual_norm(tokens: int, width: int, dtype: torch.dtype, seed: int, skip: bool,
                   fp32_copy: bool) -> ResidualNorm:
    """ZAYA1's residual update + norm (biases and scales; with `skip`, MOD's skip term, zero for every other
    token) over `tokens` rows of `width`."""
    gen = torch.Generator().manual_seed(seed)

    def vector() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(width, generator=gen)).to(DEVICE, dtype)

    skip_weight = torch.rand(tokens, 1, generator=gen) * (torch.arange(tokens)[:, None] % 2 == 0)
    return ResidualNorm(vector(), 1e-6, (10 * torch.randn(tokens, width, generator=gen)).to(DEVICE),
                        vector() - 1, vector(), vector() - 1, vector(),
                        skip_weight.to(DEVICE) if skip else None,
                        torch.randn(tokens, width, generator=gen).to(DEVICE, dtype) if skip else None, fp32_copy)


def _standalone(norm: ResidualNorm, update: torch.Tensor):
    return norm_kernel.residual_rms_norm(update, norm.norm_weight, norm.eps, norm.residual, norm.update_bias,
                                         norm.update_scale, norm.residual_bias, norm.residual_scale, norm.skip_weight,
                                         norm.skip_input, norm.fp32_copy)


def _exact(dtype: torch.dtype) -> bool:
    """Whether an epilogue must equal the standalone norm bit for bit (module docstring)."""
    return dtype != torch.float32 or not ON_GPU


def _assert_same(got: tuple, want: tuple, exact: bool) -> None:
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None and exact:
            assert g.dtype == w.dtype and torch.equal(g, w)
        elif g is not None:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6 * w.abs().max().item())


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("tokens, width, k, config", [
    (1, 40, 24, Tiles(1, 8, 16, 2)),  # five column programs, a ragged last one and a ragged norm row
    (3, 32, 64, Tiles(4, 4, 32, 2)),  # eight programs, three rows for the last one
    (4, 48, 16, None),  # the default tiles
])
def test_linear_norm_epilogue_equals_the_norm_kernel(tokens, width, k, config, dtype) -> None:
    x = _randn(tokens, k, seed=20, dtype=dtype)
    w = _randn(width, k, seed=21, dtype=dtype, scale=k ** -0.5)
    for copy in (True, False):
        norm = _residual_norm(tokens, width, dtype, seed=22, skip=copy, fp32_copy=copy)
        want = _standalone(norm, linear_kernel.linear(x, w, None, config))
        for _ in range(2):  # the counter is back at zero: a second call runs its epilogue too
            _assert_same(linear_kernel.linear(x, w, None, config, norm=norm), want, _exact(dtype))
            assert not arrival_counters("linear_norm", 1, DEVICE).any()
    # h_pending only allows a PendingNorm: this epilogue makes h all the same
    _assert_same(linear_kernel.linear(x, w, None, config, norm=replace(norm, h_pending=True)), want, _exact(dtype))


def _experts_norm_case(table, weights, dtype: torch.dtype, seed: int):
    """(x, w13, w2, ids, weights, tiles, ZAYA1's post-MoE norm) of a few-pair experts case: 4 experts of 40 -> 24,
    three down programs a row, the last one ragged."""
    ids = _ids(table)
    w13, w2 = _experts(4, 40, 24, dtype, seed=seed)
    x = _randn(ids.shape[0], 40, seed=seed + 1, dtype=dtype)
    config = (Tiles(1, 16, 16, 2), Tiles(1, 16, 16, 2))
    norm = _residual_norm(ids.shape[0], 40, dtype, seed=seed + 2, skip=True, fp32_copy=False)
    return x, w13, w2, ids, torch.tensor(weights, device=DEVICE), config, norm


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("table, weights", [
    ([[2]], [[0.7]]),  # one token, top-1
    ([[0], [3], [1]], [[0.0], [0.4], [0.9]]),  # ZAYA1 with a MOD skip token (expert 0 at weight 0): a zero update
    ([[1, 3], [0, 2]], [[0.3, 0.6], [0.5, 0.2]]),  # top-2, each row's two choices summed before its norm
])
def test_experts_norm_epilogue_equals_the_norm_kernel(table, weights, dtype) -> None:
    """Each row normalised by the last of its down programs (per-row counters), the skip term included."""
    x, w13, w2, ids, weight, config, norm = _experts_norm_case(table, weights, dtype, seed=23)
    want = _standalone(norm, moe_gemv.fused_experts(x, w13, w2, ids, weight, config=config))
    for _ in range(2):
        _assert_same(moe_gemv.fused_experts(x, w13, w2, ids, weight, config=config, norm=norm), want, _exact(dtype))
        assert not arrival_counters("moe_down_norm", moe_gemv.MAX_PAIRS, DEVICE).any()
    with pytest.raises(ValueError, match="reduced rows"):
        moe_gemv.fused_experts(x, w13, w2, ids, weight, reduce=False, norm=norm)


def test_entry_points_with_a_norm_equal_the_norm_after() -> None:
    """ops.linear.linear_residual_norm and ops.moe.fused_experts_residual_norm give what their op then the norm
    give (on the GPU the fused launch, bit for bit in fp16; on the CPU the torch ops, fp32, exactly)."""
    dtype = torch.float16 if ON_GPU else torch.float32
    x = _randn(2, 32, seed=26, dtype=dtype)
    w = _randn(48, 32, seed=27, dtype=dtype, scale=32 ** -0.5)
    norm = _residual_norm(2, 48, dtype, seed=28, skip=True, fp32_copy=True)
    _assert_same(linear_op.linear_residual_norm(x, w, None, norm), norm(linear_op.linear(x, w)), True)
    w13, w2 = _experts(4, 32, 16, dtype, seed=29)
    ids, weights = _ids([[1], [0]]), torch.tensor([[0.8], [0.0]], device=DEVICE)
    norm = _residual_norm(2, 32, dtype, seed=30, skip=True, fp32_copy=False)
    _assert_same(moe_op.fused_experts_residual_norm(x, w13, w2, ids, weights, norm),
                 norm(moe_op.fused_experts(x, w13, w2, ids, weights)), True)


# ----------------------------------------------------------------------------------------------------- pending norm


def _pending(tokens: int, width: int, parts: int, dtype: torch.dtype, seed: int) -> PendingNorm:
    """A PendingNorm of random fp32 residual rows, their sums of squares cut into `parts` column blocks."""
    x = _randn(tokens, width, seed=seed, dtype=torch.float32, scale=3.0)
    sums = torch.stack([block.sum(1) for block in torch.tensor_split(x * x, parts, dim=1)], 1)
    weight = (1 + 0.1 * _randn(width, seed=seed + 1, dtype=torch.float32)).to(dtype)
    return PendingNorm(x, sums.contiguous(), weight, 1e-6)


def _assert_h_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """h made from other partial sums than `want`'s: rstd moves by fp32 ulps, which may move a rounding of h by
    one unit of its dtype (fp32: 1e-6 relative)."""
    bits = MANTISSA_BITS.get(want.dtype, 20)
    torch.testing.assert_close(got, want, rtol=2.0 ** -bits, atol=2.0 ** -bits * want.abs().max().item())


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("tokens, k, parts, config", [
    (1, 40, 5, Tiles(1, 8, 16, 2)),  # a pipelined loop of ragged K chunks, ragged rows
    (3, 64, 8, Tiles(4, 4, 64, 1)),  # one chunk, masked token lanes
    (2, 48, 3, None),  # the default tiles
])
def test_linear_finishes_a_pending_norm(tokens, k, parts, config, dtype) -> None:
    """The GEMV launch given a PendingNorm makes its h on the way (rstd from the partial sums, the norm's two
    roundings): what it gives for the h that PendingNorm.h() makes, up to a rounding of h moved by the sum's order
    (of the products' magnitudes: 2^-mantissa of h's dtype)."""
    pending = _pending(tokens, k, parts, dtype, seed=40)
    w = _randn(20, k, seed=41, dtype=dtype, scale=k ** -0.5)
    bias = _randn(20, seed=42, dtype=dtype)
    got = linear_kernel.linear(pending, w, bias, config)
    h = pending.h()
    want = linear_kernel.linear(h, w, bias, config)
    assert got.dtype == dtype and got.shape == (tokens, 20)
    bound = 2.0 ** -MANTISSA_BITS.get(dtype, 20) * (h.double().abs() @ w.double().abs().T).max().item()
    assert (got.double() - want.double()).abs().max().item() <= bound + 1e-5 * want.double().abs().max().item()


def test_linear_rejects_a_bad_pending_norm() -> None:
    pending = _pending(2, 16, 2, torch.float32, seed=43)
    w = _randn(8, 16, seed=44, dtype=torch.float32)
    with pytest.raises(ValueError, match="pending norm"):
        linear_kernel.linear(replace(pending, x=pending.x.half()), w)
    with pytest.raises(ValueError, match="pending norm"):
        linear_kernel.linear(replace(pending, sum_squares=pending.sum_squares[:1]), w)
    with pytest.raises(ValueError, match="x is torch.float16"):
        linear_kernel.linear(replace(pending, norm_weight=pending.norm_weight.half()), w)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("table, weights", [
    ([[2]], [[0.7]]),  # one token, top-1
    ([[0], [3], [1]], [[0.0], [0.4], [0.9]]),  # a MOD skip token: its x is the skip term and the residual
])
def test_experts_leave_a_pending_norm(table, weights, dtype) -> None:
    """With `h_pending` the down launch stores x (each program its columns) and each program's sum of squares:
    x is the standalone norm kernel's (bit for bit in the interpreter; compiled, x's fp32 terms may be contracted
    into other FMAs than the norm kernel's, in any dtype: 1e-6 relative), and the PendingNorm's h its h up to a
    rounding moved by the sum's order."""
    x, w13, w2, ids, weight, config, norm = _experts_norm_case(table, weights, dtype, seed=45)
    want_x, want_h, _ = _standalone(norm, moe_gemv.fused_experts(x, w13, w2, ids, weight, config=config))
    got_x, pending, copy = moe_gemv.fused_experts(x, w13, w2, ids, weight, config=config,
                                                  norm=replace(norm, h_pending=True))
    assert copy is None and isinstance(pending, PendingNorm) and pending.x is got_x
    assert pending.sum_squares.shape == (ids.shape[0], 3)
    if not ON_GPU:  # the same arithmetic; compiled, the two kernels may contract x's terms into other FMAs
        assert torch.equal(got_x, want_x)
    else:
        torch.testing.assert_close(got_x, want_x, rtol=1e-6, atol=1e-6 * want_x.abs().max().item())
    torch.testing.assert_close(pending.sum_squares.sum(1), (got_x * got_x).sum(1), rtol=1e-6, atol=0)
    _assert_h_close(pending.h(), want_h)


def test_ops_linear_finishes_a_pending_norm_where_the_kernel_cannot() -> None:
    """ops.linear on the reference path (CPU, no kernels) takes a PendingNorm as its h; `takes_pending` says no."""
    pending = _pending(2, 16, 4, torch.float32, seed=48)
    w = _randn(8, 16, seed=49, dtype=torch.float32)
    with mock.patch.object(backends, "use_triton", lambda op, device: False):
        assert not linear_op.takes_pending(2, w)
        assert torch.equal(linear_op.linear(pending, w), F.linear(pending.h(), w))


# ----------------------------------------------------------------------------------------------------- entry points


def test_entry_points_switch_on_host_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels selected: linear takes the GEMV kernel up to FASTER_UP_TO_TOKENS rows of 16-bit or fp32
    weights up to FASTER_UP_TO_WEIGHT_BYTES, F.linear beyond; fused_experts the GEMV form up to MAX_PAIRS pairs, the
    grouped form beyond."""
    calls: list[str] = []
    monkeypatch.setattr(backends, "use_triton", lambda op, device: True)
    monkeypatch.setattr(linear_kernel, "linear", lambda *a: calls.append("gemv linear"))
    monkeypatch.setattr(moe_gemv, "fused_experts", lambda *a, **k: calls.append("gemv experts"))
    monkeypatch.setattr(grouped, "fused_experts", lambda *a, **k: calls.append("grouped experts"))
    w16 = torch.zeros(4, 8, dtype=torch.float16)
    linear_op.linear(torch.zeros(linear_kernel.FASTER_UP_TO_TOKENS, 8, dtype=torch.float16), w16)
    beyond = linear_kernel.FASTER_UP_TO_TOKENS + 1
    assert linear_op.linear(torch.zeros(beyond, 8, dtype=torch.float16), w16).shape == (beyond, 4)
    big = torch.zeros(linear_kernel.FASTER_UP_TO_WEIGHT_BYTES // 2 // 8 + 1, 8, dtype=torch.float16)  # a row over
    assert linear_op.linear(torch.zeros(1, 8, dtype=torch.float16), big).shape == (1, big.shape[0])
    linear_op.linear(torch.zeros(2, 8), w16.float())  # fp32 (Ling's router logits)
    w13, w2 = torch.zeros(4, 4, 8), torch.zeros(4, 8, 2)
    for tokens in (moe_gemv.MAX_PAIRS // 2, moe_gemv.MAX_PAIRS // 2 + 1):
        ids = torch.zeros(tokens, 2, dtype=torch.long)
        moe_op.fused_experts(torch.zeros(tokens, 8), w13, w2, ids, ids.float())
    assert calls == ["gemv linear", "gemv linear", "gemv experts", "grouped experts"]
