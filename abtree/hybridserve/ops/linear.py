"""Dense linear layers (the 16-bit projections of layers/linear.py): x @ W^T (+ bias). Backend op "linear".

On CUDA, decode-sized inputs (at most `ops.triton.linear.FASTER_UP_TO_TOKENS` rows) of 16-bit weights up to
`FASTER_UP_TO_WEIGHT_BYTES` run the GEMV kernel, where it beats cuBLAS;
everything else, and the reference the kernel is tested against, is torch's F.linear (cuBLAS on CUDA). fp32 weights
(ZAYA1's router) always take F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.ops import backends


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]."""
    if weight.dtype in (torch.float16, torch.bfloat16) and backends.use_triton("linear", x.device):
        from hybridserve.ops.triton import linear as kernel
        if x.numel() <= kernel.FASTER_UP_TO_TOKENS * x.shape[-1] and x.dtype == weight.dtype \
                and x.stride(-1) == 1 and weight.is_contiguous() \
                and weight.numel() * weight.element_size() <= kernel.FASTER_UP_TO_WEIGHT_BYTES:
            return kernel.linear(x, weight, bias)
    return F.linear(x, weight, bias)
