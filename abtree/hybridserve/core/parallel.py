"""Tensor-parallel group state and collectives.

Every rank builds the same model with its own shard of each weight; the helpers below are the only places that
know the rank. With one process (the default) they are identities, so single-device code pays nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


_TP = ParallelGroup()


def set_tensor_parallel_group(rank: int, size: int, group: dist.ProcessGroup | None) -> None:
    """Install the tensor-parallel group; called once per process before the model is built."""
    global _TP
    _TP = ParallelGroup(rank=rank, size=size, group=group)


def tp_rank() -> int:
    return _TP.rank


def tp_size() -> int:
    return _TP.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results over the tensor-parallel group (in place; returns x)."""
    if _TP.size > 1:
        dist.all_reduce(x, group=_TP.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice along the last dimension (vocab-parallel logits)."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division with an error that names the dimension that does not split."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator
