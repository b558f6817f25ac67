"""inclusionAI Ling-2.6 (`bailing_hybrid`): lightning (linear) attention layers with an MLA layer closing every group
of `layer_group_size`, a grouped sigmoid-routed MoE with a shared expert, and one MTP draft layer.

Per-request state: each lightning layer keeps an fp32 state [H_local, d, d] (K-major) in the state pool field
"lightning". Only MLA layers own KV pages: one latent row [1, kv_lora_rank + qk_rope_head_dim] per token in the
field "latent" (see layers/mla.py). The MTP layer (`model.layers.{num_hidden_layers}` in checkpoints) is loaded
into `model.mtp` and drafts for speculative decoding (`draft_hidden`, driven by spec/mtp.py); the main forward
does not run it. Its MLA layer gets its own KV layer in the same paged pool (a KV layer after the main MLA layers,
sharing the sequence's pages).
"""
from __future__ import annotations

import re
from collections.abc import Hashable

import torch
from torch import nn

from hybridserve.cache.kv_pool import KVCacheSpec
from hybridserve.cache.state_pool import StateField, StateSpec
from hybridserve.core.batch import ForwardBatch
from hybridserve.core.parallel import all_reduce, divide, tp_rank, tp_size
from hybridserve.core.quant import QuantConfig, QuantScope
from hybridserve.core.streams import run_beside
from hybridserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from hybridserve.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from hybridserve.layers.mla import MultiLatentAttention
from hybridserve.layers.moe import StackedExperts
from hybridserve.layers.norm import GroupRMSNorm, RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.layers.weights import new_parameter
from hybridserve.models.ling_config import LingConfig
from hybridserve.ops.activation import silu_and_mul
from hybridserve.ops.lightning import QKNormRope, lightning_attention
from hybridserve.ops.linear import linear
from hybridserve.ops.ling_norm import qk_norm_rope
from hybridserve.ops.router import grouped_topk


def alibi_slopes(num_heads: int) -> list[float]:
    """Lightning-Attention-2 base slopes: 2^(-8(i+1)/n) when n is a power of two; otherwise the list
    for p = 2^floor(log2 n) followed by the first n - p even-indexed entries of the list for 2p."""
    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    p = 1 << (num_heads.bit_length() - 1)
    if p == num_heads:
        return power_of_two(p)
    return power_of_two(p) + power_of_two(2 * p)[0::2][: num_heads - p]


def layer_decay_factor(config: LingConfig, layer: int) -> float:
    """lambda_l for the 0-based global layer index (MLA layers counted).

    "training" (default) is Megatron's 1 - l/(L-1) + 1e-5, which SGLang, vLLM and MLX compute too;
    "hf_remote_code" reproduces the HF remote code, which plugs the 0-based index into the 1-based formula and so
    uses the previous layer's factor.
    """
    if not config.lightning_layerwise_decay:
        return 1.0
    if config.num_layers <= 1:
        return 1.0 + 1e-5
    shifted = layer if config.lightning_decay_variant == "training" else layer - 1
    return 1.0 - shifted / (config.num_layers - 1) + 1e-5


def lightning_log_decay(config: LingConfig, layer: int) -> torch.Tensor:
    """Per-head log-decay g_h = -s_h * lambda_l [H] (fp32, all heads), computed in float64."""
    slopes = torch.tensor(alibi_slopes(config.num_heads), dtype=torch.float64)
    return (-slopes * layer_decay_factor(config, layer)).float()


