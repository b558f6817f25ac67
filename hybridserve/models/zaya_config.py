"""ZAYA1 model configuration, parsed from a native (HF >= 5.13) or a legacy (Megatron export) config.json."""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.checkpoint import eos_token_list

MOD_SKIP_MODES = ("scaled_identity", "zero")
_DEFAULT_ROPE = {
    "hybrid": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
    "hybrid_sliding": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
}


@dataclass(frozen=True)
class RopeParams:
    theta: float
    partial_rotary_factor: float


@dataclass
class ZayaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    router_hidden_size: int
    layer_types: list[str]
    rope: dict[str, RopeParams]
    sliding_window: int | None = None
    cca_time0: int = 2
    cca_time1: int = 2
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    lm_head_bias: bool = False
    tie_word_embeddings: bool = True
    mod_skip_mode: str = "scaled_identity"
    max_position_embeddings: int = 131072
    eos_token_ids: list[int] = field(default_factory=list)
    legacy_layout: bool = False

    @property
    def conv_history(self) -> int:
        """Raw q/k rows each token's two-stage convolution looks back at (2 for ZAYA1)."""
        return (self.cca_time0 - 1) + (self.cca_time1 - 1)

    def validate(self) -> None:
        if self.mod_skip_mode not in MOD_SKIP_MODES:
            raise ValueError(f"mod_skip_mode must be one of {MOD_SKIP_MODES}, got {self.mod_skip_mode!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if (self.num_kv_heads * self.head_dim) % 2:
            raise ValueError("num_key_value_heads * head_dim must be even (half of V comes from each value path)")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = set(self.layer_types) - {"hybrid", "hybrid_sliding"}
        if unknown:
            raise ValueError(f"unknown ZAYA layer types {sorted(unknown)}")
        if "hybrid_sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_window must be set when layer_types contains hybrid_sliding")
        for kind in set(self.layer_types):
            if kind not in self.rope:
                raise ValueError(f"rope_parameters has no entry for layer type {kind!r}")



def _rope_params(raw: dict | None) -> dict[str, RopeParams]:
    merged = {kind: dict(params) for kind, params in _DEFAULT_ROPE.items()}
    for kind, params in (raw or {}).items():
        if not isinstance(params, dict):
            continue  # a stray flat key such as the hub's top-level `rope_type`
        merged.setdefault(kind, {}).update(params)
    out = {}
    for kind, params in merged.items():
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"ZAYA rope_type {rope_type!r} for {kind} layers is not supported yet")
        out[kind] = RopeParams(float(params["rope_theta"]), float(params.get("partial_rotary_factor", 1.0)))
    return out


def _native(cfg: dict) -> ZayaConfig:
    num_layers = cfg.get("num_hidden_layers", 40)
    if cfg.get("num_experts_per_tok", 1) != 1:
        raise ValueError("ZAYA supports num_experts_per_tok=1 only")
    return ZayaConfig(
        vocab_size=cfg.get("vocab_size", 262272),
        hidden_size=cfg.get("hidden_size", 2048),
        num_layers=num_layers,
        num_heads=cfg.get("num_attention_heads", 8),
        num_kv_heads=cfg.get("num_key_value_heads", 2),
        head_dim=cfg.get("head_dim", 128),
        moe_intermediate_size=cfg.get("moe_intermediate_size", 2048),
        num_experts=cfg.get("num_experts", 16),
        router_hidden_size=cfg.get("router_hidden_size", 256),
        layer_types=list(cfg.get("layer_types") or ["hybrid"] * num_layers),
        rope=_rope_params(cfg.get("rope_parameters")),
        sliding_window=cfg.get("sliding_window"),
        cca_time0=cfg.get("cca_time0", 2),
        cca_time1=cfg.get("cca_time1", 2),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        attention_bias=cfg.get("attention_bias", False),
        lm_head_bias=cfg.get("lm_head_bias", False),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        mod_skip_mode=cfg.get("mod_skip_mode", "scaled_identity"),
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        eos_token_ids=eos_token_list(cfg.get("eos_token_id", 106)),
    )


def _first(value, default=None):
    """Legacy configs give some fields per sub-layer as lists; released models use one value for all."""
    if isinstance(value, list):
        nonzero = [v for v in value if v]
        return nonzero[0] if nonzero else default
    return default if value is None else value


def _legacy(cfg: dict) -> ZayaConfig:
    """Megatron-export schema: 2L alternating sub-layers (even = CCA, odd = MoE) and Megatron field names."""
    if cfg.get("clamp_temp", False):
        raise NotImplementedError("clamp_temp=true is not supported (released ZAYA1 models use false)")
    if _first(cfg.get("moe_router_topk"), 1) != 1:
        raise ValueError("ZAYA supports moe_router_topk=1 only")
    zaya_layers = cfg.get("zaya_layers")
    if zaya_layers:
        num_layers = sum(1 for entry in zaya_layers if entry == "a")
        num_experts = next(int(entry) for entry in zaya_layers if entry != "a")
    else:
        num_layers = cfg["num_hidden_layers"] // 2
        num_experts = cfg.get("num_experts", 16)
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("kv_channels") or hidden // cfg["num_attention_heads"]
    num_heads = _first(cfg.get("cca_num_q_heads"), None) or cfg["num_attention_heads"] // 2
    windows = cfg.get("swa_layers") or [0] * (2 * num_layers)
    attention_windows = [windows[2 * k] if 2 * k < len(windows) else 0 for k in range(num_layers)]
    sliding = sorted({w for w in attention_windows if w})
    if len(sliding) > 1:
        raise NotImplementedError(f"several sliding windows {sliding} in one model are not supported")
    theta = cfg.get("rope_theta", 5_000_000.0)
    prf = cfg.get("partial_rotary_factor", 0.5)
    rope = {
        "hybrid": {"rope_theta": theta, "partial_rotary_factor": prf},
        "hybrid_sliding": {"rope_theta": cfg.get("swa_rotary_base", 10_000.0), "partial_rotary_factor": prf},
    }
    return ZayaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_first(cfg.get("num_query_groups_list"), None) or cfg.get("num_query_groups")
        or cfg["num_key_value_heads"],
        head_dim=head_dim,
        moe_intermediate_size=_first(cfg.get("ffn_hidden_size_list"), None) // 2
        if cfg.get("ffn_hidden_size_list") else cfg["ffn_hidden_size"] // 2,
        num_experts=num_experts,
        router_hidden_size=_first(cfg.get("zaya_mlp_expansion"), 256),
        layer_types=["hybrid_sliding" if w else "hybrid" for w in attention_windows],
        rope=_rope_params(rope),
        # Megatron counts only previous tokens in its window; ours includes the query position.
        sliding_window=sliding[0] + 1 if sliding else None,
        cca_time0=cfg.get("cca_time0", 2),
        cca_time1=cfg.get("cca_time1", 2),
        rms_norm_eps=cfg.get("norm_epsilon", cfg.get("rms_norm_eps", 1e-5)),
        attention_bias=cfg.get("add_bias_linear", False),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        mod_skip_mode=cfg.get("mod_skip_mode", "scaled_identity"),
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        eos_token_ids=eos_token_list(cfg.get("eos_token_id")),
        legacy_layout=True,
    )


_LEGACY_MARKERS = ("zaya_layers", "kv_channels", "ffn_hidden_size", "ffn_hidden_size_list", "cca_num_q_heads")


def parse_zaya_config(cfg: dict) -> ZayaConfig:
    parsed = _legacy(cfg) if any(key in cfg for key in _LEGACY_MARKERS) else _native(cfg)
    parsed.validate()
    return parsed
