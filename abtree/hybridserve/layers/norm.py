"""RMS normalisation (statistics in fp32, Llama-style weight, not Gemma's 1+w), over the whole row or per group."""
from __future__ import annotations

import torch
from torch import nn

from hybridserve.core.parallel import divide, tp_size
from hybridserve.layers.weights import new_parameter, tp_shard_loader
from hybridserve.ops.ling_norm import add_rms_norm, group_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Output in the weight's dtype, so an fp32 input (a residual stream) is rounded once, after normalising."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, addend: torch.Tensor | None = None,
                fp32_copy: bool = False):
        """RMSNorm(x); with `residual`, the triple (RMSNorm(x (+ addend) + residual), x (+ addend) + residual, the
        norm as fp32 if `fp32_copy` else None), in one fused op (`ops.ling_norm.add_rms_norm`)."""
        if residual is not None:
            return add_rms_norm(x, residual, self.weight, self.eps, addend, fp32_copy)
        if addend is not None or fp32_copy:
            raise ValueError("addend and fp32_copy come with a residual")
        return rms_norm(x, self.weight, self.eps)


class GroupRMSNorm(nn.Module):
    """RMS statistics over each of `num_groups` contiguous channel groups (Ling's lightning output norm), optionally
    fused with the sigmoid output gate.

    Under tensor parallelism a rank holds whole groups (num_groups % tp == 0), so no statistic crosses ranks.
    """

    def __init__(self, hidden_size: int, num_groups: int, eps: float):
        super().__init__()
        self.eps = eps
        self.num_groups = divide(num_groups, tp_size(), "group_norm_size")
        self.weight = new_parameter(divide(hidden_size, tp_size(), "group-normed channels"),
                                    loader=tp_shard_loader(0))

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, C]; with `gate` [T, C] the result is times sigmoid(gate), in the gate's dtype."""
        return group_rms_norm(x, self.weight, self.num_groups, self.eps, gate)
