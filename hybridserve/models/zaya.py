"""Zyphra ZAYA1: CCA attention (two-stage causal conv on q/k + one-token value lag) and a top-1 MoE with an EDA
router and a MOD skip class, on an fp32 residual stream with ResidualScaling. Spec: shared/spec/zaya1.md.

Per-request state of each layer (state pool fields): `conv` [C_local, P] = the raw q|k projections of the last
P = 2 tokens (oldest first), and `lag` [Hk*D/2] = v_proj_delayed of the last token (the projected form; a slot is
never read as the raw-h form). The KV cache holds K after norm, temperature and RoPE, and raw V.
"""
from __future__ import annotations

import math
import re
from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.cache.kv_pool import KVCacheSpec
from hybridserve.cache.state_pool import StateField, StateSpec
from hybridserve.core.batch import ForwardBatch
from hybridserve.core.parallel import all_reduce, divide, tp_rank, tp_size
from hybridserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from hybridserve.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from hybridserve.layers.moe import StackedExperts
from hybridserve.layers.norm import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.layers.weights import check_shape, new_parameter
from hybridserve.models.zaya_config import ZayaConfig
from hybridserve.ops.attention import paged_attention


def _head_rows(q_heads: int, k_heads: int, head_dim: int) -> torch.Tensor:
    """Channel indices of this rank's q heads followed by its k heads in the [q | k] conv layout."""
    q_local, k_local = q_heads // tp_size(), k_heads // tp_size()
    q_rows = torch.arange(tp_rank() * q_local * head_dim, (tp_rank() + 1) * q_local * head_dim, device="cpu")
    k_first = q_heads * head_dim + tp_rank() * k_local * head_dim
    k_rows = torch.arange(k_first, k_first + k_local * head_dim, device="cpu")
    return torch.cat([q_rows, k_rows])


