"""`python -m benchmarks.ops MODE [options]`: the kernels alone, their tuning and the launches of a decode step.
`MODE --help` lists a mode's options."""
from __future__ import annotations

from benchmarks.cli import run_mode

MODES = {
    "micro": ("benchmarks.ops._micro", "each kernel against its torch reference and its bytes/FLOPs floor "
                                          "(cases: benchmarks/ops/<op>.py)"),
    "fp8": ("benchmarks.ops.fp8", "the FP8 kernels against the bf16 paths they replace: achieved bandwidth"),
    "grid-sync": ("benchmarks.ops.grid_sync", "a kernel boundary against a grid barrier in one persistent launch"),
    "launches": ("benchmarks.ops._launches", "CUDA kernel launches of one decode step at real widths"),
    "layer-launches": ("benchmarks.ops._layer_launches", "launches per decoder layer, counted on CPU "
                                                         "(no GPU needed)"),
    "tune-moe": ("benchmarks.ops._tune_moe", "the fused-MoE tile tables that ops/triton/moe_config.py reads"),
    "tune-fp8-linear": ("benchmarks.ops._tune_fp8_linear", "whether another form (GEMV, weight-only or W8A8 GEMM) "
                                                           "or other tiles of the e4m3 linears are faster at decode "
                                                           "sizes than the ones they take"),
    "tune-zaya-router": ("benchmarks.ops._tune_zaya_router", "whether another tile constant of the EDA router "
                                                             "kernel is faster than the shipped one"),
}

if __name__ == "__main__":
    run_mode("ops", MODES)
