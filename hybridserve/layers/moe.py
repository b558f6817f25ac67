"""Stacked SwiGLU expert weights, sharded along the intermediate dimension under tensor parallelism.

Checkpoints give either the whole stack ([E, 2I, H] gate rows first, then up rows; [E, H, I]), one expert at a
time (shard_id = expert index), or, with `split_gate_up`, each expert's gate and up projections as separate
tensors (shard_id = (expert, 0 for gate | 1 for up)). Each rank keeps [gate shard | up shard] rows and the
matching down columns, so the routed output is a partial sum to be reduced by the caller.
"""
from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn

from hybridserve.core.parallel import all_reduce, divide, tp_rank, tp_size
from hybridserve.layers.weights import check_shape, new_parameter, shard_slice
from hybridserve.ops.moe import fused_experts, fused_experts_residual_norm
from hybridserve.ops.norm import ResidualNorm


def _gate_up_shard(full: torch.Tensor) -> torch.Tensor:
    """[..., 2I, H] -> this rank's [..., 2I/tp, H] = [gate shard ; up shard]."""
    gate, up = full.chunk(2, dim=-2)
    return torch.cat([shard_slice(gate, -2, tp_rank(), tp_size()), shard_slice(up, -2, tp_rank(), tp_size())], -2)


def _load_gate_up(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None) -> None:
    if isinstance(shard_id, tuple):
        expert, half = shard_id
        rows = param.shape[-2] // 2
        target = param.data[expert].narrow(-2, half * rows, rows)
        shard = shard_slice(loaded, -2, tp_rank(), tp_size())
        check_shape(target.shape, shard)
        target.copy_(shard)
        return
    target = param.data if shard_id is None else param.data[shard_id]
    if loaded.shape[-2] % 2:
        raise ValueError(f"fused gate/up tensor has an odd number of rows: {tuple(loaded.shape)}")
    shard = _gate_up_shard(loaded)
    check_shape(target.shape, shard)
    target.copy_(shard)


def _load_down(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None) -> None:
    target = param.data if shard_id is None else param.data[shard_id]
    shard = shard_slice(loaded, -1, tp_rank(), tp_size())
    check_shape(target.shape, shard)
    target.copy_(shard)


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, split_gate_up: bool = False):
        super().__init__()
        local = divide(intermediate_size, tp_size(), "expert intermediate size")
        ids = frozenset(range(num_experts))
        gate_up_ids = frozenset((e, half) for e in ids for half in (0, 1)) if split_gate_up else ids
        self.gate_up_proj = new_parameter(num_experts, 2 * local, hidden_size, loader=_load_gate_up,
                                          shard_ids=gate_up_ids)
        self.down_proj = new_parameter(num_experts, hidden_size, local, loader=_load_down, shard_ids=ids)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                reduce: bool = True) -> torch.Tensor:
        """The weighted sum over each token's chosen experts (a partial sum under tensor parallelism); with
        `reduce=False`, rows [T, P, H] that sum to it (`ops.moe.fused_experts`)."""
        return fused_experts(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, reduce)

    def forward_residual_norm(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                              norm: ResidualNorm):
        """`norm` (the residual norm consuming the output) on the weighted sum, reduced over ranks first: -> its
        (x, h, h32). On one rank the decode kernels run the norm in their own launch."""
        if tp_size() == 1:
            return fused_experts_residual_norm(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, norm)
        return norm(all_reduce(self(x, topk_ids, topk_weights)))
