"""The CCA conv kernel with its q/k epilogue (QKNorm + partial NeoX RoPE + K/V cache write, `to_cache`) vs the
reference conv followed by the reference q/k normalisation (ops/reference/zaya_qk.py), in both of the conv's forms.

Both compute in fp32 from the same inputs; they differ by the conv's summation order (tests/ops/test_conv_kernel.py:
1e-5 of the scale, 3e-3 for the GPU heads form's TF32 stage 2 on 16-bit inputs), the norm's order and the cos/sin
implementations (each within an ulp of the fp32 angle). 16-bit results are rounded once at the end: 1 ulp of that
dtype. Positions reach 131071, where the angle is large and a fast-math cos/sin would be far off. V is copied bit
for bit, and cache rows not in the slot mapping keep their contents. In the columns form each head's outputs come
from several programs, and its last program reads them back for the epilogue (the decode cases at the real launch
constants).
"""
from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import KERNEL_DTYPES
from tests.ops.test_conv_kernel import FORMS, MIXED, VERIFY, _decode_rows, run_conv_case
from tests.ops.test_conv_kernel import few_programs  # noqa: F401 (the fixture, used by name below)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("q_heads, k_heads, d, rotary_dim", [(4, 2, 16, 8), (8, 2, 32, 32), (2, 1, 16, 0)])
@pytest.mark.usefixtures("few_programs")
def test_epilogue_matches_reference(dtype, form, q_heads, k_heads, d, rotary_dim):
    run_conv_case(MIXED, dtype, form, q_heads=q_heads, k_heads=k_heads, d=d, rotary_dim=rotary_dim)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.usefixtures("few_programs")
def test_large_positions(form):
    gen = torch.Generator().manual_seed(5)
    tokens = sum(n for _, n, _ in MIXED)
    positions = torch.cat([torch.tensor([0, 1, 131071]), torch.randint(0, 131072, (tokens - 3,), generator=gen)])
    run_conv_case(MIXED, torch.float32, form, footers=False, rotary_dim=8, positions=positions)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("count", [1, 16])
def test_decode_steps(count, form):
    """The real launch constants: in the columns form each head's columns span several programs."""
    run_conv_case(_decode_rows(count), torch.float32, form, rotary_dim=8)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.usefixtures("few_programs")
def test_tensor_parallel_rank(form):
    """Rank 1 of 2: this rank's K heads (temperatures) and V heads only go to its cache."""
    run_conv_case(MIXED, torch.float32, form, q_heads=2, k_heads=2, d=8, full_k_heads=4, kv_head_offset=2,
                  rotary_dim=4)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.usefixtures("few_programs")
def test_verify_rows(form):
    run_conv_case(VERIFY, torch.float32, form, verify={0, 2, 4, 5}, rotary_dim=8)
