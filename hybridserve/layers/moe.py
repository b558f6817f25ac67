"""Stacked SwiGLU expert weights, sharded along the intermediate dimension under tensor parallelism.

Checkpoints give either the whole stack ([E, 2I, H] gate rows first, then up rows; [E, H, I]), one expert at a
time (shard_id = expert index), or, with `split_gate_up`, each expert's gate and up projections as separate
tensors (shard_id = (expert, 0 for gate | 1 for up)). Each rank keeps [gate shard | up shard] rows and the
matching down columns, so the routed output is a partial sum to be reduced by the caller. With an FP8 scheme both
stacks are e4m3 with their scales (layers/weights.py), sliced alike.
"""
from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn

from hybridserve.core.parallel import all_reduce, divide, tp_rank, tp_size
from hybridserve.core.quant import Fp8Scheme
from hybridserve.layers.weights import Loaded, check_shape, fp8_scales, shard_slice, weight_parameter, weight_target
from hybridserve.ops.moe import fused_experts, fused_experts_residual_norm, takes_deferred_selection
from hybridserve.ops.norm import ResidualNorm
from hybridserve.ops.reference.zaya_router import DeferredSelection


def _copy_shard(target, loaded: Loaded, dim: int) -> None:
    shard = shard_slice(loaded, dim, tp_rank(), tp_size())
    check_shape(target.shape, shard)
    target.copy_(shard)


def _load_gate_up(param: nn.Parameter, loaded: Loaded, shard_id: Hashable | None) -> None:
    """A stack, one expert (shard_id = its index) or one half of one (shard_id = (expert, 0 gate | 1 up)); each
    half's rows are sharded on their own: a rank holds [gate shard ; up shard]."""
    target = weight_target(param)
    rows = param.shape[-2] // 2
    if isinstance(shard_id, tuple):
        expert, half = shard_id
        _copy_shard(target[expert].narrow(-2, half * rows, rows), loaded, -2)
        return
    target = target if shard_id is None else target[shard_id]
    if loaded.shape[-2] % 2:
        raise ValueError(f"fused gate/up tensor has an odd number of rows: {tuple(loaded.shape)}")
    for half, piece in enumerate(loaded.chunk(2, dim=-2)):
        _copy_shard(target.narrow(-2, half * rows, rows), piece, -2)


def _load_down(param: nn.Parameter, loaded: Loaded, shard_id: Hashable | None) -> None:
    target = weight_target(param)
    _copy_shard(target if shard_id is None else target[shard_id], loaded, -1)


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, split_gate_up: bool = False,
                 quant: Fp8Scheme | None = None):
        super().__init__()
        local = divide(intermediate_size, tp_size(), "expert intermediate size")
        ids = frozenset(range(num_experts))
        gate_up_ids = frozenset((e, half) for e in ids for half in (0, 1)) if split_gate_up else ids
        weight_parameter(self, "gate_up_proj", (num_experts, 2 * local, hidden_size), quant, loader=_load_gate_up,
                         shard_ids=gate_up_ids)
        weight_parameter(self, "down_proj", (num_experts, hidden_size, local), quant, loader=_load_down,
                         shard_ids=ids)

    def _fp8(self):
        scales = fp8_scales(self.gate_up_proj)
        return None if scales is None else (scales, fp8_scales(self.down_proj))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                reduce: bool = True) -> torch.Tensor:
        """The weighted sum over each token's chosen experts (a partial sum under tensor parallelism); with
        `reduce=False`, rows [T, P, H] that sum to it (`ops.moe.fused_experts`)."""
        return fused_experts(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, reduce, self._fp8())

    def forward_residual_norm(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                              norm: ResidualNorm, selection: DeferredSelection | None = None):
        """`norm` (the residual norm consuming the output) on the weighted sum, reduced over ranks first: -> its
        (x, h, h32), h possibly a PendingNorm where `norm.h_pending` allows it. On one rank the decode kernels run
        the norm in their own launch. `selection`: the routing's class selection deferred to those launches (only
        where `takes_deferred_selection`)."""
        if tp_size() == 1:
            return fused_experts_residual_norm(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, norm,
                                               self._fp8(), selection)
        if selection is not None:
            raise ValueError("a deferred selection needs the experts on one rank")
        return norm(all_reduce(self(x, topk_ids, topk_weights)))

    def takes_deferred_selection(self, tokens: int) -> bool:
        """Whether `forward_residual_norm` of `tokens` tokens with one choice each takes a routing whose class
        selection is left to its launches (`ops.moe.takes_deferred_selection`, on one rank). Host sizes only."""
        return (tp_size() == 1 and self.gate_up_proj.is_contiguous() and self.down_proj.is_contiguous()
                and takes_deferred_selection(tokens, self.gate_up_proj.device, self._fp8()))
