"""Launch budgets per decoder layer and decode step, counted on CPU (tests/ops/launch_counts.py).

ZAYA1, 9 a layer: 2 GEMV linears (fused q|k|v|v projection, o_proj; cuBLAS GEMMs beyond decode sizes), CCA conv
(QKNorm+RoPE+KV write in its epilogue), attention (its split merge in the last split program), the EDA router's three
(the post-attention residual norm + down-projection + carry, norm + fc1, fc2 + class selection, each split by
columns), the experts' gate/up and down GEMVs (down with the post-MoE residual norm). The post-attention norm runs in
the router's first launch where that launch holds whole rows (every step at these widths; at ZAYA1-8B's, 1 and 2
tokens), else in o_proj's epilogue: 9 either way. Before the norm and merge epilogues it was 13, before the conv's
q/k epilogue 10."""
from __future__ import annotations

import pytest

from tests.ops.conftest import ON_GPU  # sets TRITON_INTERPRET before the kernels are imported
from tests.ops.launch_counts import decode_step_launches
from hybridserve.core.quant import WEIGHT_ONLY_MAX_PAIRS, WEIGHT_ONLY_MAX_ROWS
from hybridserve.ops.triton.linear import E4M3_GEMV_MAX_TOKENS


@pytest.mark.skipif(ON_GPU, reason="counts interpreted launches; on a GPU: python -m benchmarks.ops launches")
def test_zaya_decode_layer_launch_budget():
    counts = decode_step_launches("zaya", num_layers=3, batch_size=3)[1]  # a middle layer
    assert counts == {
        "triton._linear_kernel": 2,  # the fused q|k|v|v projection, o_proj
        "triton._cca_conv_kernel": 1,  # + QKNorm, RoPE and the K/V cache write
        "triton._attention_kernel": 1,  # one launch, split or not (splits are merged by their last program)
        "triton._normed_down_kernel": 1,  # the post-attention residual norm + the router's down-projection
        "triton._dense_kernel": 2,  # the router's fc1, fc2 + class selection
        "triton._gemv_gate_up_kernel": 1,
        "triton._gemv_down_kernel": 1,  # + the post-MoE residual norm
    }


# Ling-2.6, the layout `python -m benchmarks.ops launches` measures on the GPU (4 layers in one group: lightning 0-2,
# MLA 3; layer 0's FFN dense, the others MoE with a shared expert). The norm kernel (_add_rms_norm_kernel) is every
# RMSNorm: alone, or fused with the residual add before it, which also adds the previous MoE's shared expert and
# sums its routed rows, and writes the fp32 copy the router reads. Before this budget the step was 129 launches
# (fp16 count: 18 + 20 + 20 + 69, plus 2 outside): torch RMSNorms and RoPE, SiLU and multiply apart, casts, cats.
# Every 16-bit projection of a decode step is the GEMV linear kernel, and so are the router's fp32 logits.
_LIGHTNING = {
    "triton._linear_kernel": 2,  # the Q|K|V|G projection, dense (o_proj)
    "triton._add_rms_norm_kernel": 2,  # input norm (layer 0: no residual yet), post-attention norm
    "triton._decode_kernel": 1,  # the lightning recurrence step, with the QK RMSNorm + RoPE on load
    "triton._group_rms_norm_kernel": 1,  # GroupRMSNorm fused with the sigmoid output gate
}
_MOE = {
    "triton._linear_kernel": 3,  # router logits (fp32, from the norm's fp32 copy), shared expert gate|up and down
    # (each layer's entry below sets its total)
    "triton._grouped_topk_kernel": 1,
    "triton._gemv_gate_up_kernel": 1,  # the routed experts' decode form: no alignment launch
    "triton._gemv_down_kernel": 1,  # its K rows per token are summed by the next norm, with the shared expert
    "triton._silu_and_mul_kernel": 1,  # the shared expert's activation
}
LING_BUDGET = {
    "outside": {"aten.embedding": 1, "triton._add_rms_norm_kernel": 1},  # final norm (+ layer 3's MoE parts)
    0: _LIGHTNING | {"triton._linear_kernel": 4, "triton._silu_and_mul_kernel": 1},  # + dense FFN: gate|up, down
    1: _LIGHTNING | _MOE | {"triton._linear_kernel": 5},
    2: _LIGHTNING | _MOE | {"triton._linear_kernel": 5},
    3: _MOE | {
        "triton._linear_kernel": 6,  # + fused q_a|kv_a projection, q_b, dense
        "triton._add_rms_norm_kernel": 3,  # input and post-attention norms, q_a_layernorm
        "triton._mla_latent_kernel": 1,  # kv_a_layernorm + RoPE + latent cache write, the query's RoPE
        "aten.bmm": 2,  # q_nope W_UK written into the attention query in place, the output's W_UV
        "triton._attention_kernel": 1,
    },
}


@pytest.mark.skipif(ON_GPU, reason="counts interpreted launches; on a GPU: python -m benchmarks.ops launches")
def test_ling_decode_layer_launch_budget():
    counts = decode_step_launches("ling", num_layers=4, batch_size=3)
    assert counts == LING_BUDGET
    assert sum(sum(c.values()) for c in counts.values()) == 54  # 57 before the MoE decode form dropped alignment


@pytest.mark.skipif(ON_GPU, reason="counts interpreted launches; on a GPU: python -m benchmarks.ops launches")
@pytest.mark.parametrize("name, layers", [("zaya", 3), ("ling", 4)])
def test_fp8_decode_step_has_the_16bit_launches(name: str, layers: int):
    """Online FP8 (every projection but MLA's kv_b_proj, and the routed experts): decode sizes are weight-only; up to
    E4M3_GEMV_MAX_TOKENS tokens the e4m3 GEMVs take x as it is (ops.triton.gemv.dot_rows), so a decode step
    launches exactly what the 16-bit step does."""
    tokens = E4M3_GEMV_MAX_TOKENS
    plain = decode_step_launches(name, num_layers=layers, batch_size=tokens)
    assert decode_step_launches(name, num_layers=layers, batch_size=tokens, quantization="fp8") == plain


@pytest.mark.skipif(ON_GPU, reason="counts interpreted launches; on a GPU: python -m benchmarks.ops launches")
def test_fp8_decode_step_beyond_the_gemv_runs_weight_only_gemms():
    """Past E4M3_GEMV_MAX_TOKENS, up to WEIGHT_ONLY_MAX_ROWS, the e4m3 projections run the weight-only tl.dot GEMM:
    one launch each, x not quantized (no quantization launch of its own), no GEMV left on an e4m3 weight."""
    counts = decode_step_launches("zaya", num_layers=3, batch_size=WEIGHT_ONLY_MAX_ROWS, quantization="fp8")[1]
    assert counts["triton._gemm_kernel"] == 2  # the fused q|k|v|v projection, o_proj
    assert "triton._linear_kernel" not in counts
    # the routed experts' x and SwiGLU rows only: 16 (token, expert) pairs are W8A8, past WEIGHT_ONLY_MAX_PAIRS
    assert WEIGHT_ONLY_MAX_ROWS > WEIGHT_ONLY_MAX_PAIRS and counts["triton._quantize_kernel"] == 2
