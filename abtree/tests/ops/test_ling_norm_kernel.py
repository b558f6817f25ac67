"""Triton RMS-norm fusions (ops/triton/ling_norm.py) against their torch references (ops/reference/ling_norm.py):
RMSNorm alone or after the residual add, gated GroupRMSNorm, per-head QK RMSNorm + partial NeoX RoPE, MLA's latent
norm + RoPE + cache write. Widths that are not powers of two
(masked lanes), more rows than one program's tile, and strided inputs (views of one fused projection output, as
the model passes them).

Tolerances: fp32 1e-6 relative (only the order of the fp32 sums and the cos/sin implementation differ); 16-bit
outputs may differ by one rounding step where the fp32 values before rounding differ in the last bits, so they are
compared to 1 unit in the last place (relative 2^-7 for bf16, 2^-10 for fp16) of the largest value.
"""
from __future__ import annotations

import pytest
import torch

from hybridserve.ops.reference import ling_norm as reference
from hybridserve.ops.triton import ling_norm as kernel
from tests.ops.conftest import DEVICE, KERNEL_DTYPES

EPS = 1e-6


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    tol = 1e-6 if got.dtype == torch.float32 else torch.finfo(got.dtype).eps
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= tol * expected.float().abs().max().item(), err


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("fused", ["plain", "residual", "addend", "parts"])
def test_add_rms_norm(dtype: torch.dtype, fused: str) -> None:
    """RMSNorm alone, after the residual add, after adding a second part of the block output too (with the fp32
    copy), and with x as 3 rows per token to sum first (the routed experts' unreduced output)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = _randn(70, 2, 48, gen=gen, dtype=dtype)[:, 0]  # row stride 96: a strided view; 32 rows per program
    if fused == "parts":
        x = _randn(70, 3, 48, gen=gen, dtype=dtype)
    residual = 10 * _randn(70, 48, gen=gen, dtype=dtype)
    addend = _randn(70, 48, gen=gen, dtype=dtype) if fused in ("addend", "parts") else None
    weight = 1 + 0.1 * _randn(48, gen=gen, dtype=dtype)
    if fused == "plain":
        _close(kernel.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))
        return
    copy = fused == "addend"
    out, new_residual, out32 = kernel.add_rms_norm(x, residual, weight, EPS, addend, copy)
    expected, expected_residual, _ = reference.add_rms_norm(x, residual, weight, EPS, addend, copy)
    if fused == "parts":  # the fp32 sum of the parts may be taken in another order
        _close(new_residual, expected_residual)
    else:
        assert torch.equal(new_residual, expected_residual)  # the same roundings of the same fp32 sums
    _close(out, expected)
    assert (out32 is None) if not copy else (out32.dtype == torch.float32 and torch.equal(out32, out.float()))


def test_rms_norm_one_row_odd_width() -> None:
    """One decode token, a width that is no power of two (masked lanes) and a strided row (MLA's q_a part)."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    x = _randn(1, 50, gen=gen)[:, 7:37]
    weight = 1 + 0.1 * _randn(30, gen=gen)
    _close(kernel.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("gated", [True, False])
def test_group_rms_norm(dtype: torch.dtype, gated: bool) -> None:
    """x fp32 (the lightning output), weight and gate in the model dtype, the gate a view of a fused output."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x = _randn(70, 60, gen=gen)  # 64 rows per program
    x[:, :20] *= 30.0  # groups of very different scale: a whole-row statistic would differ
    weight = 1 + 0.1 * _randn(60, gen=gen, dtype=dtype)
    gate = _randn(70, 3, 60, gen=gen, dtype=dtype)[:, 2] if gated else None
    _close(kernel.group_rms_norm(x, weight, 3, EPS, gate), reference.group_rms_norm(x, weight, 3, EPS, gate))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(("heads", "head_dim", "rotary_dim", "norm"),
                         [(3, 16, 8, True), (5, 24, 8, True), (3, 16, 16, False)])
def test_qk_norm_rope(dtype: torch.dtype, heads: int, head_dim: int, rotary_dim: int, norm: bool) -> None:
    """q and k heads of a [T, 4, H, d] projection output (the model's Q|K|V|G view), positions up to 5000;
    T * 2 * H rows span several programs' tiles (128 rows of d = 16, 64 of d = 24)."""
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    tokens = 28
    qkvg = 3 * _randn(tokens, 4, heads, head_dim, gen=gen, dtype=dtype)
    q_weight, k_weight = (1 + 0.2 * _randn(head_dim, gen=gen, dtype=dtype) for _ in range(2))
    weights = (q_weight, k_weight) if norm else (None, None)
    positions = torch.tensor([0, 1, 2, 17, 63, 1000, 4999] * 4, device=DEVICE)
    inv_freq = 1.0 / (6e6 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=DEVICE) / rotary_dim))
    got = kernel.qk_norm_rope(qkvg[:, :2], *weights, positions, inv_freq, EPS)
    _close(got, reference.qk_norm_rope(qkvg[:, :2], *weights, positions, inv_freq, EPS))


def test_bad_shapes_are_refused() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    x = _randn(4, 30, gen=gen)
    with pytest.raises(ValueError, match="groups"):
        kernel.group_rms_norm(x, torch.ones(30, device=DEVICE), 4, EPS)
    with pytest.raises(ValueError, match="residual"):
        kernel.add_rms_norm(x, x[:3], torch.ones(30, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="together"):
        kernel.qk_norm_rope(_randn(2, 2, 1, 16, gen=gen), torch.ones(16, device=DEVICE), None,
                            torch.arange(2, device=DEVICE), torch.ones(4, device=DEVICE), EPS)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "interleaved", "in_place"),
                         [(1, 3, True, False), (5, 2, False, False), (4, 5, True, True)])
def test_mla_latent_rope(dtype: torch.dtype, tokens: int, heads: int, interleaved: bool, in_place: bool) -> None:
    """kv_a a strided view of a wider projection output (MLA's fused q_a|kv_a GEMM), q_rope the rope channels of
    [T, H, nope + rope] query heads, rotated into a separate buffer or in place; rank 20 and rope 6 are no powers
    of two (masked lanes); scattered cache slots, the other rows untouched."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    rank, rope, nope = 20, 6, 8
    kv_a = _randn(tokens, 11 + rank + rope, gen=gen, dtype=dtype)[:, 11:]
    weight = 1 + 0.1 * _randn(rank, gen=gen, dtype=dtype)
    q = _randn(tokens, heads, nope + rope, gen=gen, dtype=dtype)
    positions = torch.randint(0, 5000, (tokens,), device=DEVICE, generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope, 2, device=DEVICE, dtype=torch.float32) / rope))
    slots = torch.randperm(3 * tokens, device=DEVICE, generator=gen)[:tokens]
    caches, outs = [], []
    for impl in (kernel, reference):
        cache = torch.full((3 * tokens, 1, rank + rope), 7.0, device=DEVICE, dtype=dtype)
        q_in = q.clone()
        buffer = torch.zeros(tokens, heads, 2, rope, device=DEVICE, dtype=dtype)[:, :, 1]  # strided heads
        q_out = q_in[..., nope:] if in_place else buffer
        impl.mla_latent_rope(kv_a, weight, q_in[..., nope:], q_out, positions, inv_freq, interleaved, EPS, slots,
                             cache)
        caches.append(cache)
        outs.append(q_in if in_place else q_out)
    _close(caches[0], caches[1])
    _close(outs[0], outs[1])
    untouched = torch.ones(3 * tokens, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert (caches[0][untouched] == 7.0).all()
