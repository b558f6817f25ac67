"""Fused residual update + RMSNorm kernel vs the reference (ops/reference/norm.py).

x (the fp32 residual) is the same elementwise fp32 arithmetic in both: 1e-6 relative (room for an FMA on the GPU).
h is rounded to the model dtype twice (normalised row, then times the weight) in both; the row statistic is a
sum in another order, so h may sit one rounding step away: 2 ulps of its dtype (1e-5 relative in fp32).
"""
from __future__ import annotations

import pytest
import torch

from hybridserve.ops.reference import norm as reference
from hybridserve.ops.triton import norm as kernel
from tests.ops.conftest import DEVICE, KERNEL_DTYPES


def _inputs(rows: int, width: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    vec = [(1 + 0.1 * torch.randn(width, generator=gen)).to(dtype) for _ in range(5)]  # ub, us, rb, rs, norm w
    return {
        "update": (3 * torch.randn(rows, width, generator=gen)).to(dtype),
        "residual": 10 * torch.randn(rows, width, generator=gen),
        "update_bias": vec[0] - 1, "update_scale": vec[1], "residual_bias": vec[2] - 1, "residual_scale": vec[3],
        "norm_weight": vec[4],
        "skip_weight": torch.where(torch.rand(rows, 1, generator=gen) < 0.5, torch.rand(rows, 1, generator=gen), 0.0),
        "skip_input": torch.randn(rows, width, generator=gen).to(dtype),
    }


def assert_norm_close(x: torch.Tensor, h: torch.Tensor, want_x: torch.Tensor, want_h: torch.Tensor) -> None:
    """The module docstring's bounds: x within 1e-6 relative, h within 2 ulps of its dtype."""
    assert x.dtype == torch.float32 and h.dtype == want_h.dtype
    assert torch.allclose(x, want_x, rtol=1e-6, atol=1e-6)
    ulp = torch.finfo(h.dtype).eps if h.dtype != torch.float32 else 5e-6
    assert ((h.float() - want_h.float()).abs() <= 2 * ulp * want_h.float().abs() + 1e-6).all()


FORMS = {
    "zaya_post_mlp": ("update", "residual", "update_bias", "update_scale", "residual_bias", "residual_scale",
                      "skip_weight", "skip_input"),
    "zaya_post_attention": ("update", "residual", "update_bias", "update_scale", "residual_bias", "residual_scale"),
    "embedding_affine": ("update", "update_bias", "update_scale"),
    "plain_add": ("update", "residual"),
}


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("width", [64, 48])
def test_residual_rms_norm_matches_reference(dtype, form, width):
    inputs = _inputs(7, width, dtype)
    kwargs = {name: inputs[name] for name in FORMS[form]}
    want = reference.residual_rms_norm(norm_weight=inputs["norm_weight"], eps=1e-5, fp32_copy=True, **kwargs)
    got = kernel.residual_rms_norm(norm_weight=inputs["norm_weight"].to(DEVICE), eps=1e-5, fp32_copy=True,
                                   **{k: v.to(DEVICE) for k, v in kwargs.items()})
    x, h, h32 = (t.cpu() for t in got)
    assert h.dtype == dtype
    assert_norm_close(x, h, want[0], want[1])
    assert torch.equal(h32, h.float())


def test_fp32_copy_is_optional_and_skip_needs_its_input():
    inputs = _inputs(3, 32, torch.float32)
    _, _, h32 = kernel.residual_rms_norm(inputs["update"].to(DEVICE), inputs["norm_weight"].to(DEVICE), 1e-5)
    assert h32 is None
    from hybridserve.ops.norm import residual_rms_norm
    with pytest.raises(ValueError, match="skip_weight and skip_input"):
        residual_rms_norm(inputs["update"], inputs["norm_weight"], 1e-5, skip_weight=inputs["skip_weight"])