class LightningAttention(nn.Module):
    """One Q|K|V|G GEMM, per-head QK RMSNorm + partial NeoX RoPE (one op; in decode, inside the recurrence's
    kernel), the decayed linear recurrence, GroupRMSNorm fused with the sigmoid output gate (norm first, gate
    second), then `dense`."""

    def __init__(self, config: LingConfig, layer_idx: int, quant: QuantScope):
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        width = config.num_heads * d
        self.num_heads = divide(config.num_heads, tp_size(), "num_attention_heads")
        self.head_dim = d
        # Row blocks [Q | K | V | G] (head-major each), each split per rank so a rank holds its heads of all four.
        # Checkpoints keep Q|K|V in `query_key_value` and G in `g_proj` (LingForCausalLM.checkpoint_target).
        self.query_key_value = MergedColumnParallelLinear(hidden, [width] * 4, pieces=[(0, 1, 2), (3,)],
                                                          quant=quant.scheme("query_key_value", "g_proj"))
        self.eps = config.rms_norm_eps
        self.use_qk_norm = config.use_qk_norm
        if config.use_qk_norm:
            self.query_layernorm = RMSNorm(d, config.rms_norm_eps)
            self.key_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(int(d * config.partial_rotary_factor), config.rope_theta)
        self.g_norm = GroupRMSNorm(width, config.group_norm_size, config.rms_norm_eps)
        self.dense = RowParallelLinear(width, hidden, quant=quant.scheme("dense"))
        heads = slice(tp_rank() * self.num_heads, (tp_rank() + 1) * self.num_heads)
        self.register_buffer("log_decay", lightning_log_decay(config, layer_idx)[heads], persistent=False)
        self.state: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkvg = self.query_key_value(x).view(x.shape[0], 4, self.num_heads, self.head_dim)
        norms = (self.query_layernorm.weight, self.key_layernorm.weight) if self.use_qk_norm else (None, None)
        norm_rope = QKNormRope(*norms, batch.positions, self.rotary.inv_freq, self.eps)
        if batch.is_decode:  # the decode step applies it on load
            q, k = qkvg[:, 0], qkvg[:, 1]
        else:
            q, k = qk_norm_rope(qkvg[:, :2], *norm_rope).unbind(1)
            norm_rope = None
        o = lightning_attention(q, k, qkvg[:, 2], self.log_decay, self.state["lightning"], batch, norm_rope)  # fp32
        return self.dense(self.g_norm(o.flatten(1), gate=qkvg[:, 3].flatten(1)))  # in x's dtype


