"""Triton SiLU(gate) * up (ops/triton/activation.py) against its torch reference: one row, several rows, widths
below, at and above one program's block (masked lanes), a strided input (a view of a wider projection output).

Tolerances: fp32 1e-6 relative (only exp's implementation differs); 16-bit outputs to one unit in the last place of
the largest value (a different exp may flip the first rounding, SiLU's)."""
from __future__ import annotations

import pytest
import torch

from hybridserve.ops import activation as entry
from hybridserve.ops.reference import activation as reference
from hybridserve.ops.triton import activation as kernel
from tests.ops.conftest import DEVICE, KERNEL_DTYPES


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 24), (5, 1024), (3, 1100)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(width)
    x = (4 * torch.randn(rows, 2 * width + 6, device=DEVICE, generator=gen)).to(dtype)[:, 3:3 + 2 * width]
    got, expected = kernel.silu_and_mul(x), reference.silu_and_mul(x)
    assert got.dtype == expected.dtype == dtype and got.shape == expected.shape == (rows, width)
    tol = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert (got.float() - expected.float()).abs().max().item() <= tol * expected.float().abs().max().item()


def test_odd_width_is_refused() -> None:
    with pytest.raises(ValueError, match="gate"):
        entry.silu_and_mul(torch.ones(2, 5, device=DEVICE))
