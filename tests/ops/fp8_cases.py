"""FP8 (e4m3) test vocabulary shared by the FP8 kernel tests (tests/ops/test_fp8_*_kernel.py): the schemes the
kernels take, the mantissa widths their one-rounding bounds use, launch configurations of the tl.dot forms, and
scales with NaN after them."""
from __future__ import annotations

import torch

from hybridserve.core.quant import Fp8Scheme

BLOCK = (128, 128)
SCHEMES = {  # every weight-scale layout with every activation scaling it allows ("tensor": kept per row)
    "channel/token": Fp8Scheme("channel", "token"),
    "tensor/static": Fp8Scheme("tensor", "static"),
    "block/group": Fp8Scheme("block", "group", BLOCK),
    "block/token": Fp8Scheme("block", "token", BLOCK),
    "block/static": Fp8Scheme("block", "static", BLOCK),
}
MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def gemm_config(block_m: int, block_n: int, block_k: int, group_m: int = 1) -> dict[str, int]:
    """A tl.dot form's launch configuration (fp8_linear.gemm, fp8_moe.grouped_experts)."""
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=4, num_stages=2)


def nan_padded(scales: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `scales` followed in memory by NaNs: a kernel reading past the scales poisons its
    output."""
    padded = torch.full((scales.numel() + 64,), float("nan"), device=scales.device)
    padded[:scales.numel()] = scales.flatten()
    return padded[:scales.numel()].view(scales.shape)
