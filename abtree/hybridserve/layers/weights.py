"""Per-parameter weight loaders: how one checkpoint tensor lands in one (possibly sharded or stacked) parameter.

A parameter may carry `weight_loader(param, tensor, shard_id)`; the checkpoint loader calls it for every tensor
mapped onto that parameter. `shard_id` names a piece of a stacked or fused parameter (an expert index, a block of
a merged projection); None means the tensor holds the whole (unsharded) parameter.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from hybridserve.core.parallel import tp_rank, tp_size

WeightLoader = Callable[[nn.Parameter, torch.Tensor, Hashable | None], None]


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape its parameter expects."""


def check_shape(expected: torch.Size | tuple[int, ...], loaded: torch.Tensor) -> None:
    if tuple(expected) != tuple(loaded.shape):
        raise WeightShapeError(f"has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter does not take shards (got shard {shard_id!r})")
    check_shape(param.shape, loaded)
    param.data.copy_(loaded)


def new_parameter(*shape: int, dtype: torch.dtype | None = None, loader: WeightLoader | None = None,
                  shard_ids: frozenset | None = None) -> nn.Parameter:
    """An uninitialised parameter (weights always come from a checkpoint) with its loader attached.

    `shard_ids`, when given, lists the pieces that together fill the parameter; loading all of them is an
    alternative to loading the whole tensor at once.
    """
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader or default_weight_loader
    param.shard_ids = shard_ids
    return param


def shard_slice(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """The rank's contiguous 1/size slice of `full` along `dim`."""
    if full.shape[dim] % size:
        raise WeightShapeError(f"dimension {dim} of shape {tuple(full.shape)} does not split into {size} shards")
    step = full.shape[dim] // size
    return full.narrow(dim, rank * step, step)


def tp_shard_loader(dim: int) -> WeightLoader:
    """A loader that copies this rank's contiguous slice of the full tensor along `dim` (column-parallel: 0,
    row-parallel: 1, vocab-parallel: 0)."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        shard = shard_slice(loaded, dim, tp_rank(), tp_size())
        check_shape(param.shape, shard)
        param.data.copy_(shard)
    return load


def stacked_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None) -> None:
    """Fill a stacked parameter [N, ...] either whole or one entry (shard_id = index) at a time."""
    if shard_id is None:
        default_weight_loader(param, loaded)
        return
    check_shape(param.shape[1:], loaded)
    param.data[shard_id].copy_(loaded)
