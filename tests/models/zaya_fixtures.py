"""Tiny random ZAYA1 checkpoints built with HF transformers (the oracle) and converted to the legacy layout."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import ZayaConfig
from transformers import ZayaForCausalLM as HFZaya

SHAPES = {
    # name: ZayaConfig overrides (all tiny; one has a sliding layer, one has G = 1, one G = 4 and no biases drawn)
    "base": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 moe_intermediate_size=32, num_experts=4, router_hidden_size=16,
                 layer_types=["hybrid", "hybrid_sliding", "hybrid"], sliding_window=6),
    "gqa1": dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                 moe_intermediate_size=24, num_experts=3, router_hidden_size=8,
                 layer_types=["hybrid_sliding", "hybrid"], sliding_window=4),
    "gqa4": dict(hidden_size=96, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=12,
                 moe_intermediate_size=40, num_experts=6, router_hidden_size=24,
                 rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": 1000.0,
                                             "partial_rotary_factor": 0.5}}),
}


def tiny_config(shape: str = "base", **overrides) -> ZayaConfig:
    return ZayaConfig(vocab_size=128, max_position_embeddings=1024, **{**SHAPES[shape], **overrides})


def random_hf_zaya(config: ZayaConfig, seed: int = 0, skip_bias: float | None = None) -> HFZaya:
    """HF model with every parameter perturbed away from its init (temp > 0: HF inits it to 0, which would make
    attention uniform). `skip_bias` sets the MOD skip class's balancing bias (to force skips)."""
    torch.manual_seed(seed)
    model = HFZaya(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("temp"):
                param.copy_(torch.rand(param.shape, generator=gen) * 1.5 + 0.5)
            elif name.endswith(("scale", "norm.weight", "bias")):
                param.add_(0.1 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("balancing_biases"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
                buf[-1] = -1.0 if skip_bias is None else skip_bias
    return model


def save_hf(model: HFZaya, directory: Path) -> Path:
    model.save_pretrained(str(directory))
    return Path(directory)


# --- legacy (Megatron export) layout: layer k's attention is sub-layer 2k, its MoE 2k + 1 -----------------
_ATTN = {"input_layernorm.weight": "input_norm.weight",
         "self_attn.qkv_proj.q_proj.weight": "self_attn.qkv.linear_q.weight",
         "self_attn.qkv_proj.k_proj.weight": "self_attn.qkv.linear_k.weight",
         "self_attn.qkv_proj.v_proj_current.weight": "self_attn.qkv.val_proj1.weight",
         "self_attn.qkv_proj.v_proj_delayed.weight": "self_attn.qkv.val_proj2.weight",
         "self_attn.qkv_proj.conv_qk_depthwise.weight": "self_attn.qkv.conv_qk.0.weight",
         "self_attn.qkv_proj.conv_qk_depthwise.bias": "self_attn.qkv.conv_qk.0.bias",
         "self_attn.qkv_proj.conv_qk_grouped.weight": "self_attn.qkv.conv_qk.1.weight",
         "self_attn.qkv_proj.conv_qk_grouped.bias": "self_attn.qkv.conv_qk.1.bias",
         "self_attn.qk_norm.temp": "self_attn.qkv.temp",
         "self_attn.o_proj.weight": "self_attn.o_proj.weight"}
_MOE = {"post_attention_layernorm.weight": "input_norm.weight",
        "mlp.gate.down_proj.weight": "zaya_block.router.down_proj.weight",
        "mlp.gate.down_proj.bias": "zaya_block.router.down_proj.bias",
        "mlp.gate.router_states_scale": "zaya_block.router.router_states_scale",
        "mlp.gate.balancing_biases": "zaya_block.router.balancing_biases",
        "mlp.gate.router_mlp.norm.weight": "zaya_block.router.rmsnorm_eda.weight",
        "mlp.gate.router_mlp.fc1.weight": "zaya_block.router.router_mlp.0.weight",
        "mlp.gate.router_mlp.fc1.bias": "zaya_block.router.router_mlp.0.bias",
        "mlp.gate.router_mlp.fc2.weight": "zaya_block.router.router_mlp.2.weight",
        "mlp.gate.router_mlp.fc2.bias": "zaya_block.router.router_mlp.2.bias",
        "mlp.gate.router_mlp.out_proj.weight": "zaya_block.router.router_mlp.4.weight"}


def convert_to_legacy(native_dir: Path, legacy_dir: Path) -> Path:
    """Rewrite a native checkpoint with legacy names (2L sub-layers, per-expert fc1/fc2) and a legacy config."""
    cfg = json.loads((Path(native_dir) / "config.json").read_text())
    tensors = load_file(str(Path(native_dir) / "model.safetensors"))
    layers = cfg["num_hidden_layers"]
    out = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"],
           "model.final_norm.weight": tensors["model.norm.weight"]}
    for field in ("hidden_states_scale", "hidden_states_bias"):
        out[f"model.layers.0.res_scale.{field}"] = tensors[f"model.input_{field}"]
    for k in range(layers):
        native = f"model.layers.{k}."
        for src, dst in _ATTN.items():
            out[f"model.layers.{2 * k}.{dst}"] = tensors[native + src]
        for src, dst in _MOE.items():
            if native + src in tensors:
                out[f"model.layers.{2 * k + 1}.{dst}"] = tensors[native + src]
        for field in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias"):
            post_attention = tensors[f"{native}post_attention_residual_scale.{field}"]
            out[f"model.layers.{2 * k + 1}.res_scale.{field}"] = post_attention
            post_mlp = tensors[f"{native}post_mlp_residual_scale.{field}"]
            after = f"model.layers.{2 * k + 2}.res_scale.{field}" if k + 1 < layers else f"model.res_scale.{field}"
            out[after] = post_mlp
        for e, (fc1, fc2) in enumerate(zip(tensors[native + "mlp.experts.gate_up_proj"],
                                           tensors[native + "mlp.experts.down_proj"])):
            out[f"model.layers.{2 * k + 1}.zaya_block.experts.local_experts.{e}.linear_fc1.weight"] = fc1.clone()
            out[f"model.layers.{2 * k + 1}.zaya_block.experts.local_experts.{e}.linear_fc2.weight"] = fc2.clone()
    windows = [0] * (2 * layers)
    for k, kind in enumerate(cfg["layer_types"]):
        if kind == "hybrid_sliding":
            windows[2 * k] = cfg["sliding_window"] - 1
    rope = cfg.get("rope_parameters") or {}
    legacy_cfg = {
        "model_type": "zaya", "architectures": ["ZayaForCausalLM"], "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"], "num_hidden_layers": 2 * layers,
        "num_attention_heads": 2 * cfg["num_attention_heads"],
        "cca_num_q_heads": [cfg["num_attention_heads"] if n % 2 == 0 else 0 for n in range(2 * layers)],
        "num_query_groups": cfg["num_key_value_heads"], "num_key_value_heads": cfg["num_key_value_heads"],
        "kv_channels": cfg["head_dim"], "ffn_hidden_size": 2 * cfg["moe_intermediate_size"],
        "zaya_layers": [x for _ in range(layers) for x in ("a", cfg["num_experts"])],
        "zaya_mlp_expansion": cfg["router_hidden_size"], "moe_router_topk": 1, "norm_epsilon": cfg["rms_norm_eps"],
        "rope_theta": rope.get("hybrid", {}).get("rope_theta", 5_000_000.0),
        "partial_rotary_factor": rope.get("hybrid", {}).get("partial_rotary_factor", 0.5),
        "swa_layers": windows, "swa_rotary_base": rope.get("hybrid_sliding", {}).get("rope_theta", 10_000.0),
        "zaya_use_mod": True, "zaya_use_eda": True, "clamp_temp": False, "tie_word_embeddings": True,
        "max_position_embeddings": cfg["max_position_embeddings"], "eos_token_id": cfg["eos_token_id"],
        "cca_time0": cfg["cca_time0"], "cca_time1": cfg["cca_time1"],
    }
    legacy_dir = Path(legacy_dir)
    legacy_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(legacy_dir / "model.safetensors"))
    (legacy_dir / "config.json").write_text(json.dumps(legacy_cfg))
    return legacy_dir
