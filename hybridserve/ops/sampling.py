"""Inverse-CDF draws (`ops.reference.sampling`): the unsorted draw (no top-k / top-p, the common case) runs the
Triton kernel on CUDA, three launches instead of some thirty torch ops; the sorted draw is always torch (it
needs the vocabulary sorted anyway)."""
from __future__ import annotations

import torch

from hybridserve.ops import backends
from hybridserve.ops.reference import sampling as reference


def draw_unsorted(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """fp32 logits [rows, V], float64 params [rows, 5] (temperature, top-k, top-p, min-p, u) -> ids [rows] int64."""
    if backends.use_triton("sampling", logits.device):
        from hybridserve.ops.triton import sampling as kernel
        return kernel.draw_unsorted(logits, params)
    return reference.draw_unsorted(logits, params)


draw_sorted = reference.draw_sorted
