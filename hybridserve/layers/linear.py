"""Linear layers that know how they are split across tensor-parallel ranks.

Column-parallel layers split the output features, row-parallel layers split the input features and sum the
partial outputs. Each layer's weight loader cuts the full checkpoint tensor down to this rank's shard, so the
checkpoint loader never needs to know about parallelism. With an FP8 scheme (`quant`) the weight is e4m3 with its
scales (layers/weights.py), sliced alike, and the product runs as an FP8 op (ops.linear).
"""
from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn

from hybridserve.core.parallel import all_reduce, divide, tp_rank, tp_size
from hybridserve.core.quant import Fp8Scheme
from hybridserve.layers.weights import (
    Loaded,
    check_shape,
    fp8_scales,
    new_parameter,
    shard_slice,
    tp_shard_loader,
    weight_parameter,
    weight_target,
)
from hybridserve.ops.linear import linear, linear_residual_norm, takes_pending
from hybridserve.ops.norm import PendingNorm, ResidualNorm


class ReplicatedLinear(nn.Module):
    """Every rank holds the whole weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None,
                 quant: Fp8Scheme | None = None):
        super().__init__()
        weight_parameter(self, "weight", (out_features, in_features), quant, dtype=dtype)
        self.bias = new_parameter(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, fp8_scales(self.weight))


class ColumnParallelLinear(nn.Module):
    """Output features split contiguously over ranks; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: Fp8Scheme | None = None):
        super().__init__()
        local = divide(out_features, tp_size(), "output features")
        weight_parameter(self, "weight", (local, in_features), quant, loader=tp_shard_loader(0))
        self.bias = new_parameter(local, loader=tp_shard_loader(0)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, fp8_scales(self.weight))


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel projections fused into one GEMM (gate+up, ZAYA's q|k|v|v, Ling's Q|K|V|G blocks).

    Each block is sharded on its own, so a rank holds [block0 shard | block1 shard | ...]; a block marked in
    `replicated` is kept whole on every rank instead. `pieces` says how a checkpoint stores the blocks: each piece
    is a run of consecutive blocks kept in one tensor, loaded with its index as shard_id (default: one tensor per
    block). A tensor holding every block concatenated loads with shard_id None.
    """

    def __init__(self, in_features: int, block_sizes: list[int], bias: bool = False,
                 replicated: list[bool] | None = None, pieces: list[tuple[int, ...]] | None = None,
                 quant: Fp8Scheme | None = None):
        super().__init__()
        self.block_sizes = list(block_sizes)
        self.replicated = list(replicated) if replicated is not None else [False] * len(block_sizes)
        if len(self.replicated) != len(self.block_sizes):
            raise ValueError("replicated needs one flag per block")
        self.local_sizes = [n if whole else divide(n, tp_size(), "block output features")
                            for n, whole in zip(block_sizes, self.replicated)]
        self.pieces = pieces or [(i,) for i in range(len(block_sizes))]
        if [b for piece in self.pieces for b in piece] != list(range(len(block_sizes))):
            raise ValueError(f"pieces {self.pieces} must list the {len(block_sizes)} blocks once each, in order")
        ids = frozenset(range(len(self.pieces)))
        weight_parameter(self, "weight", (sum(self.local_sizes), in_features), quant, loader=self._load, shard_ids=ids)
        self.bias = new_parameter(sum(self.local_sizes), loader=self._load, shard_ids=ids) if bias else None

    def _load(self, param: nn.Parameter, loaded: Loaded, shard_id: Hashable | None = None) -> None:
        blocks = range(len(self.block_sizes)) if shard_id is None else self.pieces[shard_id]
        check_shape((sum(self.block_sizes[b] for b in blocks), *param.shape[1:]), loaded)
        for block, full in zip(blocks, loaded.split([self.block_sizes[b] for b in blocks], dim=0)):
            shard = full if self.replicated[block] else shard_slice(full, 0, tp_rank(), tp_size())
            target = weight_target(param).narrow(0, sum(self.local_sizes[:block]), self.local_sizes[block])
            check_shape(target.shape, shard)
            target.copy_(shard)

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        """x, or the PendingNorm whose h it is (finished in the product's launch where `takes_pending`)."""
        return linear(x, self.weight, self.bias, fp8_scales(self.weight))

    def takes_pending(self, tokens: int) -> bool:
        """Whether `forward` of a PendingNorm of `tokens` rows finishes it in its own launch (ops.linear)."""
        return takes_pending(tokens, self.weight, fp8_scales(self.weight))


class RowParallelLinear(nn.Module):
    """Input features split over ranks; partial outputs are summed (unless the caller defers the reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True,
                 quant: Fp8Scheme | None = None):
        super().__init__()
        local = divide(in_features, tp_size(), "input features")
        self.reduce_results = reduce_results
        weight_parameter(self, "weight", (out_features, local), quant, loader=tp_shard_loader(1))
        self.bias = new_parameter(out_features) if bias else None

    def forward(self, x: torch.Tensor, norm: ResidualNorm | None = None):
        """The (reduced) output, or with `norm` (the residual norm that consumes it) `norm`'s (x, h, h32): run in
        the projection's own kernel when nothing comes between them (one rank, no bias)."""
        if norm is not None and not self.reduce_results:
            raise ValueError("a residual norm needs the reduced output (reduce_results=True)")
        fp8 = fp8_scales(self.weight)
        if norm is not None and tp_size() == 1 and self.bias is None:
            return linear_residual_norm(x, self.weight, None, norm, fp8)
        out = linear(x, self.weight, fp8=fp8)
        if self.reduce_results:
            out = all_reduce(out)
        # The bias is replicated, so it is added once, after the sum.
        out = out if self.bias is None else out + self.bias
        return out if norm is None else norm(out)
