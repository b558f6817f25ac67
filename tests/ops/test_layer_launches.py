"""Launch budgets per decoder layer and decode step, counted on CPU (benchmarks/layer_launches.py).

ZAYA1: 3 GEMMs (fused q|k|v|v projection, o_proj, router down_proj), 5 ZAYA kernels (CCA conv, QKNorm+RoPE+KV write,
two residual+norm, the EDA router), plus one call each into attention and MoE (whose launches are theirs)."""
from __future__ import annotations

import pytest

from benchmarks.layer_launches import decode_step_launches
from tests.ops.conftest import ON_GPU  # sets TRITON_INTERPRET before the kernels are imported


@pytest.mark.skipif(ON_GPU, reason="counts interpreted launches; on a GPU: benchmarks/decode_launches.py")
def test_zaya_decode_layer_launch_budget():
    counts = decode_step_launches("zaya", num_layers=3, batch_size=3)[1]  # a middle layer
    assert counts == {
        "aten.mm": 2,  # the fused q|k|v|v projection, o_proj
        "aten.addmm": 1,  # the router's down_proj (with its bias)
        "triton._cca_conv_kernel": 1,
        "triton._qk_norm_rope_cache_kernel": 1,
        "triton._residual_rms_norm_kernel": 2,
        "triton._eda_route_kernel": 1,
        "entry.paged_attention": 1,
        "entry.fused_experts": 1,
    }
