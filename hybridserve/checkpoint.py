"""Checkpoint loading: HF-layout directories (config.json + one or many *.safetensors) into a model.

The model maps every checkpoint name to a (parameter, shard) target; each parameter's own weight loader places the
tensor (renaming, stacking and tensor-parallel slicing live there). Loading is strict: a tensor nobody claims, a
parameter nobody fills and a shape that does not fit each raise an error that names the tensor.

FP8 checkpoints (core/quant.py): an e4m3 weight travels with its scales (`<weight>_scale` or `<weight>_scale_inv`,
and the static scheme's input scale) as one `QuantizedTensor`, whichever files they are in; a parameter the model
keeps 16-bit gets it dequantized. A scale without its FP8 weight, an FP8 weight without its scale or without a
quantization config, and an input scale the scheme does not use are errors that name the tensor.
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from hybridserve.core.quant import FP8_DTYPE, QuantConfig, QuantizedTensor
from hybridserve.layers.weights import Loaded, WeightShapeError, fp8_scales


class CheckpointError(ValueError):
    """The checkpoint does not match the model it is loaded into."""


def read_config(model_dir: str | Path, overrides: dict | None = None) -> dict:
    """config.json merged with per-run overrides (override values win, key by key at the top level)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json (expected a HF-layout model directory)")
    return {**json.loads(path.read_text()), **(overrides or {})}


def eos_token_list(value) -> list[int]:
    """config.json's eos_token_id may be an int, a list or null."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"files listed in {index.name} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir} (load_format='dummy' runs random weights "
                                "from config.json alone)")
    return files


class _Checkpoint:
    """Every tensor's file and dtype (from the headers: nothing is read), and the tensors themselves on demand."""

    def __init__(self, model_dir: str | Path):
        self.files: dict[str, Path] = {}
        self.fp8: set[str] = set()
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    self.files[name] = path
                    if f.get_slice(name).get_dtype() == "F8_E4M3":
                        self.fp8.add(name)
        self._open: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_tensor(name)


def iter_checkpoint(model_dir: str | Path, quant: QuantConfig | None = None) -> Iterator[tuple[str, Loaded]]:
    """(name, tensor) of every checkpoint tensor, file by file; an FP8 weight as one QuantizedTensor with its
    scales (which are not yielded on their own)."""
    checkpoint = _Checkpoint(model_dir)
    companions, orphans = set(), set()  # scales of FP8 weights; scales of weights that are not FP8
    if quant is not None:
        for name in checkpoint.files:
            scales = {quant.scale_name(name), quant.input_scale_name(name)} & checkpoint.files.keys()
            static = quant.scheme.activation == "static"
            if name in checkpoint.fp8:
                companions |= {quant.scale_name(name)} | ({quant.input_scale_name(name)} if static else set())
                orphans |= scales - companions
            else:
                orphans |= scales
    elif checkpoint.fp8:
        raise CheckpointError(f"tensor {min(checkpoint.fp8)!r} is float8_e4m3fn, but config.json has no "
                              "quantization_config")
    for name in checkpoint.files:
        if name in orphans:
            raise CheckpointError(f"unexpected tensor {name!r} in the checkpoint: a scale whose weight is not FP8, "
                                  "or an input scale the quantization scheme does not use")
        if name not in companions:
            yield name, _quantized(checkpoint, name, quant) if name in checkpoint.fp8 else checkpoint.get(name)


def _quantized(checkpoint: _Checkpoint, name: str, quant: QuantConfig) -> QuantizedTensor:
    scale_name = quant.scale_name(name)
    if scale_name not in checkpoint.files:
        raise CheckpointError(f"FP8 tensor {name!r} has no scales: {scale_name!r} is missing from the checkpoint")
    input_scale = None
    if quant.scheme.activation == "static":
        input_name = quant.input_scale_name(name)
        if input_name not in checkpoint.files:
            raise CheckpointError(f"FP8 tensor {name!r} has no static activation scale: {input_name!r} is missing")
        input_scale = checkpoint.get(input_name)
    try:
        return QuantizedTensor(checkpoint.get(name), checkpoint.get(scale_name), quant.scheme, input_scale)
    except ValueError as err:
        raise CheckpointError(f"tensor {scale_name!r} {err}") from None


def _num_tensors(model_dir: str | Path) -> int:
    total = 0
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            total += len(f.keys())
    return total


def load_weights(model: nn.Module, model_dir: str | Path, progress: bool = False,
                 quant: QuantConfig | None = None) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, strictly (`progress`: a tqdm bar).
    `quant`: the model's FP8 quantization (core/quant.py), None for a 16-bit checkpoint."""
    params = dict(model.named_parameters())
    filled: dict[str, set] = defaultdict(set)
    tensors = iter_checkpoint(model_dir, quant)
    if progress:
        tensors = tqdm(tensors, total=_num_tensors(model_dir), desc="loading weights", unit="tensor")
    for name, tensor in tensors:
        target = model.checkpoint_target(name)
        if target is None:
            continue
        param_name, shard_id = target
        param = params.get(param_name)
        if param is None:
            raise CheckpointError(f"unexpected tensor {name!r} in the checkpoint: the model has no {param_name!r}")
        if isinstance(tensor, QuantizedTensor) and fp8_scales(param) is None:
            tensor = tensor.dequantize(param.dtype)  # a layer the model runs 16-bit
        try:
            param.weight_loader(param, tensor, shard_id)
        except (WeightShapeError, ValueError) as err:
            raise CheckpointError(f"tensor {name!r} {err} (parameter {param_name!r})") from None
        filled[param_name].add(shard_id)
    missing = [n for n, p in params.items()
               if not getattr(p, "fp8_companion", False) and not _complete(filled.get(n, set()), p)]
    if missing:
        raise CheckpointError(f"the checkpoint is missing tensors for {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _complete(shards: set, param: nn.Parameter) -> bool:
    """Filled whole (shard None) or piece by piece with every declared shard."""
    return None in shards or (param.shard_ids is not None and param.shard_ids <= shards)
