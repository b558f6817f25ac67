"""Checkpoint loading: HF-layout directories (config.json + one or many *.safetensors) into a model.

The model maps every checkpoint name to a (parameter, shard) target; each parameter's own weight loader places the
tensor (renaming, stacking and tensor-parallel slicing live there). Loading is strict: a tensor nobody claims, a
parameter nobody fills and a shape that does not fit each raise an error that names the tensor.
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

from hybridserve.layers.weights import WeightShapeError


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


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _num_tensors(model_dir: str | Path) -> int:
    total = 0
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            total += len(f.keys())
    return total


def load_weights(model: nn.Module, model_dir: str | Path, progress: bool = False) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, strictly (`progress`: a tqdm bar)."""
    params = dict(model.named_parameters())
    filled: dict[str, set] = defaultdict(set)
    tensors = iter_checkpoint(model_dir)
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
        try:
            param.weight_loader(param, tensor, shard_id)
        except WeightShapeError as err:
            raise CheckpointError(f"tensor {name!r} {err} (parameter {param_name!r})") from None
        filled[param_name].add(shard_id)
    missing = [n for n, p in params.items() if not _complete(filled.get(n, set()), p)]
    if missing:
        raise CheckpointError(f"the checkpoint is missing tensors for {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _complete(shards: set, param: nn.Parameter) -> bool:
    """Filled whole (shard None) or piece by piece with every declared shard."""
    return None in shards or (param.shard_ids is not None and param.shard_ids <= shards)
