"""The launch budget of one ZAYA1 decoder layer per decode step, counted on CPU (benchmarks/zaya_layer_ops.py):
3 GEMMs (fused q|k|v|v projection, o_proj, router down_proj), 5 ZAYA kernels (CCA conv, QKNorm+RoPE+KV write,
two residual+norm, the EDA router), plus one call each into attention and MoE (whose launches are theirs)."""
from __future__ import annotations

import pytest

from benchmarks.zaya_layer_ops import launches_per_layer
from tests.ops.conftest import ON_GPU  # sets TRITON_INTERPRET before the kernels are imported


@pytest.mark.skipif(ON_GPU, reason="counts interpreted launches; on a GPU: benchmarks/decode_launches.py")
def test_decode_layer_launch_budget():
    counts = launches_per_layer(batch_size=3)
    assert counts == {
        "aten.linear": 3,
        "triton._cca_conv_kernel": 1,
        "triton._qk_norm_rope_cache_kernel": 1,
        "triton._residual_rms_norm_kernel": 2,
        "triton._eda_route_kernel": 1,
        "entry.attention": 1,
        "entry.moe": 1,
    }
