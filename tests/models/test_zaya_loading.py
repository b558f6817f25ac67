"""Checkpoint loading for ZAYA1: legacy layout, sharded files, strict errors, dtype and hf_overrides."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve.checkpoint import CheckpointError
from hybridserve.runtime.build_model import build_model
from tests.helpers import CacheHarness
from tests.models.zaya_fixtures import (
    convert_to_legacy,
    random_hf_zaya,
    save_hf,
    tiny_config,
)

PROMPTS = [[5, 9, 1, 44, 3, 7, 100], [8, 2, 2, 61]]


@pytest.fixture(scope="module")
def native_dir(tmp_path_factory):
    return save_hf(random_hf_zaya(tiny_config("base"), seed=11), tmp_path_factory.mktemp("native"))


def _logits(directory, dtype=torch.float32, overrides=None):
    model, _ = build_model(directory, dtype, torch.device("cpu"), overrides)
    harness = CacheHarness(model, dtype)
    return harness.run([harness.chunk(i + 1, p, 0) for i, p in enumerate(PROMPTS)])


def test_legacy_layout_gives_identical_logits(native_dir, tmp_path):
    legacy = convert_to_legacy(native_dir, tmp_path / "legacy")
    assert not any(".mlp." in name for name in load_file(str(legacy / "model.safetensors")))
    assert torch.equal(_logits(legacy), _logits(native_dir))


def test_sharded_checkpoint_with_index_gives_identical_logits(native_dir, tmp_path):
    tensors = load_file(str(native_dir / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for shard, part in enumerate((names[::3], names[1::3], names[2::3])):
        filename = f"model-{shard + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp_path / filename))
        weight_map.update({n: filename for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text((native_dir / "config.json").read_text())
    assert torch.equal(_logits(tmp_path), _logits(native_dir))


def _rewrite(native_dir, tmp_path, edit) -> None:
    tensors = load_file(str(native_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((native_dir / "config.json").read_text())


def test_missing_tensor_is_named(native_dir, tmp_path):
    _rewrite(native_dir, tmp_path, lambda t: t.pop("model.layers.1.self_attn.qk_norm.temp"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.self_attn\.qk_norm\.temp"):
        build_model(tmp_path, torch.float32, torch.device("cpu"))


def test_unexpected_tensor_is_named(native_dir, tmp_path):
    _rewrite(native_dir, tmp_path, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mystery\.weight'"):
        build_model(tmp_path, torch.float32, torch.device("cpu"))


def test_wrong_shape_is_named(native_dir, tmp_path):
    name = "model.layers.2.self_attn.o_proj.weight"
    _rewrite(native_dir, tmp_path, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \(64, 63\), expected \(64, 64\)"):
        build_model(tmp_path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("option, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                              ("float16", torch.float16)])
def test_dtype_option(native_dir, option, expected):
    from hybridserve.runtime.build_model import resolve_dtype
    model, _ = build_model(native_dir, resolve_dtype(option, None), torch.device("cpu"))
    assert model.model.embed_tokens.weight.dtype == expected
    assert model.model.layers[0].mlp.gate.balancing_biases.dtype == torch.float32  # selection bias stays fp32


def test_auto_dtype_follows_the_checkpoint():
    from hybridserve.runtime.build_model import resolve_dtype
    assert resolve_dtype("auto", "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", None) == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float64", None)


def test_hf_overrides_reach_the_model_config(native_dir):
    _, config = build_model(native_dir, torch.float32, torch.device("cpu"), {"mod_skip_mode": "zero"})
    assert config.mod_skip_mode == "zero"
    with pytest.raises(ValueError, match="mod_skip_mode must be one of"):
        build_model(native_dir, torch.float32, torch.device("cpu"), {"mod_skip_mode": "identity"})