class CCAProjection(nn.Module):
    """q/k through the causal two-stage conv plus head-mixed residuals; v from the current and previous token."""

    def __init__(self, config: ZayaConfig):
        super().__init__()
        hq, hk, d, h = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
        self.head_dim = d
        self.q_heads = divide(hq, tp_size(), "num_attention_heads")
        self.k_heads = divide(hk, tp_size(), "num_key_value_heads")
        self.full_k_heads = hk
        self.history = config.conv_history
        channels = (self.q_heads + self.k_heads) * d
        self.q_proj = ColumnParallelLinear(h, hq * d, bias=config.attention_bias)
        self.k_proj = ColumnParallelLinear(h, hk * d, bias=config.attention_bias)
        # V heads do not follow a column split (the first Hk/2 heads come from v_proj_current, the rest from
        # v_proj_delayed), so both stay replicated and each rank slices its heads from the full V.
        self.v_proj_current = ReplicatedLinear(h, hk * d // 2, bias=config.attention_bias)
        self.v_proj_delayed = ReplicatedLinear(h, hk * d // 2, bias=config.attention_bias)
        rows = _head_rows(hq, hk, d)
        self.conv_qk_depthwise = ConvWeights(channels, 1, config.cca_time0, rows)
        self.conv_qk_grouped = ConvWeights(channels, d, config.cca_time1, rows)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, state: dict[str, torch.Tensor],
                page_state: dict[str, torch.Tensor]):
        """`state`: the per-request slots; `page_state`: per-page footers to fill (empty without prefix caching)."""
        tokens, d = h.shape[0], self.head_dim
        q, k = self.q_proj(h), self.k_proj(h)
        group = self.q_heads // self.k_heads
        q_res = (q.view(tokens, self.q_heads, d) + k.view(tokens, self.k_heads, d).repeat_interleave(group, 1)) * 0.5
        k_res = q_res.view(tokens, self.k_heads, group, d).mean(dim=2)
        mixed = self._conv(torch.cat([q, k], dim=-1), batch, state["conv"], page_state.get("conv"))
        query = mixed[:, : self.q_heads * d].view(tokens, self.q_heads, d) + q_res
        key = mixed[:, self.q_heads * d :].view(tokens, self.k_heads, d) + k_res
        value = torch.cat([self.v_proj_current(h), self._lagged(h, batch, state["lag"], page_state.get("lag"))], -1)
        first = tp_rank() * self.k_heads
        value = value.view(tokens, self.full_k_heads, d)[:, first:first + self.k_heads]
        return query, key, value

    def _conv(self, qk: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
              conv_footer: torch.Tensor | None) -> torch.Tensor:
        """Causal conv over [carried raw rows | new raw rows] of every sequence; updates the carried rows (and the
        footer of every page this step completes: the rows as they stand after the page's last token)."""
        layout = batch.token_history
        carried = conv_state[batch.state_slots].transpose(1, 2)  # [B, P, C]
        carried = torch.where(batch.has_initial_state[:, None, None], carried, torch.zeros_like(carried))
        rows = qk.new_zeros(layout.total_rows, qk.shape[1])
        rows[layout.history_index.flatten()] = carried.reshape(-1, qk.shape[1])
        rows[layout.token_index] = qk
        conv_state[batch.state_slots] = rows[layout.final_index].transpose(1, 2)
        if conv_footer is not None:
            window = layout.token_index[batch.page_end_tokens][:, None] + torch.arange(
                1 - self.history, 1, device=qk.device)
            conv_footer[batch.page_end_pages] = rows[window].transpose(1, 2)
        stage1 = F.conv1d(rows.t()[None], self.conv_qk_depthwise.weight, self.conv_qk_depthwise.bias,
                          groups=qk.shape[1])
        stage2 = F.conv1d(stage1, self.conv_qk_grouped.weight, self.conv_qk_grouped.bias,
                          groups=self.q_heads + self.k_heads)
        # Output column i covers raw rows i .. i + P, so a token at row r reads column r - P.
        return stage2[0].t()[layout.token_index - self.history]

    def _lagged(self, h: torch.Tensor, batch: ForwardBatch, lag_state: torch.Tensor,
                lag_footer: torch.Tensor | None) -> torch.Tensor:
        """v_proj_delayed of each token's predecessor; a fresh sequence's predecessor is the zero vector."""
        layout = batch.token_history
        delayed = self.v_proj_delayed(h)
        fresh = self.v_proj_delayed(h.new_zeros(1, h.shape[1])).expand(batch.num_seqs, -1)
        previous = torch.where(batch.has_initial_state[:, None], lag_state[batch.state_slots], fresh)
        rows = delayed.new_zeros(layout.total_rows, delayed.shape[1])
        rows[layout.history_index[:, -1]] = previous
        rows[layout.token_index] = delayed
        lag_state[batch.state_slots] = rows[layout.final_index[:, -1]]
        if lag_footer is not None:
            lag_footer[batch.page_end_pages] = rows[layout.token_index[batch.page_end_tokens]]
        return rows[layout.token_index - 1]


class ConvWeights(nn.Module):
    """Conv1d weight [C, in_per_group, kernel] + bias [C]; a rank keeps its q-head and k-head channels."""

    def __init__(self, channels: int, in_per_group: int, kernel: int, rank_rows: torch.Tensor):
        super().__init__()
        self.rank_rows = rank_rows
        self.weight = new_parameter(channels, in_per_group, kernel, loader=self._load)
        self.bias = new_parameter(channels, loader=self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        if loaded.shape[0] <= int(self.rank_rows.max()):
            raise ValueError(f"conv tensor with {loaded.shape[0]} channels is too small")
        shard = loaded[self.rank_rows]
        check_shape(param.shape, shard)
        param.data.copy_(shard)


class QKNorm(nn.Module):
    """q, k scaled to norm sqrt(D) (fp32), then k times a learned per-KV-head temperature."""

    def __init__(self, config: ZayaConfig, k_heads: int):
        super().__init__()
        self.scale = math.sqrt(config.head_dim)
        self.temp = new_parameter(k_heads, loader=self._load)

    @staticmethod
    def _load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        local = param.shape[0]
        shard = loaded[tp_rank() * local:(tp_rank() + 1) * local]
        check_shape(param.shape, shard)
        param.data.copy_(shard)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = torch.finfo(torch.float32).eps
        q, k = q.float(), k.float()
        q = q * (self.scale / q.norm(dim=-1, keepdim=True).clamp_min(eps))
        k = k * (self.scale / k.norm(dim=-1, keepdim=True).clamp_min(eps))
        return q, k * self.temp.float()[None, :, None]


class CCAAttention(nn.Module):
    def __init__(self, config: ZayaConfig, layer_type: str):
        super().__init__()
        self.qkv_proj = CCAProjection(config)
        self.qk_norm = QKNorm(config, self.qkv_proj.k_heads)
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size,
                                        bias=config.attention_bias)
        rope = config.rope[layer_type]
        self.rotary = RotaryEmbedding(int(config.head_dim * rope.partial_rotary_factor), rope.theta)
        self.sliding_window = config.sliding_window if layer_type == "hybrid_sliding" else None
        self.scale = config.head_dim ** -0.5
        self.kv: dict[str, torch.Tensor] = {}
        self.state: dict[str, torch.Tensor] = {}
        self.page_state: dict[str, torch.Tensor] = {}

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(h, batch, self.state, self.page_state)
        q, k = self.qk_norm(q, k)
        q = self.rotary(batch.positions, q).to(h.dtype)
        k = self.rotary(batch.positions, k).to(h.dtype)
        self.kv["k"][batch.slot_mapping] = k
        self.kv["v"][batch.slot_mapping] = v
        out = paged_attention(q, self.kv["k"], self.kv["v"], batch, self.scale, self.sliding_window)
        return self.o_proj(out.flatten(1))


class ResidualScaling(nn.Module):
    """x_new = (u + b_h) * s_h + (x + b_r) * s_r, all in fp32 (the residual stream stays fp32)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_states_scale = new_parameter(hidden_size)
        self.hidden_states_bias = new_parameter(hidden_size)
        self.residual_scale = new_parameter(hidden_size)
        self.residual_bias = new_parameter(hidden_size)

    def forward(self, update: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        branch = (update.float() + self.hidden_states_bias.float()) * self.hidden_states_scale.float()
        return branch + (residual + self.residual_bias.float()) * self.residual_scale.float()


class RouterMLP(nn.Module):
    def __init__(self, width: int, num_classes: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(width, eps, dtype=torch.float32)
        self.fc1 = ReplicatedLinear(width, width, bias=True, dtype=torch.float32)
        self.fc2 = ReplicatedLinear(width, width, bias=True, dtype=torch.float32)
        self.out_proj = ReplicatedLinear(width, num_classes, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(self.norm(x)))
        return self.out_proj(F.gelu(self.fc2(x)))


class EDARouter(nn.Module):
    """Scores E experts + 1 skip class; the down-projected activation is carried to the next layer's router.

    The router is tiny, so it runs entirely in fp32: a top-1 choice flips on near-ties, and each flip changes a
    token's output by a whole expert, so routing is where low precision costs most.
    """

    def __init__(self, config: ZayaConfig, use_eda: bool):
        super().__init__()
        width = config.router_hidden_size
        self.down_proj = ReplicatedLinear(config.hidden_size, width, bias=True, dtype=torch.float32)
        self.router_states_scale = new_parameter(width, dtype=torch.float32) if use_eda else None
        self.router_mlp = RouterMLP(width, config.num_experts + 1, config.rms_norm_eps)
        # Selection-only bias from training's load balancer.
        self.balancing_biases = new_parameter(config.num_experts + 1, dtype=torch.float32)

    def forward(self, x: torch.Tensor, carry: torch.Tensor | None):
        z = self.down_proj(x.float())
        if self.router_states_scale is not None and carry is not None:
            z = z + carry * self.router_states_scale
        probs = torch.softmax(self.router_mlp(z), dim=-1)
        choice = (probs + self.balancing_biases).argmax(dim=-1)
        return choice, probs.gather(-1, choice[:, None]), z


class ZayaMoE(nn.Module):
    def __init__(self, config: ZayaConfig, layer_idx: int):
        super().__init__()
        self.num_experts = config.num_experts
        self.scaled_identity = config.mod_skip_mode == "scaled_identity"
        self.gate = EDARouter(config, use_eda=layer_idx != 0)
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, x: torch.Tensor, carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        choice, weight, carry = self.gate(x, carry)
        skip = (choice == self.num_experts)[:, None]
        # Skip tokens run expert 0 with weight 0: exactly zero, so the (partial) sum needs no premask.
        routed = self.experts(x, choice.masked_fill(skip[:, 0], 0)[:, None], weight.masked_fill(skip, 0.0))
        out = all_reduce(routed).float()
        if self.scaled_identity:
            # Replicated on every rank: added once, after the reduce.
            out = out + torch.where(skip, weight * x.float(), 0.0)
        return out, carry


class ZayaDecoderLayer(nn.Module):
    def __init__(self, config: ZayaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CCAAttention(config, config.layer_types[layer_idx])
        self.post_attention_residual_scale = ResidualScaling(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = ZayaMoE(config, layer_idx)
        self.post_mlp_residual_scale = ResidualScaling(config.hidden_size)

    def forward(self, x: torch.Tensor, carry: torch.Tensor | None, batch: ForwardBatch):
        x = self.post_attention_residual_scale(self.self_attn(self.input_layernorm(x), batch), x)
        update, carry = self.mlp(self.post_attention_layernorm(x), carry)
        return self.post_mlp_residual_scale(update, x), carry


class ZayaModel(nn.Module):
    def __init__(self, config: ZayaConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.input_hidden_states_scale = new_parameter(config.hidden_size)
        self.input_hidden_states_bias = new_parameter(config.hidden_size)
        self.layers = nn.ModuleList(ZayaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        e = self.embed_tokens(batch.input_ids).float()
        x = (e + self.input_hidden_states_bias.float()) * self.input_hidden_states_scale.float()
        carry = None
        for layer in self.layers:
            x, carry = layer(x, carry, batch)
        return self.norm(x)


_LEGACY_SUBLAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LEGACY_ATTENTION = {
    "input_norm.weight": "input_layernorm.weight",
    "self_attn.qkv.linear_q.weight": "self_attn.qkv_proj.q_proj.weight",
    "self_attn.qkv.linear_q.bias": "self_attn.qkv_proj.q_proj.bias",
    "self_attn.qkv.linear_k.weight": "self_attn.qkv_proj.k_proj.weight",
    "self_attn.qkv.linear_k.bias": "self_attn.qkv_proj.k_proj.bias",
    "self_attn.qkv.val_proj1.weight": "self_attn.qkv_proj.v_proj_current.weight",
    "self_attn.qkv.val_proj1.bias": "self_attn.qkv_proj.v_proj_current.bias",
    "self_attn.qkv.val_proj2.weight": "self_attn.qkv_proj.v_proj_delayed.weight",
    "self_attn.qkv.val_proj2.bias": "self_attn.qkv_proj.v_proj_delayed.bias",
    "self_attn.qkv.conv_qk.0.weight": "self_attn.qkv_proj.conv_qk_depthwise.weight",
    "self_attn.qkv.conv_qk.0.bias": "self_attn.qkv_proj.conv_qk_depthwise.bias",
    "self_attn.qkv.conv_qk.1.weight": "self_attn.qkv_proj.conv_qk_grouped.weight",
    "self_attn.qkv.conv_qk.1.bias": "self_attn.qkv_proj.conv_qk_grouped.bias",
    "self_attn.qkv.temp": "self_attn.qk_norm.temp",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "self_attn.o_proj.bias": "self_attn.o_proj.bias",
}
_LEGACY_MOE = {
    "input_norm.weight": "post_attention_layernorm.weight",
    "zaya_block.router.rmsnorm_eda.weight": "mlp.gate.router_mlp.norm.weight",
    "zaya_block.router.router_mlp.0.weight": "mlp.gate.router_mlp.fc1.weight",
    "zaya_block.router.router_mlp.0.bias": "mlp.gate.router_mlp.fc1.bias",
    "zaya_block.router.router_mlp.2.weight": "mlp.gate.router_mlp.fc2.weight",
    "zaya_block.router.router_mlp.2.bias": "mlp.gate.router_mlp.fc2.bias",
    "zaya_block.router.router_mlp.4.weight": "mlp.gate.router_mlp.out_proj.weight",
}
_LEGACY_EXPERT = re.compile(r"zaya_block\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")


class ZayaForCausalLM(nn.Module):
    def __init__(self, config: ZayaConfig):
        super().__init__()
        self.config = config
        self.model = ZayaModel(config)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, config.lm_head_bias, tied_to=tied)

    # --- what the runner needs to know -------------------------------------------------------------------
    # The CCA state is a few rows per layer, so every KV page carries a copy of the state after its last token
    # (a footer, written during the forward): prefix-cache hits are usable at any page boundary.
    state_checkpoints = "per_page"

    @property
    def history_len(self) -> int:
        return self.config.conv_history

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        attn = self.model.layers[0].self_attn.qkv_proj
        shape = (attn.k_heads, self.config.head_dim)
        return KVCacheSpec(num_layers=self.config.num_layers, fields={"k": shape, "v": shape}, dtype=dtype)

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        attn = self.model.layers[0].self_attn.qkv_proj
        channels = (attn.q_heads + attn.k_heads) * self.config.head_dim
        return StateSpec(num_layers=self.config.num_layers, fields={
            "conv": StateField((channels, self.config.conv_history), dtype),
            "lag": StateField((self.config.num_kv_heads * self.config.head_dim // 2,), dtype),
        })

    def bind_caches(self, kv_layers: list[dict[str, torch.Tensor]], state_layers: list[dict[str, torch.Tensor]],
                    page_state_layers: list[dict[str, torch.Tensor]] | None = None):
        page_state_layers = page_state_layers or [{}] * len(state_layers)
        for layer, kv, state, footer in zip(self.model.layers, kv_layers, state_layers, page_state_layers):
            layer.self_attn.kv = kv
            layer.self_attn.state = state
            layer.self_attn.page_state = footer

    # --- forward -----------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # --- checkpoint names --------------------------------------------------------------------------------
    def checkpoint_target(self, name: str) -> tuple[str, Hashable | None] | None:
        """Parameter (and shard) a checkpoint tensor fills; None for tensors that are deliberately not loaded."""
        if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        return self._legacy_target(name) if self.config.legacy_layout else (name, None)

    def _legacy_target(self, name: str) -> tuple[str, Hashable | None]:
        last = self.config.num_layers - 1
        simple = {"model.final_norm.weight": "model.norm.weight", "model.embed_tokens.weight": name,
                  "lm_head.weight": name, "lm_head.bias": name}
        if name in simple:
            return simple[name], None
        if name.startswith("model.res_scale."):
            return f"model.layers.{last}.post_mlp_residual_scale.{name.rsplit('.', 1)[1]}", None
        match = _LEGACY_SUBLAYER.fullmatch(name)
        if not match:
            return name, None
        sub, rest = int(match.group(1)), match.group(2)
        layer = sub // 2
        if rest.startswith("res_scale."):
            field_name = rest.split(".", 1)[1]
            if sub == 0:
                return f"model.input_{field_name}", None
            owner = f"{layer - 1}.post_mlp" if sub % 2 == 0 else f"{layer}.post_attention"
            return f"model.layers.{owner}_residual_scale.{field_name}", None
        if sub % 2 == 0:
            return f"model.layers.{layer}.{_LEGACY_ATTENTION.get(rest, rest)}", None
        expert = _LEGACY_EXPERT.fullmatch(rest)
        if expert:
            param = "gate_up_proj" if expert.group(2) == "1" else "down_proj"
            return f"model.layers.{layer}.mlp.experts.{param}", int(expert.group(1))
        if rest.startswith("zaya_block.router.") and rest not in _LEGACY_MOE:
            return f"model.layers.{layer}.mlp.gate.{rest.removeprefix('zaya_block.router.')}", None
        return f"model.layers.{layer}.{_LEGACY_MOE.get(rest, rest)}", None