class LingMLP(nn.Module):
    """SwiGLU: the dense FFN of the first layers, and the shared expert."""

    def __init__(self, hidden_size: int, width: int, quant: QuantScope, reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [width, width],
                                                       quant=quant.scheme("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(width, hidden_size, reduce_results=reduce_results,
                                           quant=quant.scheme("down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LingRouter(nn.Module):
    """Sigmoid scores in fp32; `expert_bias` (aux-loss-free balancing) steers the group-limited top-k selection
    only, the weights are the unbiased scores of the chosen experts, renormalised and scaled. The logits are an
    fp32 `ops.linear` (the GEMV kernel at decode sizes on CUDA, F.linear elsewhere); the selection is
    `ops.router.grouped_topk` (one kernel on CUDA). Replicated: every rank needs all scores for the group ranking."""

    def __init__(self, config: LingConfig):
        super().__init__()
        self.n_group, self.topk_group, self.top_k = config.n_group, config.topk_group, config.num_experts_per_tok
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = new_parameter(config.num_experts, config.hidden_size, dtype=torch.float32)
        self.expert_bias = new_parameter(config.num_experts, dtype=torch.float32) if config.router_expert_bias \
            else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H]: given in fp32 (the norm's fp32 copy, exact), the logits GEMM needs no cast of its own."""
        logits = linear(x.float(), self.weight)  # [T, E] fp32
        return grouped_topk(logits, self.expert_bias, self.n_group, self.topk_group, self.top_k,
                            self.routed_scaling_factor)


class LingMoE(nn.Module):
    # Up to this many tokens (CUDA only) the shared expert runs on a side stream beside the router and routed
    # experts: at decode sizes both are short, latency-bound GEMM chains; beyond, either alone fills the GPU.
    overlap_max_tokens = 1024

    def __init__(self, config: LingConfig, quant: QuantScope = QuantScope()):
        super().__init__()
        self.gate = LingRouter(config)
        experts = quant.child("experts")  # checkpoints keep one tensor per expert: expert 0's names stand for all
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                      split_gate_up=True,
                                      quant=experts.scheme("0.gate_proj", "0.up_proj", "0.down_proj"))
        self.shared_experts = LingMLP(config.hidden_size, config.shared_expert_width, quant.child("shared_experts"),
                                      reduce_results=False) if config.shared_expert_width else None

    def _routed(self, x: torch.Tensor, x32: torch.Tensor | None, reduce: bool) -> torch.Tensor:
        ids, weights = self.gate(x if x32 is None else x32)
        return self.experts(x, ids, weights, reduce)

    def parts(self, x: torch.Tensor, x32: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(routed experts' output, shared expert's output or None), reduced over tensor-parallel ranks.

        On one rank both are left for the caller to sum on its way into the next residual add (ops.ling_norm's
        add_rms_norm, same roundings): the routed output as rows [T, P, H] that sum to it (`ops.moe`), the shared
        expert's as the add's addend. Under tensor parallelism the partial sums are added and reduced together
        here. `x32`: x in fp32 for the router, when the norm before already made that copy."""
        split = tp_size() == 1
        if self.shared_experts is None:
            return all_reduce(self._routed(x, x32, reduce=not split)), None
        if x.shape[0] <= self.overlap_max_tokens:  # sequential on CPU
            shared, out = run_beside(lambda: self.shared_experts(x), lambda: self._routed(x, x32, not split),
                                     x.device)
        else:
            out, shared = self._routed(x, x32, not split), self.shared_experts(x)
        if split:
            return out, shared
        return all_reduce(out + shared), None  # shared expert unscaled, no gate; partial sums reduced together

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, shared = self.parts(x)
        out = out.sum(1) if out.dim() == 3 else out
        return out if shared is None else out + shared


def _mla(config: LingConfig, quant: QuantScope) -> MultiLatentAttention:
    return MultiLatentAttention(config.hidden_size, config.num_heads, config.q_lora_rank, config.kv_lora_rank,
                                config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim,
                                config.rope_theta, config.rope_interleave, config.rms_norm_eps, quant)


class LingDecoderLayer(nn.Module):
    """Pre-norm block: x + Attn(norm(x)), then + FFN(norm(.)); attention and FFN kinds chosen per layer.

    The residual stream is carried next to the block output, so each residual add is fused into the norm after it:
    the layer takes (the previous block's output: [T, H], or [T, P, H] rows that sum to it; a second part of it or
    None: the shared expert's output beside the routed experts'; the residual stream before it: None for the first
    layer, whose input is the embedding) and returns the same triple. Sums and roundings are those of the unfused
    form.
    """

    def __init__(self, config: LingConfig, layer_idx: int, mla: bool, dense: bool, quant: QuantScope):
        """`quant`: the scope of the checkpoint's `model.layers.{layer_idx}`."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        attention, mlp = quant.child("attention"), quant.child("mlp")
        self.attention = _mla(config, attention) if mla else LightningAttention(config, layer_idx, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LingMLP(config.hidden_size, config.intermediate_size, mlp) if dense else LingMoE(config, mlp)

    def forward(self, x: torch.Tensor, addend: torch.Tensor | None, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual, _ = self.input_layernorm(x, residual, addend)
        moe = isinstance(self.mlp, LingMoE)  # the router reads the fp32 copy the norm writes
        x, residual, x32 = self.post_attention_layernorm(self.attention(x, batch), residual, fp32_copy=moe)
        if moe:
            return *self.mlp.parts(x, x32), residual
        return self.mlp(x), None, residual


class LingMTPLayer(LingDecoderLayer):
    """The next-token draft block: MLA + MoE plus the norms and projection that mix the next token's
    embedding with the target's final hidden state. Drafts for speculative decoding; the main forward skips it."""

    def __init__(self, config: LingConfig, layer_idx: int, quant: QuantScope):
        super().__init__(config, layer_idx, mla=True, dense=False, quant=quant)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * config.hidden_size, config.hidden_size, quant=quant.scheme("eh_proj"))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def draft(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """embeds [T, H]: the embedding of the token after each position; hidden [T, H]: the final (normed) hidden
        state there (the target's, or this layer's own output one position before when drafting a chain) ->
        the block's output after `final_layernorm` [T, H], whose logits predict the token after next."""
        z = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x, addend, residual = super().forward(z, None, None, batch)
        return self.final_layernorm(x, residual, addend)[0]


class LingModel(nn.Module):
    def __init__(self, config: LingConfig, quant: QuantScope):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LingDecoderLayer(config, i, config.is_mla(i), config.is_dense(i),
                                                     quant.child(f"layers.{i}")) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mtp = nn.ModuleList(LingMTPLayer(config, config.num_layers + k,
                                              quant.child(f"layers.{config.num_layers + k}"))
                                 for k in range(config.num_nextn_predict_layers))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x, addend, residual = self.word_embeddings(batch.input_ids), None, None
        for layer in self.layers:
            x, addend, residual = layer(x, addend, residual, batch)
        return self.norm(x, residual, addend)[0]


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".slope")  # recomputed buffers, not weights
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
_GATE_UP = re.compile(r"(.+\.mlp(?:\.shared_experts)?)\.(gate|up)_proj\.weight")
_HALF = {"gate": 0, "up": 1}
_QKVG = re.compile(r"(.+\.attention)\.(query_key_value|g_proj)\.weight")  # lightning: one Q|K|V|G parameter
_QKVG_PIECE = {"query_key_value": 0, "g_proj": 1}
_QKV_A = re.compile(r"(.+\.attention)\.(q_a_proj|kv_a_proj_with_mqa)\.weight")  # MLA: one q_a|kv_a parameter
_QKV_A_PIECE = {"q_a_proj": 0, "kv_a_proj_with_mqa": 1}


class LingForCausalLM(nn.Module):
    def __init__(self, config: LingConfig, quant: QuantConfig | None = None):
        """`quant`: FP8 for the projections, the dense FFN, the shared and routed experts and the MTP projection
        (core/quant.py); the embeddings, LM head, router and MLA's kv_b_proj (its weights fold into the absorbed
        attention) stay 16-bit."""
        super().__init__()
        self.config = config
        self.model = LingModel(config, QuantScope(quant).child("model"))
        tied = self.model.word_embeddings if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    # --- what the runner needs to know -------------------------------------------------------------------
    # A lightning state is H*d*d fp32 per layer (MiBs per request), so prefix caching checkpoints it sparsely:
    # the scheduler ends chunks at checkpoint positions and copies the working slot there (no per-page footers).
    state_checkpoints = "sparse"
    # Its MLA prefill walks the rows on the host (per-row prefix and query lengths), so prefill runs eagerly.
    prefill_graphs = False

    @property
    def history_len(self) -> int:
        return 0

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        width = self.config.kv_lora_rank + self.config.qk_rope_head_dim
        return KVCacheSpec(num_layers=len(self.config.mla_layers), fields={"latent": (1, width)}, dtype=dtype)

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        """fp32 whatever the model dtype: the recurrence accumulates over the whole sequence."""
        d = self.config.head_dim
        heads = divide(self.config.num_heads, tp_size(), "num_attention_heads")
        return StateSpec(num_layers=len(self.config.lightning_layers),
                         fields={"lightning": StateField((heads, d, d), torch.float32)})

    def bind_caches(self, kv_layers: list[dict[str, torch.Tensor]], state_layers: list[dict[str, torch.Tensor]],
                    page_state_layers: list[dict[str, torch.Tensor]] | None = None):
        """KV layer j is the j-th MLA layer, state layer j the j-th lightning layer; KV layers beyond the main MLA
        layers (given when the MTP layer drafts) belong to the MTP layers."""
        if page_state_layers is not None:
            raise ValueError("Ling checkpoints its state sparsely; it has no per-page state footers")
        if len(kv_layers) not in (len(self.config.mla_layers), len(self.config.mla_layers) + len(self.model.mtp)):
            raise ValueError(f"{len(kv_layers)} KV layers for {len(self.config.mla_layers)} MLA layers and "
                             f"{len(self.model.mtp)} MTP layers")
        kv, state = iter(kv_layers), iter(state_layers)
        for layer in self.model.layers:
            if isinstance(layer.attention, MultiLatentAttention):
                layer.attention.kv = next(kv)
            else:
                layer.attention.state = next(state)
        for layer in self.model.mtp:
            layer.attention.kv = next(kv, {})

    def draft_hidden(self, token_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The MTP layer's output at each position of `batch`, given the token after it and the final
        hidden state at it; its logits (`compute_logits`) are the draft distribution of the token after that."""
        return self.model.mtp[0].draft(self.model.word_embeddings(token_ids), hidden, batch)

    # --- forward -----------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out)

    def prepare_kernels(self) -> None:
        """Nothing to derive: Ling's kernels read its weights as loaded."""

    # --- checkpoint names --------------------------------------------------------------------------------
    def checkpoint_target(self, name: str) -> tuple[str, Hashable | None] | None:
        """Parameter (and shard) a checkpoint tensor fills; None for tensors that are deliberately not loaded."""
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        layer = _LAYER.fullmatch(name)
        if layer and int(layer.group(1)) >= self.config.num_layers:
            name = f"model.mtp.{int(layer.group(1)) - self.config.num_layers}.{layer.group(2)}"
        if name.endswith(".mlp.gate.e_score_correction_bias"):
            name = name.removesuffix("e_score_correction_bias") + "expert_bias"
        expert = _EXPERT.fullmatch(name)
        if expert and int(expert.group(2)) < self.config.num_experts:
            prefix, index, proj = expert.group(1), int(expert.group(2)), expert.group(3)
            if proj == "down":
                return f"{prefix}.down_proj", index
            return f"{prefix}.gate_up_proj", (index, _HALF[proj])
        gate_up = _GATE_UP.fullmatch(name)
        if gate_up:
            return f"{gate_up.group(1)}.gate_up_proj.weight", _HALF[gate_up.group(2)]
        qkvg = _QKVG.fullmatch(name)
        if qkvg:
            return f"{qkvg.group(1)}.query_key_value.weight", _QKVG_PIECE[qkvg.group(2)]
        qkv_a = _QKV_A.fullmatch(name)
        if qkv_a and self.config.q_lora_rank is not None:
            return f"{qkv_a.group(1)}.fused_qkv_a_proj.weight", _QKV_A_PIECE[qkv_a.group(2)]
        return name, None
