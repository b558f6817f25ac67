"""ResidualNormArgs: `residual_rms_norm`'s arguments besides the update, which a kernel packs into its launch.

They sit below ops/norm.py, whose `ResidualNorm` adds the call that picks a kernel, and ops/triton/norm.py, which
builds them for its own launch: each module imports this one and neither imports the other back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ResidualNormArgs:
    norm_weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    update_bias: torch.Tensor | None = None
    update_scale: torch.Tensor | None = None
    residual_bias: torch.Tensor | None = None
    residual_scale: torch.Tensor | None = None
    skip_weight: torch.Tensor | None = None
    skip_input: torch.Tensor | None = None
    fp32_copy: bool = False
    # The reader of h takes an `ops.norm.PendingNorm` in its place: a kernel that can may store x and the rows' sums
    # of squares and leave h to that reader's launch.
    h_pending: bool = False

    def __post_init__(self):
        if (self.skip_weight is None) != (self.skip_input is None):
            raise ValueError("skip_weight and skip_input come together")
        if self.h_pending and self.fp32_copy:
            raise ValueError("a pending h has no fp32 copy")
