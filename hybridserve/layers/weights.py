"""Per-parameter weight loaders: how one checkpoint tensor lands in one (possibly sharded or stacked) parameter.

A parameter may carry `weight_loader(param, tensor, shard_id)`; the checkpoint loader calls it for every tensor
mapped onto that parameter. `shard_id` names a piece of a stacked or fused parameter (an expert index, a block of
a merged projection); None means the tensor holds the whole (unsharded) parameter.

FP8 weights (`weight_parameter` with a scheme): the weight parameter is float8_e4m3fn and carries its companions,
`<name>_scale` (fp32, one per row or one per 128x128 block) and, for the static activation scheme,
`<name>_input_scale` (0-d fp32; a fused layer's pieces and an expert stack's experts share the largest of
theirs, as one quantization of the input serves them all). Loaders write through `weight_target(param)`: the
parameter's data for a 16-bit weight, an `Fp8Target` for an FP8 one, which narrows and indexes like a tensor and
takes either a checkpoint's FP8 tensor with its scales (`core.quant.QuantizedTensor`, which narrows alike, so
the tensor-parallel slicing below serves both) or, with an online scheme, a 16-bit tensor it quantizes per row.
The checkpoint loader hands 16-bit parameters FP8 tensors already dequantized.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from hybridserve.core.parallel import tp_rank, tp_size
from hybridserve.core.quant import FP8_DTYPE, Fp8Scales, Fp8Scheme, QuantizedTensor, narrow_scaled
from hybridserve.ops.reference.fp8 import quantize_weight_rows

Loaded = torch.Tensor | QuantizedTensor
WeightLoader = Callable[[nn.Parameter, Loaded, Hashable | None], None]


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape its parameter expects."""


def check_shape(expected: torch.Size | tuple[int, ...], loaded: Loaded) -> None:
    if tuple(expected) != tuple(loaded.shape):
        raise WeightShapeError(f"has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded: Loaded, shard_id: Hashable | None = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter does not take shards (got shard {shard_id!r})")
    check_shape(param.shape, loaded)
    weight_target(param).copy_(loaded)


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


def shard_slice(full: Loaded, dim: int, rank: int, size: int) -> Loaded:
    """The rank's contiguous 1/size slice of `full` along `dim`."""
    if full.shape[dim] % size:
        raise WeightShapeError(f"dimension {dim} of shape {tuple(full.shape)} does not split into {size} shards")
    step = full.shape[dim] // size
    return full.narrow(dim, rank * step, step)


def tp_shard_loader(dim: int) -> WeightLoader:
    """A loader that copies this rank's contiguous slice of the full tensor along `dim` (column-parallel: 0,
    row-parallel: 1, vocab-parallel: 0)."""
    def load(param: nn.Parameter, loaded: Loaded, shard_id: Hashable | None = None) -> None:
        shard = shard_slice(loaded, dim, tp_rank(), tp_size())
        check_shape(param.shape, shard)
        weight_target(param).copy_(shard)
    return load


def weight_parameter(module: nn.Module, name: str, shape: tuple[int, ...], scheme: Fp8Scheme | None,
                     loader: WeightLoader | None = None, shard_ids: frozenset | None = None,
                     dtype: torch.dtype | None = None) -> nn.Parameter:
    """Register the weight `name` of `shape` ([..., N, K]) on `module`: 16-bit (or `dtype`) without a scheme, else
    e4m3 with its scale companions (registered right after it)."""
    if scheme is None:
        param = new_parameter(*shape, dtype=dtype, loader=loader, shard_ids=shard_ids)
        setattr(module, name, param)
        return param
    param = new_parameter(*shape, dtype=FP8_DTYPE, loader=loader, shard_ids=shard_ids)
    setattr(module, name, param)
    if scheme.weight == "block":
        bn, bk = scheme.block
        scale_shape = (*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk))
    else:
        scale_shape = shape[:-1]
    scale = _companion(*scale_shape)
    setattr(module, f"{name}_scale", scale)
    input_scale = None
    if scheme.activation == "static":
        input_scale = _companion()
        input_scale.data.zero_()  # the loads take the largest scale of the pieces
        setattr(module, f"{name}_input_scale", input_scale)
    param.fp8 = Fp8Scales(scale, scheme, input_scale)
    return param


def _companion(*shape: int) -> nn.Parameter:
    """A scale parameter, filled by its weight's loader (never by a checkpoint tensor of its own name)."""
    param = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
    param.fp8_companion = True
    return param


def fp8_scales(param: nn.Parameter) -> Fp8Scales | None:
    """The scales an FP8 op needs with this weight (None: a 16-bit weight)."""
    return getattr(param, "fp8", None)


def weight_target(param: nn.Parameter):
    """Where a weight loader writes: the 16-bit parameter's data, or an FP8 parameter's `Fp8Target`."""
    scales = fp8_scales(param)
    if scales is None:
        return param.data
    return Fp8Target(param.data, scales.scale.data, scales.scheme,
                     scales.input_scale.data if scales.input_scale is not None else None)


class Fp8Target:
    """A view of an FP8 weight and the matching view of its scales (rows, columns, or an expert of a stack)."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, input_scale: torch.Tensor | None):
        self.data, self.scale, self.scheme, self.input_scale = data, scale, scheme, input_scale

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def narrow(self, dim: int, start: int, length: int) -> Fp8Target:
        data, scale = narrow_scaled(self.data, self.scale, self.scheme, dim, start, length)
        return Fp8Target(data, scale, self.scheme, self.input_scale)

    def __getitem__(self, index: int) -> Fp8Target:
        """One expert of a stack."""
        return Fp8Target(self.data[index], self.scale[index], self.scheme, self.input_scale)

    def copy_(self, loaded: torch.Tensor | QuantizedTensor) -> None:
        """Store a checkpoint's FP8 tensor and its scales, or quantize a 16-bit one (online schemes only)."""
        check_shape(self.shape, loaded)
        if isinstance(loaded, QuantizedTensor):
            if (loaded.scheme.weight == "block") != (self.scheme.weight == "block"):
                raise WeightShapeError(f"has {loaded.scheme.weight} scales; the layer expects {self.scheme.weight}")
            check_shape(self.scale.shape, loaded.scale)
            self.data.copy_(loaded.data)
            self.scale.copy_(loaded.scale)
            if self.input_scale is not None:
                if loaded.input_scale is None:
                    raise WeightShapeError("comes without the input_scale its static activation scheme needs")
                torch.maximum(self.input_scale, loaded.input_scale.to(self.input_scale.device),
                              out=self.input_scale)
            return
        if not self.scheme.online:
            raise WeightShapeError(f"is {loaded.dtype}, but the quantization config makes it an FP8 "
                                   "(float8_e4m3fn) tensor with scales")
        values, scale = quantize_weight_rows(loaded)
        self.data.copy_(values)
        self.scale.copy_(scale)
