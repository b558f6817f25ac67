"""QKNorm + partial NeoX RoPE + KV-cache write kernel vs the reference (ops/reference/zaya_qk.py).

Both compute in fp32 from the same inputs; they differ by the order of the norm's sum and by the cos/sin
implementations (each within an ulp of the fp32 angle), so fp32 results agree to 1e-5 of their scale
(|q| = sqrt(D), |k| = sqrt(D) * temp). 16-bit results are rounded once at the end: 1 ulp of that dtype. Positions
reach 131071, where the angle is large and a fast-math cos/sin would be far off. V is copied bit for bit, and cache
rows not in the slot mapping keep their contents.
"""
from __future__ import annotations

import pytest
import torch

from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.ops.reference import zaya_qk as reference
from hybridserve.ops.triton import zaya_qk as kernel
from tests.ops.conftest import DEVICE, KERNEL_DTYPES

ROWS = 512


def _case(tokens: int, q_heads: int, k_heads: int, d: int, rotary_dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qk = torch.randn(tokens, q_heads + k_heads, d, generator=gen)  # q and k as views of one buffer (the kernel's)
    v = torch.randn(tokens, k_heads, d, generator=gen).to(dtype)
    temp = torch.rand(k_heads, generator=gen) * 1.5 + 0.5
    positions = torch.cat([torch.tensor([0, 1, 131071]), torch.randint(0, 131072, (tokens - 3,), generator=gen)])
    slots = torch.randperm(ROWS, generator=gen)[:tokens]
    inv_freq = RotaryEmbedding(rotary_dim, 5_000_000.0).inv_freq
    caches = [torch.full((ROWS, k_heads, d), 9.0).to(dtype) for _ in range(2)]
    return qk[:, :q_heads], qk[:, q_heads:], v, temp.to(dtype), inv_freq, positions, slots, caches


def check_qk_case(tokens: int, q_heads: int, k_heads: int, d: int, rotary_dim: int, dtype: torch.dtype) -> None:
    q, k, v, temp, inv_freq, positions, slots, caches = _case(tokens, q_heads, k_heads, d, rotary_dim, dtype)
    want_caches = [c.clone() for c in caches]
    want = reference.qk_norm_rope_cache(q, k, v, temp, inv_freq, positions, slots, *want_caches, dtype)
    got_caches = [c.to(DEVICE) for c in caches]
    got = kernel.qk_norm_rope_cache(*(t.to(DEVICE) for t in (q, k, v, temp, inv_freq, positions, slots)),
                                    *got_caches, dtype)
    assert got.dtype == dtype
    for name, a, b in (("q", got, want), ("k cache", got_caches[0], want_caches[0])):
        a, b = a.cpu().float(), b.float()
        ulp = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
        assert ((a - b).abs() <= 1e-5 * d ** 0.5 * 2 + ulp * b.abs()).all(), name
    assert torch.equal(got_caches[1].cpu(), want_caches[1])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("q_heads, k_heads, d, rotary_dim", [(4, 2, 16, 8), (2, 2, 12, 6), (8, 2, 32, 32),
                                                             (2, 1, 16, 0)])
def test_qk_norm_rope_cache_matches_reference(dtype, q_heads, k_heads, d, rotary_dim):
    check_qk_case(11, q_heads, k_heads, d, rotary_dim, dtype)
