"""FP8 quantization: which layers hold FP8 weights, how their scales are laid out, and how activations are scaled.

Three sources, one description (`Fp8Scheme`):
- `quant_method: "compressed-tensors"` (llm-compressor's float-quantized format): e4m3 weights with a per-channel
  (`strategy: channel`, `weight_scale` [N, 1]), per-tensor (`tensor`, one value) or 128x128 block (`block`)
  `weight_scale`; activations scaled per token at run time (`dynamic: true, strategy: token`), per 1x128 group
  (`group`, with block weights), or by the checkpoint's static per-tensor `input_scale`. Modules in `ignore`
  (exact names, or `re:` patterns matched from the start) stay 16-bit.
- `quant_method: "fp8"` with `weight_block_size: [128, 128]` (DeepSeek-V3 / Qwen3-FP8): e4m3 weights with
  `weight_scale_inv` per 128x128 block (the multiplier that dequantizes, despite its name), activations scaled per
  1x128 group at run time; `modules_to_not_convert` / `ignored_layers` stay 16-bit.
- online (`quantization="fp8"` on a 16-bit checkpoint): per-channel weight scales computed at load, activations
  per token at run time.

Decode-sized products keep x in 16 bits (weight-only, W8A16) on every backend: up to WEIGHT_ONLY_MAX_ROWS rows
of a linear layer's x, or WEIGHT_ONLY_MAX_PAIRS (token, choice) pairs of routed experts. There a step streams each
weight byte for a handful of multiply-adds, so quantizing x would only add work, and rounding (and errors) to
what the weights already carry; larger products quantize x as the scheme says (W8A8) for the FP8 tensor cores.

A scheme applies to the linear layers and experts a model marks quantizable; embeddings, the LM head, routers and
norms are never quantized. Anything in a quantization_config outside these forms is refused with an error that
names the field and its value.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
SCALE_EPS = 1e-12  # a floor for dynamic scales: an all-zero row quantizes to zeros, not NaN
WEIGHT_ONLY_MAX_ROWS = 16  # FP8 linear layers keep x 16-bit up to this many rows (decode sizes; W8A8 beyond)
WEIGHT_ONLY_MAX_PAIRS = 8  # FP8 routed experts keep x 16-bit up to this many (token, choice) pairs


def linear_weight_only(x: torch.Tensor) -> bool:
    """Whether an FP8 linear layer takes x [..., K] as it is: at most WEIGHT_ONLY_MAX_ROWS rows (a host-size test)."""
    return x.numel() <= WEIGHT_ONLY_MAX_ROWS * x.shape[-1]


def experts_weight_only(topk_ids: torch.Tensor) -> bool:
    """Whether FP8 routed experts take x as it is: at most WEIGHT_ONLY_MAX_PAIRS (token, choice) pairs."""
    return topk_ids.numel() <= WEIGHT_ONLY_MAX_PAIRS

WeightGranularity = Literal["channel", "tensor", "block"]
ActivationScaling = Literal["token", "group", "static"]


@dataclass(frozen=True)
class Fp8Scheme:
    """How one layer's FP8 weights and activations are scaled.

    weight: "channel" (one scale per output row), "tensor" (one per checkpoint tensor; kept per row once loaded, so
    fused layers whose pieces had different scales stay exact) or "block" (one per `block` = (rows, cols) tile).
    activation: "token" (per row of x at run time), "group" (per row and `block[1]` columns, at run time) or
    "static" (the checkpoint's per-tensor `input_scale`)."""

    weight: WeightGranularity
    activation: ActivationScaling
    block: tuple[int, int] | None = None
    online: bool = False  # the checkpoint is 16-bit: the weights are quantized (per row) while they load

    def __post_init__(self) -> None:
        if (self.weight == "block") != (self.block is not None):
            raise ValueError("a block size goes with block weight scales, and only with them")
        if self.activation == "group" and self.weight != "block":
            raise ValueError("per-group activation scales need block weight scales")

    @property
    def group(self) -> int | None:
        """Columns per activation scale (None: one scale per row, or a static one)."""
        return self.block[1] if self.activation == "group" else None


@dataclass
class QuantizedTensor:
    """A checkpoint's FP8 tensor with its scales, as the loader hands it to a parameter's weight loader.

    `data` [..., N, K] e4m3; `scale` multiplies it back, normalised on construction to one value per row
    [..., N] (channel and tensor scales alike) or to one per block [..., ceil(N / bn), ceil(K / bk)];
    `input_scale` is the static activation scale, when the scheme has one. It narrows, splits and indexes like a
    tensor (rows and columns of `data`, experts of a stack), carrying the matching scales along, so the layers'
    tensor-parallel loaders slice it as they slice a 16-bit weight."""

    data: torch.Tensor
    scale: torch.Tensor
    scheme: Fp8Scheme
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape, scale = self.data.shape, self.scale.float()
        if self.data.dtype != FP8_DTYPE or self.data.dim() < 2:
            raise ValueError(f"an FP8 weight is float8_e4m3fn with at least 2 dims, not {self.data.dtype} "
                             f"{tuple(shape)}")
        if self.scheme.weight == "block":
            bn, bk = self.scheme.block
            blocks = (*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk))
            if tuple(scale.shape) != blocks:
                raise ValueError(f"has block scales of shape {tuple(scale.shape)}, expected {blocks} for a "
                                 f"{tuple(shape)} weight in {bn}x{bk} blocks")
        elif scale.numel() == 1:
            scale = scale.reshape(()).expand(shape[:-1]).contiguous()
        elif scale.numel() == shape[:-1].numel():
            scale = scale.reshape(shape[:-1])
        elif self.data.dim() == 3 and scale.numel() == shape[0]:  # one scale per expert of a stack
            scale = scale.reshape(-1, 1).expand(shape[:-1]).contiguous()
        else:
            raise ValueError(f"has scales of shape {tuple(self.scale.shape)}, which fit neither one per row nor one "
                             f"per tensor of a {tuple(shape)} weight")
        self.scale = scale
        if self.input_scale is not None:
            self.input_scale = self.input_scale.float().max().reshape(())

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dim(self) -> int:
        return self.data.dim()

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows (dim -2) or columns (dim -1) of the weight, or experts (dim 0 of a stack), with their scales."""
        data, scale = narrow_scaled(self.data, self.scale, self.scheme, dim, start, length)
        return QuantizedTensor(data, scale, self.scheme, self.input_scale)

    def split(self, sizes: list[int], dim: int = 0) -> list[QuantizedTensor]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.narrow(dim, start, size) for start, size in zip(starts, sizes)]

    def chunk(self, chunks: int, dim: int = 0) -> list[QuantizedTensor]:
        size = self.data.shape[dim] // chunks
        return self.split([size] * chunks, dim)

    def __getitem__(self, index: int) -> QuantizedTensor:
        """One expert of a stack."""
        if self.data.dim() < 3:
            raise ValueError("only an expert stack is indexed")
        return QuantizedTensor(self.data[index], self.scale[index], self.scheme, self.input_scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The full-precision tensor these FP8 values and scales stand for (for a layer that runs 16-bit)."""
        return dequantize(self.data, self.scale, self.scheme).to(dtype)


