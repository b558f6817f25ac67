"""The decode kernels' GPU-only paths build for Hopper without a GPU (tests/ops/sm90_compile.py): the decode-sized
kernel tests run interpreted under the recording plugin, then every kernel variant they launched is compiled for
sm_90 with USE_PDL on (the L2 prefetches before the wait, griddepcontrol). A Triton error there would otherwise
first show on the GPU machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ops.conftest import ON_GPU
from tests.ops.sm90_compile import RECORDS_ENV

pytestmark = pytest.mark.heavy  # scheduled first: tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
# Decode-sized tests of the kernels that read weights or keys before their PDL wait (one input dtype each: the
# variants that matter differ in the constexprs the shapes and schemes pick).
TESTS = [
    "tests/ops/test_attention_kernel.py::test_decode",
    "tests/ops/test_attention_kernel.py::test_split_merge_in_chunks_of_splits",
    "tests/ops/test_decode_gemv_kernel.py::test_experts_match_reference",
    "tests/ops/test_decode_gemv_kernel.py::test_ling_router_logits_in_one_preloaded_chunk",
    "tests/ops/test_decode_gemv_kernel.py::test_linear_norm_epilogue_equals_the_norm_kernel",
    "tests/ops/test_decode_gemv_kernel.py::test_experts_norm_epilogue_equals_the_norm_kernel",
    "tests/ops/test_decode_gemv_kernel.py::test_linear_finishes_a_pending_norm",
    "tests/ops/test_fp8_linear_kernel.py::test_forms_match_reference",
    "tests/ops/test_fp8_linear_kernel.py::test_gemv_finishes_a_pending_norm",
    "tests/ops/test_ling_norm_kernel.py::test_add_rms_norm",
    "tests/ops/test_fp8_moe_kernel.py::test_forms_match_reference",
    "tests/ops/test_conv_qk_epilogue_kernel.py::test_decode_steps",
    "tests/ops/test_zaya_router_kernel.py::test_fused_form_repeats_bitwise",
    "tests/ops/test_zaya_router_kernel.py::test_norm_in_the_first_launch_equals_the_norm_then_the_router",
    "tests/ops/test_zaya_router_kernel.py::test_a_selection_deferred_to_the_experts_equals_launch_3s",
]
SELECTION = "not dtype1 and not float16 and not gemm and not grouped"
KERNELS = {"_linear_kernel", "_gemv_gate_up_kernel", "_gemv_down_kernel", "_attention_kernel", "_cca_conv_kernel",
           "_dense_kernel", "_normed_down_kernel", "_add_rms_norm_kernel"}


@pytest.mark.skipif(ON_GPU, reason="on a GPU every kernel test compiles its kernels for the GPU itself")
def test_decode_kernels_build_for_sm90_with_pdl(tmp_path: Path) -> None:
    records = tmp_path / "launches.json"
    interpreted = dict(os.environ, TRITON_INTERPRET="1", **{RECORDS_ENV: str(records)})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-p",
                          "tests.ops.sm90_compile", "-k", SELECTION, *TESTS], cwd=ROOT, env=interpreted,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    launched = {record["name"] for record in json.loads(records.read_text())}
    assert KERNELS <= launched, f"not launched: {KERNELS - launched}"
    compiled = subprocess.run([sys.executable, "-m", "tests.ops.sm90_compile", str(records)], cwd=ROOT,
                              env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                              capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout[-5000:] + compiled.stderr[-3000:]
