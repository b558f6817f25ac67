"""Deliberately naive reference implementation of inclusionAI Ling-2.6 (`bailing_hybrid`).

Written only from the Ling-2.6 implementation spec (the architecture as its public sources describe it), not
from hybridserve's code, so that it can serve as an independent test oracle for the inference engine. It shares
no code with the engine, favours explicit loops over speed, and computes in float32 by default (float64 also
works).

Contents:
- config / checkpoint helpers: `tiny_ling_config`, `expected_tensor_shapes`, `random_ling_checkpoint`,
  `write_checkpoint`, `load_checkpoint`;
- math building blocks: `alibi_slopes`, `layer_decay_factor`, `layer_log_decay`, `rms_norm`,
  `group_rms_norm`, `rope_neox_partial`, `rope_interleaved`, `lightning_recurrence`, `swiglu`,
  `route_tokens`;
- the model: `NaiveLing` with `forward`, `new_sequence`/`step`, `lightning_states`, `greedy_generate`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

Tensor = torch.Tensor

DECAY_VARIANTS = ("training", "hf_remote_code")
# Checkpoint names skipped on loading: they are recomputed buffers, not weights.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq", ".slope")


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def flash_config(**overrides) -> dict:
    """Ling-2.6-flash widths (hidden 4096, 32 heads x 128, MLA 1536/512/128/64/128, 256 experts top-8 in groups
    8/4 x 1024 + 1 shared) on two layers: layer 0 lightning + dense FFN, layer 1 MLA + MoE; vocab reduced."""
    return tiny_ling_config(**{
        "vocab_size": 16384, "hidden_size": 4096, "intermediate_size": 9216, "num_hidden_layers": 2,
        "layer_group_size": 2, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
        "group_norm_size": 4, "rope_theta": 6e6, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts": 256, "num_experts_per_tok": 8, "n_group": 8,
        "topk_group": 4, "moe_intermediate_size": 1024, "num_shared_experts": 1, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "num_nextn_predict_layers": 0} | overrides)


def tiny_ling_config(**overrides) -> dict:
    """A tiny but structurally complete Ling-2.6 config.json; every key can be overridden.

    4 layers with layer_group_size 2 give lightning layers 0, 2 and MLA layers 1, 3; layer 0 is the
    dense FFN layer, layers 1..3 are MoE; layer 4 is the MTP layer.
    """
    config = {
        "model_type": "bailing_hybrid",
        "architectures": ["BailingMoeV2_5ForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "layer_group_size": 2,
        "group_norm_size": 2,
        "linear_silu": False,
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_bias": False,
        "rms_norm_eps": 1e-6,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "rope_interleave": True,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "moe_intermediate_size": 32,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "score_function": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_router_enable_expert_bias": True,
        "router_dtype": "fp32",
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "lightning_decay_variant": "training",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    config.update(overrides)
    return config


def is_mla_layer(config: dict, layer_idx: int) -> bool:
    """Layer i is full attention (MLA) iff (i+1) % layer_group_size == 0, else lightning."""
    return (layer_idx + 1) % config["layer_group_size"] == 0


def is_dense_ffn_layer(config: dict, layer_idx: int) -> bool:
    """The first `first_k_dense_replace` layers use a dense SwiGLU FFN, the rest MoE."""
    return layer_idx < config["first_k_dense_replace"]


def shared_expert_width(config: dict) -> int:
    """moe_shared_expert_intermediate_size when present, else width x num_shared_experts (the sources differ on
    which comes first; the explicit key wins here)."""
    width = config.get("moe_shared_expert_intermediate_size")
    if width is not None:
        return width
    return config["moe_intermediate_size"] * config["num_shared_experts"]


def validate_config(config: dict) -> None:
    """Raise on settings this reference does not implement, instead of silently computing garbage."""
    unsupported = []
    if config.get("model_type", "bailing_hybrid") != "bailing_hybrid":
        unsupported.append(f"model_type={config['model_type']!r}")
    if config.get("rope_scaling") is not None:
        unsupported.append("rope_scaling (YaRN) is not implemented")
    if config.get("linear_silu", False):
        unsupported.append("linear_silu=true (sources disagree on its meaning: SiLU on the fused qkv, or a "
                           "SiLU output gate)")
    if config.get("use_bias", False):
        unsupported.append("use_bias=true (which MLA projections get a bias is not specified)")
    score_function = config.get("score_function", config.get("scoring_func", "sigmoid"))
    if score_function != "sigmoid":
        unsupported.append(f"score_function={score_function!r}")
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        unsupported.append(f"topk_method={config['topk_method']!r}")
    if config.get("lightning_decay_variant", "training") not in DECAY_VARIANTS:
        unsupported.append(f"lightning_decay_variant={config['lightning_decay_variant']!r}")
    if config["num_hidden_layers"] % config["layer_group_size"] != 0:
        unsupported.append("num_hidden_layers not a multiple of layer_group_size (sources disagree on the "
                           "trailing layers of an incomplete group)")
    if config["num_experts"] % config["n_group"] != 0:
        unsupported.append("num_experts not a multiple of n_group")
    if config["num_attention_heads"] * config["head_dim"] % config["group_norm_size"] != 0:
        unsupported.append("H*head_dim not a multiple of group_norm_size")
    if unsupported:
        raise NotImplementedError("; ".join(unsupported))


# --------------------------------------------------------------------------------------------
# Checkpoint names (HF) and shapes
# --------------------------------------------------------------------------------------------


def _lightning_attention_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, inner = config["hidden_size"], config["num_attention_heads"] * config["head_dim"]
    shapes = {"attention.query_key_value.weight": (3 * inner, hidden)}
    if config.get("use_qkv_bias", False):
        shapes["attention.query_key_value.bias"] = (3 * inner,)
    if config.get("use_qk_norm", True):
        shapes["attention.query_layernorm.weight"] = (config["head_dim"],)
        shapes["attention.key_layernorm.weight"] = (config["head_dim"],)
    shapes["attention.g_proj.weight"] = (inner, hidden)
    shapes["attention.g_norm.weight"] = (inner,)
    shapes["attention.dense.weight"] = (hidden, inner)
    return shapes


def _mla_attention_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    kv_lora, v_dim = config["kv_lora_rank"], config["v_head_dim"]
    q_lora = config.get("q_lora_rank")
    shapes: dict[str, tuple[int, ...]] = {}
    if q_lora is None:
        shapes["attention.q_proj.weight"] = (heads * (nope + rope), hidden)
    else:
        shapes["attention.q_a_proj.weight"] = (q_lora, hidden)
        shapes["attention.q_a_layernorm.weight"] = (q_lora,)
        shapes["attention.q_b_proj.weight"] = (heads * (nope + rope), q_lora)
    shapes["attention.kv_a_proj_with_mqa.weight"] = (kv_lora + rope, hidden)
    shapes["attention.kv_a_layernorm.weight"] = (kv_lora,)
    shapes["attention.kv_b_proj.weight"] = (heads * (nope + v_dim), kv_lora)
    shapes["attention.dense.weight"] = (hidden, heads * v_dim)
    return shapes


def _swiglu_shapes(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (width, hidden),
        f"{prefix}.up_proj.weight": (width, hidden),
        f"{prefix}.down_proj.weight": (hidden, width),
    }


def _moe_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, experts = config["hidden_size"], config["num_experts"]
    shapes: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (experts, hidden)}
    if config.get("moe_router_enable_expert_bias", True):
        shapes["mlp.gate.expert_bias"] = (experts,)
    for e in range(experts):
        shapes.update(_swiglu_shapes(f"mlp.experts.{e}", hidden, config["moe_intermediate_size"]))
    if config.get("num_shared_experts", 0):
        shapes.update(_swiglu_shapes("mlp.shared_experts", hidden, shared_expert_width(config)))
    return shapes


def _decoder_layer_shapes(config: dict, layer_idx: int, mla: bool, dense_ffn: bool) -> dict[str, tuple[int, ...]]:
    hidden = config["hidden_size"]
    local = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    local.update(_mla_attention_shapes(config) if mla else _lightning_attention_shapes(config))
    if dense_ffn:
        local.update(_swiglu_shapes("mlp", hidden, config["intermediate_size"]))
    else:
        local.update(_moe_shapes(config))
    return {f"model.layers.{layer_idx}.{name}": shape for name, shape in local.items()}


def _mtp_layer_shapes(config: dict, layer_idx: int) -> dict[str, tuple[int, ...]]:
    """The MTP block is always MLA + MoE, plus its own input/output norms and eh_proj."""
    hidden = config["hidden_size"]
    prefix = f"model.layers.{layer_idx}"
    shapes = {
        f"{prefix}.enorm.weight": (hidden,),
        f"{prefix}.hnorm.weight": (hidden,),
        f"{prefix}.eh_proj.weight": (hidden, 2 * hidden),
        f"{prefix}.final_layernorm.weight": (hidden,),
    }
    shapes.update(_decoder_layer_shapes(config, layer_idx, mla=True, dense_ffn=False))
    return shapes


def expected_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name (HF checkpoint naming) the config implies, with its shape."""
    vocab, hidden, layers = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]
    shapes: dict[str, tuple[int, ...]] = {"model.word_embeddings.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update(_decoder_layer_shapes(config, i, is_mla_layer(config, i), is_dense_ffn_layer(config, i)))
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    for k in range(config.get("num_nextn_predict_layers", 0)):
        shapes.update(_mtp_layer_shapes(config, layers + k))
    return shapes


def mtp_prefixes(config: dict) -> list[str]:
    """Name prefixes of the MTP layers (indices num_hidden_layers, num_hidden_layers+1, ...)."""
    layers = config["num_hidden_layers"]
    return [f"model.layers.{layers + k}." for k in range(config.get("num_nextn_predict_layers", 0))]


# --------------------------------------------------------------------------------------------
# Random checkpoints and safetensors I/O
# --------------------------------------------------------------------------------------------


def _random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Init scaled so activations stay O(1): 1/sqrt(fan_in) matrices, norms near 1, biases small."""
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("expert_bias") or name.endswith(".bias"):
        return 0.1 * noise  # large enough that expert_bias changes which experts win
    if len(shape) == 1:
        return 1.0 + 0.1 * noise  # RMSNorm weights
    if name == "model.word_embeddings.weight":
        return noise
    return noise / math.sqrt(shape[1])


def random_ling_checkpoint(config: dict, seed: int) -> dict[str, Tensor]:
    """Random float32 tensors under exactly the HF checkpoint names for `config`."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: _random_tensor(name, shape, generator) for name, shape in expected_tensor_shapes(config).items()
    }