def narrow_scaled(data: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, dim: int, start: int, length: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(`data` narrowed along `dim`, its scales narrowed to match): per-row scales follow the rows (and experts),
    block scales split only on block boundaries (or at the end)."""
    dim = dim - data.dim() if dim >= 0 else dim
    if scheme.weight != "block":
        return data.narrow(dim, start, length), scale if dim == -1 else scale.narrow(dim + 1, start, length)
    if dim < -2:  # experts
        return data.narrow(dim, start, length), scale.narrow(dim, start, length)
    size = scheme.block[dim + 2]
    if start % size or (length % size and start + length != data.shape[dim]):
        raise ValueError(f"cannot take {length} of dim {dim} at {start}: FP8 block scales split only on "
                         f"{size}-element boundaries (each tensor-parallel shard and fused block must be a multiple "
                         "of the block)")
    return data.narrow(dim, start, length), scale.narrow(dim, start // size, -(-length // size))


def dequantize(data: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    """fp32 values of FP8 `data` [..., N, K] with per-row [..., N] or per-block scales."""
    return data.float() * expand_scale(scale.float(), data.shape, scheme)


def expand_scale(scale: torch.Tensor, shape: torch.Size, scheme: Fp8Scheme) -> torch.Tensor:
    """Per-row or per-block `scale` broadcast to a weight of `shape` ([..., N, K])."""
    if scheme.weight == "block":
        bn, bk = scheme.block
        return scale.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :shape[-2], :shape[-1]]
    return scale[..., None]


@dataclass(frozen=True)
class Fp8Scales:
    """What an FP8 op needs beside the e4m3 weight: its scales (per row, or per block), the scheme, and the static
    activation scale (0-d; the static scheme only)."""

    scale: torch.Tensor
    scheme: Fp8Scheme
    input_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class QuantConfig:
    """The model's FP8 scheme and the checkpoint modules it does not cover."""

    scheme: Fp8Scheme
    ignore: tuple[str, ...] = field(default_factory=tuple)
    scale_suffix: str = "_scale"  # a weight's scale tensor in the checkpoint: its name + this suffix

    def scale_name(self, weight: str) -> str:
        """The checkpoint name of `weight`'s scales: `x.weight_scale` (compressed-tensors) or `x.weight_scale_inv`
        (block FP8); a stacked expert tensor `x.gate_up_proj` has `x.gate_up_proj_scale[_inv]`."""
        return weight + self.scale_suffix

    @staticmethod
    def input_scale_name(weight: str) -> str:
        """The checkpoint name of `weight`'s static activation scale: `x.input_scale` (or `x.gate_up_proj_input_scale`
        for a stacked expert tensor)."""
        return weight.removesuffix("weight") + "input_scale" if weight.endswith(".weight") else weight + "_input_scale"

    def scheme_for(self, *modules: str) -> Fp8Scheme | None:
        """The scheme of a layer made of these checkpoint modules, or None (16-bit) when any of them is ignored: a
        fused layer runs in one precision, and its FP8 pieces are then dequantized at load."""
        return None if any(self._ignored(m) for m in modules) else self.scheme

    def _ignored(self, module: str) -> bool:
        for rule in self.ignore:
            if rule.startswith("re:"):
                if re.match(rule[3:], module):
                    return True
            elif rule == module:
                return True
        return False


ONLINE_METHODS = ("fp8",)


def parse_quantization(config: dict, method: str | None) -> QuantConfig | None:
    """The QuantConfig of a model from its config.json (`quantization_config`) and the engine's `quantization`
    option `method` (None, or "fp8" to quantize a 16-bit checkpoint online). None: the model runs 16-bit."""
    hf = config.get("quantization_config")
    if method is not None and method not in ONLINE_METHODS:
        raise ValueError(f"invalid engine option quantization={method!r}: must be one of {', '.join(ONLINE_METHODS)}")
    if hf is None:
        if method is None:
            return None
        return QuantConfig(Fp8Scheme("channel", "token", online=True))
    if not isinstance(hf, dict):
        raise ValueError(f"quantization_config must be an object, not {type(hf).__name__}")
    quant_method = hf.get("quant_method")
    if quant_method == "compressed-tensors":
        parsed = _compressed_tensors(hf)
    elif quant_method == "fp8":
        parsed = _block_fp8(hf)
    else:
        raise ValueError(f"quantization_config.quant_method={quant_method!r} is not supported (supported: "
                         "'compressed-tensors' float-quantized FP8, 'fp8' with weight_block_size [128, 128])")
    if method is not None:
        raise ValueError(f"quantization={method!r} quantizes a 16-bit checkpoint, but this checkpoint is already "
                         f"quantized (quantization_config.quant_method={quant_method!r}): leave quantization unset")
    return parsed


def _refuse(key: str, value) -> None:
    raise ValueError(f"quantization_config.{key}={value!r} is not supported")


def _block_fp8(hf: dict) -> QuantConfig:
    block = hf.get("weight_block_size")
    if block != [128, 128]:
        _refuse("weight_block_size", block)
    if hf.get("activation_scheme", "dynamic") != "dynamic":
        _refuse("activation_scheme", hf.get("activation_scheme"))
    if hf.get("fmt", "e4m3") != "e4m3":
        _refuse("fmt", hf.get("fmt"))
    ignore = tuple(hf.get("modules_to_not_convert") or ()) + tuple(hf.get("ignored_layers") or ())
    return QuantConfig(Fp8Scheme("block", "group", (128, 128)), ignore=ignore, scale_suffix="_scale_inv")


def _compressed_tensors(hf: dict) -> QuantConfig:
    if hf.get("format") not in ("float-quantized", "naive-quantized"):
        _refuse("format", hf.get("format"))
    groups = hf.get("config_groups") or {}
    if len(groups) != 1:
        _refuse("config_groups", sorted(groups))
    name, group = next(iter(groups.items()))
    where = f"config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        _refuse(f"{where}.targets", group.get("targets"))
    if group.get("output_activations") is not None:
        _refuse(f"{where}.output_activations", group.get("output_activations"))
    weights, acts = group.get("weights") or {}, group.get("input_activations") or {}
    for kind, spec in (("weights", weights), ("input_activations", acts)):
        for key, want in (("type", "float"), ("num_bits", 8), ("symmetric", True)):
            if spec.get(key) != want:
                _refuse(f"{where}.{kind}.{key}", spec.get(key))
    strategy = weights.get("strategy")
    if weights.get("dynamic"):
        _refuse(f"{where}.weights.dynamic", weights.get("dynamic"))
    block = None
    if strategy == "block":
        if weights.get("block_structure") != [128, 128]:
            _refuse(f"{where}.weights.block_structure", weights.get("block_structure"))
        block = (128, 128)
    elif strategy not in ("channel", "tensor"):
        _refuse(f"{where}.weights.strategy", strategy)
    act_strategy = acts.get("strategy")
    if acts.get("dynamic") is True and act_strategy == "token":
        activation = "token"
    elif acts.get("dynamic") is True and act_strategy == "group" and strategy == "block" \
            and acts.get("group_size") == 128:
        activation = "group"
    elif acts.get("dynamic") is False and act_strategy == "tensor":
        activation = "static"
    else:
        _refuse(f"{where}.input_activations", {k: acts.get(k) for k in ("dynamic", "strategy", "group_size")})
    if hf.get("kv_cache_scheme") is not None:
        _refuse("kv_cache_scheme", hf.get("kv_cache_scheme"))
    return QuantConfig(Fp8Scheme(strategy, activation, block), ignore=tuple(hf.get("ignore") or ()))


@dataclass(frozen=True)
class QuantScope:
    """A model's QuantConfig seen from one checkpoint module (None: the model runs 16-bit). Models hand each layer
    the scope of its checkpoint name, so ignore rules match the names the checkpoint uses."""

    config: QuantConfig | None = None
    prefix: str = ""

    def child(self, name: str) -> QuantScope:
        return QuantScope(self.config, f"{self.prefix}.{name}" if self.prefix else name)

    def scheme(self, *modules: str) -> Fp8Scheme | None:
        """The scheme of a layer made of these checkpoint modules under this scope (None: 16-bit)."""
        if self.config is None:
            return None
        return self.config.scheme_for(*(self.child(module).prefix for module in modules))
