"""inclusionAI Ling-2.6 (`bailing_hybrid`) model configuration, parsed from config.json.

Only what Ling-2.6 uses is accepted; settings whose meaning the sources disagree on (`linear_silu`) or that are not
implemented yet (YaRN `rope_scaling`, biases on the output projections) are refused instead of silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.checkpoint import eos_token_list

DECAY_VARIANTS = ("training", "hf_remote_code")


@dataclass
class LingConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense FFN of the first `first_k_dense_replace` layers
    num_layers: int  # main decoder layers; the MTP layers come after them in the checkpoint
    num_heads: int  # lightning and MLA layers alike
    head_dim: int  # lightning head dim (q/k/v/state)
    layer_group_size: int
    group_norm_size: int  # number of groups of the lightning output GroupRMSNorm
    partial_rotary_factor: float
    rope_theta: float
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_width: int  # 0 = no shared expert
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    first_k_dense_replace: int
    rope_interleave: bool = True
    use_qk_norm: bool = True
    router_expert_bias: bool = True
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
    lightning_decay_variant: str = "training"
    lightning_layerwise_decay: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_ids: list[int] = field(default_factory=list)

    def is_mla(self, layer: int) -> bool:
        """Layer i is full attention (MLA) iff (i + 1) % layer_group_size == 0, else lightning."""
        return (layer + 1) % self.layer_group_size == 0

    def is_dense(self, layer: int) -> bool:
        return layer < self.first_k_dense_replace

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_mla(i)]

    @property
    def lightning_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_mla(i)]

    def validate(self) -> None:
        if self.lightning_decay_variant not in DECAY_VARIANTS:
            raise ValueError(f"lightning_decay_variant must be one of {DECAY_VARIANTS}, "
                             f"got {self.lightning_decay_variant!r}")
        if self.num_layers % self.layer_group_size:
            # The sources disagree here: the HF remote code (and MLX) make the trailing layers of an incomplete
            # group MLA, SGLang asserts a whole number of groups. We refuse, as SGLang does (every released
            # Ling-2.6 has whole groups, so both rules agree on them).
            raise ValueError(f"num_hidden_layers ({self.num_layers}) must be a multiple of layer_group_size "
                             f"({self.layer_group_size})")
        if (self.num_heads * self.head_dim) % self.group_norm_size:
            raise ValueError("num_attention_heads * head_dim must split into group_norm_size groups")
        if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            raise ValueError("num_experts must split into n_group groups of at least 2 experts (group score = top-2)")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError("num_experts_per_tok exceeds the experts left in the topk_group kept groups")
        if int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError("head_dim * partial_rotary_factor must be even")



def _refuse_unsupported(cfg: dict) -> None:
    unsupported = []
    if cfg.get("rope_scaling"):
        unsupported.append("rope_scaling (YaRN)")
    if cfg.get("linear_silu", False):
        unsupported.append("linear_silu=true (its meaning differs between sources: SiLU on the fused QKV output in "
                           "SGLang and vLLM, a SiLU instead of a sigmoid output gate in the transformers port)")
    if cfg.get("use_bias", False):
        unsupported.append("use_bias=true")
    if cfg.get("use_qkv_bias", False):
        unsupported.append("use_qkv_bias=true (no Ling-2.6 checkpoint has one; the fused Q|K|V|G GEMM has no bias)")
    score = cfg.get("score_function", cfg.get("scoring_func", "sigmoid"))
    if score != "sigmoid":
        unsupported.append(f"score_function={score!r}")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        unsupported.append(f"topk_method={cfg['topk_method']!r}")
    if cfg.get("full_attention_type", "mla") != "mla":
        unsupported.append(f"full_attention_type={cfg['full_attention_type']!r}")
    if unsupported:
        raise NotImplementedError("Ling config settings not supported: " + "; ".join(unsupported))


def parse_ling_config(cfg: dict) -> LingConfig:
    _refuse_unsupported(cfg)
    moe_width = cfg.get("moe_intermediate_size", 512)
    shared_width = cfg.get("moe_shared_expert_intermediate_size")
    # The shared expert's width: the HF remote code uses width x count; vLLM, transformers, MLX and newer SGLang
    # prefer the explicit key when present (both give 1024 for Ling-2.6-flash). We prefer the explicit key.
    if shared_width is None:
        shared_width = moe_width * cfg.get("num_shared_experts", 1)
    parsed = LingConfig(
        vocab_size=cfg.get("vocab_size", 157184),
        hidden_size=cfg.get("hidden_size", 2048),
        intermediate_size=cfg.get("intermediate_size", 5120),
        num_layers=cfg.get("num_hidden_layers", 20),
        num_heads=cfg.get("num_attention_heads", 16),
        head_dim=cfg.get("head_dim", 128),
        layer_group_size=cfg.get("layer_group_size", 5),
        group_norm_size=cfg.get("group_norm_size", 4),
        partial_rotary_factor=cfg.get("partial_rotary_factor", 0.5),
        rope_theta=float(cfg.get("rope_theta", 600000.0)),
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg.get("kv_lora_rank", 512),
        qk_nope_head_dim=cfg.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim", 64),
        v_head_dim=cfg.get("v_head_dim", 128),
        num_experts=cfg.get("num_experts", 256),
        num_experts_per_tok=cfg.get("num_experts_per_tok", 8),
        moe_intermediate_size=moe_width,
        shared_expert_width=shared_width,
        n_group=cfg.get("n_group", 8) or 1,
        topk_group=cfg.get("topk_group", 4) or 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=cfg.get("first_k_dense_replace", 1),
        rope_interleave=cfg.get("rope_interleave", True),
        use_qk_norm=cfg.get("use_qk_norm", True),
        router_expert_bias=cfg.get("moe_router_enable_expert_bias", True),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        num_nextn_predict_layers=cfg.get("num_nextn_predict_layers", 0),
        lightning_decay_variant=cfg.get("lightning_decay_variant", "training"),
        lightning_layerwise_decay=cfg.get("lightning_layerwise_decay", True),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        eos_token_ids=eos_token_list(cfg.get("eos_token_id")),
    )
    parsed.validate()
    return parsed