def _shard_file_name(index: int, total: int) -> str:
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def write_checkpoint(directory: str | Path, config: dict, tensors: dict[str, Tensor], shards: int = 1) -> None:
    """Write an HF-style checkpoint: config.json plus one file or `shards` files with an index."""
    if not 1 <= shards <= max(1, len(tensors)):
        raise ValueError(f"shards must be in [1, {len(tensors)}], got {shards}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    owned = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
    if shards == 1:
        save_file(owned, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(owned)
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for s in range(shards):
        file_name = _shard_file_name(s, shards)
        chunk = {name: owned[name] for name in names[s * per_shard : (s + 1) * per_shard]}
        save_file(chunk, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in chunk})
    total_size = sum(t.numel() * t.element_size() for t in owned.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def load_checkpoint(directory: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """Read config.json and all tensors (single file, or the files named by the index)."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    index_path = directory / "model.safetensors.index.json"
    if not index_path.exists():
        return config, load_file(str(directory / "model.safetensors"))
    weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    tensors: dict[str, Tensor] = {}
    for file_name in sorted(set(weight_map.values())):
        tensors.update(load_file(str(directory / file_name)))
    missing = set(weight_map) - set(tensors)
    if missing:
        raise KeyError(f"index names tensors absent from the shard files: {sorted(missing)[:5]}")
    return config, tensors


# --------------------------------------------------------------------------------------------
# Math building blocks
# --------------------------------------------------------------------------------------------


def _power_of_two_slopes(n: int) -> list[float]:
    return [2.0 ** (-(8.0 / n) * (i + 1)) for i in range(n)]


def alibi_slopes(n: int) -> list[float]:
    """Lightning-Attention-2 base slopes: 2^(-8(i+1)/n) for power-of-two n; otherwise the list for p = 2^floor(log2 n)
    followed by the first n-p even-indexed entries of the list for 2p."""
    if n <= 0:
        raise ValueError("need at least one head")
    p = 2 ** int(math.floor(math.log2(n)))
    if p == n:
        return _power_of_two_slopes(n)
    return _power_of_two_slopes(p) + _power_of_two_slopes(2 * p)[0::2][: n - p]


def layer_decay_factor(config: dict, layer_idx: int) -> float:
    """Lightning decay lambda_l for the 0-based global layer index (MLA layers counted).

    "training" (default): 1 - l/(L-1) + 1e-5.  "hf_remote_code": 1 - (l-1)/(L-1) + 1e-5 (the HF
    remote code's off-by-one).  L <= 1 gives 1 + 1e-5 for both; lightning_layerwise_decay=false gives 1.
    """
    variant = config.get("lightning_decay_variant", "training")
    if variant not in DECAY_VARIANTS:
        raise ValueError(f"unknown lightning_decay_variant {variant!r}")
    if not config.get("lightning_layerwise_decay", True):
        return 1.0
    num_layers = config["num_hidden_layers"]
    if num_layers <= 1:
        return 1.0 + 1e-5
    shifted = layer_idx if variant == "training" else layer_idx - 1
    return 1.0 - shifted / (num_layers - 1) + 1e-5


def layer_log_decay(config: dict, layer_idx: int) -> Tensor:
    """Per-head log-decay g_h = -s_h * lambda_l (negative), float64 [H]; per-token decay is exp(g_h)."""
    slopes = torch.tensor(alibi_slopes(config["num_attention_heads"]), dtype=torch.float64)
    return -slopes * layer_decay_factor(config, layer_idx)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def group_rms_norm(x: Tensor, weight: Tensor, num_groups: int, eps: float) -> Tensor:
    """The lightning output's GroupRMSNorm: RMS-normalise each of `num_groups` contiguous channel groups, then scale."""
    grouped = x.reshape(*x.shape[:-1], num_groups, x.shape[-1] // num_groups)
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.reshape(x.shape) * weight


def _rope_angles(positions: Tensor, rot_dim: int, base: float, dtype: torch.dtype) -> Tensor:
    """[T, rot_dim/2] angles pos * base^(-2i/rot_dim), computed in float64 then cast."""
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    return (positions.to(torch.float64)[:, None] * inv_freq[None, :]).to(dtype)


def rope_neox_partial(x: Tensor, positions: Tensor, rot_dim: int, base: float) -> Tensor:
    """The lightning layers' RoPE: rotate-half on the first `rot_dim` dims of each head; the rest pass through.

    x: [T, H, d]; pairs are (i, i + rot_dim/2).
    """
    angles = _rope_angles(positions, rot_dim, base, x.dtype)[:, None, :]  # [T, 1, rot/2]
    cos, sin = angles.cos(), angles.sin()
    half = rot_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rot_dim], x[..., rot_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def rope_interleaved(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """The MLA layers' RoPE: GPT-J style over the whole last dim; pairs (2i, 2i+1) rotate by pos * base^(-2i/dim).

    x: [T, H, dim].
    """
    angles = _rope_angles(positions, x.shape[-1], base, x.dtype)[:, None, :]  # [T, 1, dim/2]
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return rotated.flatten(-2)


def lightning_recurrence(
    q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The lightning recurrence applied token by token: S = a*S + k^T v; o = d^-1/2 * q S (current token included).

    q, k: [T, H, d_k]; v: [T, H, d_v]; log_decay: [H]; state: [H, d_k, d_v] (K-major).
    Returns (o [T, H, d_v], final state). The input state is not modified.
    """
    decay = torch.exp(log_decay.to(state.dtype))[:, None, None]
    scale = q.shape[-1] ** -0.5
    outputs = []
    for t in range(q.shape[0]):
        state = decay * state + k[t][:, :, None] * v[t][:, None, :]
        outputs.append(scale * torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outputs), state


def swiglu(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor) -> Tensor:
    """A SwiGLU FFN (experts, shared expert, dense layers): down(silu(gate x) * up x)."""
    return (torch.nn.functional.silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T


def route_tokens(x: Tensor, gate_weight: Tensor, expert_bias: Tensor | None, config: dict) -> tuple[Tensor, Tensor]:
    """The MoE router: sigmoid scores, biased group-limited top-k selection, unbiased renormalised weights.

    x: [T, D]. Returns (expert indices [T, k], weights [T, k]) with weights summing to
    routed_scaling_factor per token. Computed in at least float32 (router_dtype fp32).
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    scores = torch.sigmoid(x.to(dtype) @ gate_weight.to(dtype).T)  # [T, E]
    choice = scores if expert_bias is None else scores + expert_bias.to(dtype)
    tokens, experts = scores.shape
    n_group, topk_group = config["n_group"], config["topk_group"]
    grouped = choice.view(tokens, n_group, experts // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
    kept_groups = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros(tokens, n_group, dtype=torch.bool).scatter_(1, kept_groups, True)
    masked = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(tokens, experts)
    indices = masked.topk(config["num_experts_per_tok"], dim=-1).indices
    picked = scores.gather(1, indices)
    weights = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20) * config["routed_scaling_factor"]
    return indices, weights


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


@dataclass
class SequenceState:
    """Everything needed to continue one sequence: the reference's "cache".

    lightning: layer -> recurrent state [H, d, d] (K-major).
    mla_latent: layer -> normed c_kv history [t, kv_lora_rank].
    mla_k_rope: layer -> roped k_rope history [t, qk_rope_head_dim].
    """

    position: int = 0
    lightning: dict[int, Tensor] = field(default_factory=dict)
    mla_latent: dict[int, Tensor] = field(default_factory=dict)
    mla_k_rope: dict[int, Tensor] = field(default_factory=dict)


class NaiveLing:
    """Ling-2.6 causal LM evaluated naively, straight from the spec.

    Built from a config dict and a dict of checkpoint tensors (HF names). Missing, misshaped or
    unknown tensors raise. The MTP layer runs only through `mtp_step`.
    """

    def __init__(self, config: dict, tensors: dict[str, Tensor], dtype: torch.dtype = torch.float32):
        if dtype not in (torch.float32, torch.float64):
            raise ValueError("the reference computes in float32 or float64 only")
        validate_config(config)
        self.config = dict(config)
        self.dtype = dtype
        self.eps = config["rms_norm_eps"]
        self.num_layers = config["num_hidden_layers"]
        self.heads = config["num_attention_heads"]
        self.head_dim = config["head_dim"]
        self.weights = self._checked_weights(tensors)
        self.mtp_tensors = {
            name: w for name, w in self.weights.items() if any(name.startswith(p) for p in mtp_prefixes(config))
        }
        self.log_decay = {
            i: layer_log_decay(config, i) for i in range(self.num_layers) if not is_mla_layer(config, i)
        }

    def _checked_weights(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Cast to the compute dtype, raising on any missing, misshaped or unexpected tensor."""
        expected = expected_tensor_shapes(self.config)
        missing = [name for name in expected if name not in tensors]
        if missing:
            raise KeyError(f"{len(missing)} required tensors missing, e.g. {missing[:5]}")
        unexpected = [
            name for name in tensors if name not in expected and not name.endswith(IGNORED_TENSOR_SUFFIXES)
        ]
        if unexpected:
            raise KeyError(f"{len(unexpected)} unexpected tensors, e.g. {unexpected[:5]}")
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, expected {shape}")
        return {name: tensors[name].to(self.dtype) for name in expected}

    def _w(self, layer_idx: int, name: str) -> Tensor:
        return self.weights[f"model.layers.{layer_idx}.{name}"]

    # ---------------------------------------------------------------- public API

    def new_sequence(self) -> SequenceState:
        """Fresh sequence: zero lightning states, empty MLA histories, position 0."""
        config = self.config
        state = SequenceState()
        for i in range(self.num_layers):
            if is_mla_layer(config, i):
                state.mla_latent[i] = torch.zeros(0, config["kv_lora_rank"], dtype=self.dtype)
                state.mla_k_rope[i] = torch.zeros(0, config["qk_rope_head_dim"], dtype=self.dtype)
            else:
                state.lightning[i] = torch.zeros(self.heads, self.head_dim, self.head_dim, dtype=self.dtype)
        return state

    def step(self, seq: SequenceState, token_ids: list[int]) -> Tensor:
        """Append `token_ids` to the sequence (updating `seq` in place); return their logits [len, V]."""
        return self.step_hidden(seq, token_ids) @ self._lm_head().T

    def step_hidden(self, seq: SequenceState, token_ids: list[int]) -> Tensor:
        """`step`, returning the final normed hidden states [len, D] instead of the logits."""
        if len(token_ids) == 0:
            raise ValueError("step needs at least one token")
        positions = torch.arange(seq.position, seq.position + len(token_ids))
        hidden = self.weights["model.word_embeddings.weight"][torch.tensor(token_ids)]
        for i in range(self.num_layers):
            hidden = self._decoder_layer(i, hidden, positions, seq)
        seq.position += len(token_ids)
        return rms_norm(hidden, self.weights["model.norm.weight"], self.eps)

    def new_mtp_sequence(self) -> SequenceState:
        """The MTP layer's own (empty) MLA history: it has no recurrent state."""
        state, layer = SequenceState(), self.num_layers
        state.mla_latent[layer] = torch.zeros(0, self.config["kv_lora_rank"], dtype=self.dtype)
        state.mla_k_rope[layer] = torch.zeros(0, self.config["qk_rope_head_dim"], dtype=self.dtype)
        return state

    def mtp_step(self, seq: SequenceState, next_token_ids: list[int], hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The MTP layer at the next positions of `seq`: each position's next token and the final hidden state there ->
        (the block's output after final_layernorm [len, D], its logits [len, V]: the token after next)."""
        layer, w = self.num_layers, self.weights
        positions = torch.arange(seq.position, seq.position + len(next_token_ids))
        embeds = w["model.word_embeddings.weight"][torch.tensor(next_token_ids)]
        x = torch.cat([rms_norm(embeds, self._w(layer, "enorm.weight"), self.eps),
                       rms_norm(hidden, self._w(layer, "hnorm.weight"), self.eps)], dim=-1)
        x = x @ self._w(layer, "eh_proj.weight").T
        x = x + self._mla_attention(layer, rms_norm(x, self._w(layer, "input_layernorm.weight"), self.eps),
                                    positions, seq)
        x = x + self._moe(layer, rms_norm(x, self._w(layer, "post_attention_layernorm.weight"), self.eps))
        seq.position += len(next_token_ids)
        out = rms_norm(x, self._w(layer, "final_layernorm.weight"), self.eps)
        return out, out @ self._lm_head().T

    def forward(self, token_ids: list[int]) -> Tensor:
        """Logits [T, V] of a fresh sequence at positions 0..T-1."""
        return self.step(self.new_sequence(), token_ids)

    def lightning_states(self, seq: SequenceState) -> dict[int, Tensor]:
        """Recurrent state [H, d, d] (K-major) of every lightning layer."""
        return dict(seq.lightning)

    def greedy_generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Argmax decoding without eos stopping; returns only the `max_new_tokens` new tokens."""
        seq = self.new_sequence()
        logits = self.step(seq, prompt_ids)
        generated: list[int] = []
        while len(generated) < max_new_tokens:
            generated.append(int(torch.argmax(logits[-1])))
            if len(generated) < max_new_tokens:
                logits = self.step(seq, generated[-1:])
        return generated

    # ---------------------------------------------------------------- decoder glue

    def _lm_head(self) -> Tensor:
        if self.config.get("tie_word_embeddings", False):
            return self.weights["model.word_embeddings.weight"]
        return self.weights["lm_head.weight"]

    def _decoder_layer(self, i: int, x: Tensor, positions: Tensor, seq: SequenceState) -> Tensor:
        """Pre-norm residual block: x + Attn(norm(x)), then + FFN(norm(.))."""
        normed = rms_norm(x, self._w(i, "input_layernorm.weight"), self.eps)
        if is_mla_layer(self.config, i):
            x = x + self._mla_attention(i, normed, positions, seq)
        else:
            x = x + self._lightning_attention(i, normed, positions, seq)
        normed = rms_norm(x, self._w(i, "post_attention_layernorm.weight"), self.eps)
        if is_dense_ffn_layer(self.config, i):
            return x + swiglu(normed, *(self._w(i, f"mlp.{p}_proj.weight") for p in ("gate", "up", "down")))
        return x + self._moe(i, normed)

    # ---------------------------------------------------------------- lightning attention

    def lightning_qkv(self, i: int, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [T, H, d] of lightning layer i for normed input x [T, D]: fused projection split
        into [Q | K | V] row blocks (head-major), per-head QK RMSNorm, partial NeoX RoPE on q and k."""
        heads, d = self.heads, self.head_dim
        qkv = x @ self._w(i, "attention.query_key_value.weight").T
        if self.config.get("use_qkv_bias", False):
            qkv = qkv + self._w(i, "attention.query_key_value.bias")
        q, k, v = (block.reshape(-1, heads, d) for block in qkv.split(heads * d, dim=-1))
        if self.config.get("use_qk_norm", True):
            q = rms_norm(q, self._w(i, "attention.query_layernorm.weight"), self.eps)
            k = rms_norm(k, self._w(i, "attention.key_layernorm.weight"), self.eps)
        rot_dim = int(d * self.config["partial_rotary_factor"])
        base = self.config["rope_theta"]
        return rope_neox_partial(q, positions, rot_dim, base), rope_neox_partial(k, positions, rot_dim, base), v

    def _lightning_attention(self, i: int, x: Tensor, positions: Tensor, seq: SequenceState) -> Tensor:
        q, k, v = self.lightning_qkv(i, x, positions)
        o, seq.lightning[i] = lightning_recurrence(q, k, v, self.log_decay[i], seq.lightning[i])
        o = group_rms_norm(
            o.reshape(o.shape[0], -1), self._w(i, "attention.g_norm.weight"), self.config["group_norm_size"], self.eps
        )
        o = o * torch.sigmoid(x @ self._w(i, "attention.g_proj.weight").T)  # norm first, gate second
        return o @ self._w(i, "attention.dense.weight").T

    # ---------------------------------------------------------------- MLA, unabsorbed

    def _mla_query(self, i: int, x: Tensor) -> Tensor:
        """[T, H, nope + rope] query, via the q-LoRA path or a plain q_proj."""
        if self.config.get("q_lora_rank") is None:
            q = x @ self._w(i, "attention.q_proj.weight").T
        else:
            latent = x @ self._w(i, "attention.q_a_proj.weight").T
            latent = rms_norm(latent, self._w(i, "attention.q_a_layernorm.weight"), self.eps)
            q = latent @ self._w(i, "attention.q_b_proj.weight").T
        return q.reshape(x.shape[0], self.heads, -1)

    def _mla_attention(self, i: int, x: Tensor, positions: Tensor, seq: SequenceState) -> Tensor:
        """Append this chunk's (normed c_kv, roped k_rope) to the history, then let each new token
        attend with a softmax over every history entry up to and including its own position."""
        config = self.config
        nope, rope, kv_lora = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["kv_lora_rank"]
        base = config["rope_theta"]

        q = self._mla_query(i, x)
        q_nope, q_rope = q[..., :nope], rope_interleaved(q[..., nope:], positions, base)

        kv_a = x @ self._w(i, "attention.kv_a_proj_with_mqa.weight").T
        latent = rms_norm(kv_a[:, :kv_lora], self._w(i, "attention.kv_a_layernorm.weight"), self.eps)
        k_rope = rope_interleaved(kv_a[:, None, kv_lora:], positions, base)[:, 0]
        seq.mla_latent[i] = torch.cat([seq.mla_latent[i], latent])
        seq.mla_k_rope[i] = torch.cat([seq.mla_k_rope[i], k_rope])

        kv = seq.mla_latent[i] @ self._w(i, "attention.kv_b_proj.weight").T
        kv = kv.reshape(-1, self.heads, nope + config["v_head_dim"])
        k_nope, v = kv[..., :nope], kv[..., nope:]  # [S, H, nope], [S, H, v]
        history_k_rope = seq.mla_k_rope[i]  # [S, rope], one head shared by all heads
        scale = (nope + rope) ** -0.5

        outputs = []
        for t, pos in enumerate(positions.tolist()):
            visible = pos + 1
            scores = torch.einsum("hn,shn->hs", q_nope[t], k_nope[:visible])
            scores = scores + torch.einsum("hr,sr->hs", q_rope[t], history_k_rope[:visible])
            probs = torch.softmax(scores * scale, dim=-1)
            outputs.append(torch.einsum("hs,shv->hv", probs, v[:visible]).reshape(-1))
        return torch.stack(outputs) @ self._w(i, "attention.dense.weight").T

    # ---------------------------------------------------------------- MoE

    def _moe(self, i: int, x: Tensor) -> Tensor:
        """Routed experts (Python loop) weighted by the router, plus the unscaled shared expert."""
        bias_name = f"model.layers.{i}.mlp.gate.expert_bias"
        indices, weights = route_tokens(x, self._w(i, "mlp.gate.weight"), self.weights.get(bias_name), self.config)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.config["num_experts"]):
            token_idx, slot = torch.nonzero(indices == e, as_tuple=True)
            if token_idx.numel() == 0:
                continue
            expert = (self._w(i, f"mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up", "down"))
            out[token_idx] += weights[token_idx, slot, None] * swiglu(x[token_idx], *expert)
        if self.config.get("num_shared_experts", 0):
            out = out + swiglu(x, *(self._w(i, f"mlp.shared_experts.{p}_proj.weight") for p in ("gate", "up", "down")))
        return out
