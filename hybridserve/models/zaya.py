"""Zyphra ZAYA1: CCA attention (two-stage causal conv on q/k + one-token value lag) and a top-1 MoE with an EDA
router and a MOD skip class, on an fp32 residual stream with ResidualScaling.

Per-request state of each layer (state pool fields): `conv` [C_local, P] = the raw q|k projections of the last
P = 2 tokens (oldest first), and `lag` [Hk*D/2] = v_proj_delayed of the last token (the projected form; a slot is
never read as the raw-h form). The KV cache holds K after norm, temperature and RoPE, and raw V.
"""
from __future__ import annotations

import re
from collections.abc import Hashable
from dataclasses import replace

import torch
from torch import nn

from hybridserve.cache.kv_pool import KVCacheSpec
from hybridserve.cache.state_pool import StateField, StateSpec
from hybridserve.core.batch import ForwardBatch
from hybridserve.core.parallel import divide, tp_rank, tp_size
from hybridserve.core.quant import QuantConfig, QuantScope
from hybridserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from hybridserve.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from hybridserve.layers.moe import StackedExperts
from hybridserve.layers.norm import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.layers.weights import check_shape, new_parameter
from hybridserve.models.zaya_config import ZayaConfig
from hybridserve.ops import backends
from hybridserve.ops.attention import paged_attention
from hybridserve.ops.conv import cca_conv_to_cache
from hybridserve.ops.norm import PendingNorm, ResidualNorm, residual_rms_norm
from hybridserve.ops.qk_cache import QKCache
from hybridserve.ops.zaya_router import Routing, decode_fold, eda_route, fuses_residual_norm, residual_norm_route


def _head_rows(q_heads: int, k_heads: int, head_dim: int) -> torch.Tensor:
    """Channel indices of this rank's q heads followed by its k heads in the [q | k] conv layout."""
    q_local, k_local = q_heads // tp_size(), k_heads // tp_size()
    q_rows = torch.arange(tp_rank() * q_local * head_dim, (tp_rank() + 1) * q_local * head_dim, device="cpu")
    k_first = q_heads * head_dim + tp_rank() * k_local * head_dim
    k_rows = torch.arange(k_first, k_first + k_local * head_dim, device="cpu")
    return torch.cat([q_rows, k_rows])


# The four input projections of CCA, in the order of the fused projection's blocks (its checkpoint shard ids).
PROJECTIONS = ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed")


class CCAProjection(nn.Module):
    """q/k through the causal two-stage conv plus head-mixed residuals; v from the current and previous token.

    q_proj | k_proj | v_proj_current | v_proj_delayed run as one GEMM. q and k are column-sharded per rank; the V
    heads do not follow a column split (the first Hk/2 heads come from v_proj_current, the rest from
    v_proj_delayed), so both value projections stay replicated and each rank keeps its heads of the full V.
    """

    def __init__(self, config: ZayaConfig, quant: QuantScope):
        super().__init__()
        hq, hk, d, h = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
        self.q_heads = divide(hq, tp_size(), "num_attention_heads")
        self.k_heads = divide(hk, tp_size(), "num_key_value_heads")
        self.lag_width = hk * d // 2
        channels = (self.q_heads + self.k_heads) * d
        self.qkvv_proj = MergedColumnParallelLinear(h, [hq * d, hk * d, self.lag_width, self.lag_width],
                                                    bias=config.attention_bias, replicated=[False, False, True, True],
                                                    quant=quant.scheme(*PROJECTIONS))
        rows = _head_rows(hq, hk, d)
        self.conv_qk_depthwise = ConvWeights(channels, 1, config.cca_time0, rows)
        self.conv_qk_grouped = ConvWeights(channels, d, config.cca_time1, rows)

    def forward(self, h: torch.Tensor | PendingNorm, batch: ForwardBatch, state: dict[str, torch.Tensor],
                page_state: dict[str, torch.Tensor], cache: QKCache) -> torch.Tensor:
        """h: the layer's normed input, or the PendingNorm that makes it (finished in the projection's launch);
        `state`: the per-request slots; `page_state`: per-page footers to fill (empty without prefix caching);
        `cache`: the q/k normalisation and the KV cache that K and V go to. -> q, normalised and rotated."""
        bias = self.qkvv_proj.bias
        return cca_conv_to_cache(self.qkvv_proj(h), self.conv_qk_depthwise.weight, self.conv_qk_depthwise.bias,
                                 self.conv_qk_grouped.weight, self.conv_qk_grouped.bias,
                                 None if bias is None else bias[-self.lag_width:], self.q_heads,
                                 tp_rank() * self.k_heads, batch, state["conv"], state["lag"],
                                 page_state.get("conv"), page_state.get("lag"), cache)


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
    """The learned per-KV-head key temperature of the q/k normalisation (the op: `ops.conv.cca_conv_to_cache`)."""

    def __init__(self, k_heads: int):
        super().__init__()
        self.temp = new_parameter(k_heads, loader=self._load)

    @staticmethod
    def _load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        local = param.shape[0]
        shard = loaded[tp_rank() * local:(tp_rank() + 1) * local]
        check_shape(param.shape, shard)
        param.data.copy_(shard)


class CCAAttention(nn.Module):
    def __init__(self, config: ZayaConfig, layer_type: str, quant: QuantScope):
        super().__init__()
        self.qkv_proj = CCAProjection(config, quant.child("qkv_proj"))
        self.qk_norm = QKNorm(self.qkv_proj.k_heads)
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size,
                                        bias=config.attention_bias, quant=quant.scheme("o_proj"))
        rope = config.rope[layer_type]
        self.rotary = RotaryEmbedding(int(config.head_dim * rope.partial_rotary_factor), rope.theta)
        self.sliding_window = config.sliding_window if layer_type == "hybrid_sliding" else None
        self.scale = config.head_dim ** -0.5
        self.kv: dict[str, torch.Tensor] = {}
        self.state: dict[str, torch.Tensor] = {}
        self.page_state: dict[str, torch.Tensor] = {}

    def forward(self, h: torch.Tensor | PendingNorm, batch: ForwardBatch, norm: ResidualNorm | None = None):
        """h: the normed input, or its PendingNorm. -> the attention output (the residual update), or with `norm`
        its (x, h, h32) (o_proj's kernel may run it)."""
        # A sliding layer's KV lives in the window group (its own pages and table), when the caches have one.
        kv_batch = batch if self.sliding_window is None else batch.window_view()
        q = self.qkv_proj(h, batch, self.state, self.page_state, QKCache(
            self.qk_norm.temp, self.rotary.inv_freq, kv_batch.slot_mapping, self.kv["k"], self.kv["v"], h.dtype))
        out = paged_attention(q, self.kv["k"], self.kv["v"], kv_batch, self.scale, self.sliding_window)
        return self.o_proj(out.flatten(1), norm)


class ResidualScaling(nn.Module):
    """x_new = (u + b_h) * s_h + (x + b_r) * s_r, all in fp32 (the residual stream stays fp32), fused with the
    RMSNorm that follows it; handed to the layer computing the update u as an `ops.norm.ResidualNorm`, so that a
    decode kernel can run it in the update's own launch."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_states_scale = new_parameter(hidden_size)
        self.hidden_states_bias = new_parameter(hidden_size)
        self.residual_scale = new_parameter(hidden_size)
        self.residual_bias = new_parameter(hidden_size)

    def of(self, residual: torch.Tensor, norm: RMSNorm, fp32_copy: bool = False,
           h_pending: bool = False) -> ResidualNorm:
        """The update of `residual` followed by `norm` (and an fp32 copy of its output if asked; `h_pending`: its
        reader takes a PendingNorm)."""
        return ResidualNorm(norm.weight, norm.eps, residual, self.hidden_states_bias, self.hidden_states_scale,
                            self.residual_bias, self.residual_scale, fp32_copy=fp32_copy, h_pending=h_pending)


class RouterMLP(nn.Module):
    """The router's parameters after the down-projection (the op: `ops.zaya_router`)."""

    def __init__(self, width: int, num_classes: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(width, eps, dtype=torch.float32)
        self.fc1 = ReplicatedLinear(width, width, bias=True, dtype=torch.float32)
        self.fc2 = ReplicatedLinear(width, width, bias=True, dtype=torch.float32)
        self.out_proj = ReplicatedLinear(width, num_classes, dtype=torch.float32)


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
        self.folded_fc1 = None  # `prepare_kernels`: fc1 folded into the down-projection for the decode kernels

    def prepare_kernels(self) -> None:
        """Fold fc1 into the down-projection (`ops.zaya_router.decode_fold`) from the loaded weights."""
        mlp = self.router_mlp
        self.folded_fc1 = decode_fold(self.down_proj.weight, self.down_proj.bias, self.router_states_scale,
                                      mlp.norm.weight, mlp.fc1.weight)

    def forward(self, x32: torch.Tensor, carry: torch.Tensor | None) -> Routing:
        """x32: the normed MoE input in fp32 (the down-projection is part of the op, so its kernels fuse it)."""
        return eda_route(x32, *self._parameters_after_input(carry))

    def normalises(self, tokens: int) -> bool:
        """Whether `after_norm` runs the residual norm of a `tokens`-row update in the router's first launch (a
        decode step on the kernels); elsewhere the projection computing the update runs it in its epilogue."""
        weight = self.down_proj.weight
        return fuses_residual_norm(tokens, weight.shape[1], weight.shape[0], weight.device)

    def after_norm(self, update: torch.Tensor, norm: ResidualNorm, carry: torch.Tensor | None,
                   defer_selection: bool = False) -> tuple[tuple[torch.Tensor, torch.Tensor], Routing]:
        """-> (`norm`'s (x, h) of `update`, the routing of h): `forward` on the norm's output. `defer_selection`:
        the class selection is left to the experts' launches (`Routing.selection`)."""
        return residual_norm_route(update, norm, *self._parameters_after_input(carry),
                                   defer_selection=defer_selection, folded=self.folded_fc1)

    def _parameters_after_input(self, carry: torch.Tensor | None) -> tuple:
        mlp = self.router_mlp
        return (self.down_proj.weight, self.down_proj.bias, carry, self.router_states_scale, mlp.norm.weight,
                mlp.norm.eps, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, mlp.out_proj.weight,
                self.balancing_biases)


class ZayaMoE(nn.Module):
    def __init__(self, config: ZayaConfig, layer_idx: int, quant: QuantScope):
        super().__init__()
        self.scaled_identity = config.mod_skip_mode == "scaled_identity"
        self.gate = EDARouter(config, use_eda=layer_idx != 0)
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                      quant=quant.child("experts").scheme("gate_up_proj", "down_proj"))

    def forward(self, x: torch.Tensor, route: Routing, norm: ResidualNorm):
        """x: the normed MoE input, `route` its routing (`gate`'s) -> (`norm`'s x and h of the routed output reduced
        over ranks, the router carry).

        Skip tokens run expert 0 with weight 0: exactly zero, so the (partial) sum needs no premask. The
        scaled-identity term (skip weight * x) is replicated on every rank: it joins `norm` as its skip term, added
        once, after the reduce."""
        if self.scaled_identity:
            norm = replace(norm, skip_weight=route.skip_weight, skip_input=x)
        x_new, h, _ = self.experts.forward_residual_norm(x, route.expert_ids, route.expert_weights, norm,
                                                         route.selection)
        return x_new, h, route.carry


class ZayaDecoderLayer(nn.Module):
    def __init__(self, config: ZayaConfig, layer_idx: int, quant: QuantScope):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CCAAttention(config, config.layer_types[layer_idx], quant.child("self_attn"))
        self.post_attention_residual_scale = ResidualScaling(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = ZayaMoE(config, layer_idx, quant.child("mlp"))
        self.post_mlp_residual_scale = ResidualScaling(config.hidden_size)

    def forward(self, x: torch.Tensor, h: torch.Tensor | PendingNorm, carry: torch.Tensor | None,
                batch: ForwardBatch, next_norm: RMSNorm, h_pending: bool = False):
        """x: the fp32 residual; h: input_layernorm(x) (or its PendingNorm), computed by the layer before. Returns
        the new residual, its `next_norm` (the next layer's input norm, or the final norm; `h_pending`: left to the
        next layer's projection where the experts' launch can) and the router carry."""
        attention_norm = self.post_attention_residual_scale.of(x, self.post_attention_layernorm, fp32_copy=True)
        router = self.mlp.gate
        tokens = x.shape[0]
        if router.normalises(tokens):  # the router's first launch runs the norm (o_proj's launch then ends sooner)
            # and, where the experts' launches can make the class selection, the router leaves it to them
            (x, h2), route = router.after_norm(self.self_attn(h, batch), attention_norm, carry,
                                               self.mlp.experts.takes_deferred_selection(tokens))
        else:
            x, h2, h2_32 = self.self_attn(h, batch, attention_norm)
            route = router(h2_32, carry)
        return self.mlp(h2, route, self.post_mlp_residual_scale.of(x, next_norm, h_pending=h_pending))

    def takes_pending(self, tokens: int) -> bool:
        """Whether this layer's input projection finishes a PendingNorm of `tokens` rows in its own launch."""
        return self.self_attn.qkv_proj.qkvv_proj.takes_pending(tokens)


class ZayaModel(nn.Module):
    def __init__(self, config: ZayaConfig, quant: QuantScope):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.input_hidden_states_scale = new_parameter(config.hidden_size)
        self.input_hidden_states_bias = new_parameter(config.hidden_size)
        self.layers = nn.ModuleList(ZayaDecoderLayer(config, i, quant.child(f"layers.{i}"))
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Each residual update is fused with the norm after it, so a layer hands the next one its normed input;
        the last layer's is the final norm."""
        norms = [layer.input_layernorm for layer in self.layers] + [self.norm]
        x, h, _ = residual_rms_norm(self.embed_tokens(batch.input_ids), norms[0].weight, norms[0].eps,
                                    update_bias=self.input_hidden_states_bias,
                                    update_scale=self.input_hidden_states_scale)
        carry = None
        tokens = x.shape[0]
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms[1:])):
            # The next layer's input norm is finished in its q|k|v|v launch where that launch can (the final one
            # is the model's output: never pending).
            pending = i + 1 < len(self.layers) and self.layers[i + 1].takes_pending(tokens)
            x, h, carry = layer(x, h, carry, batch, next_norm, pending)
        return h


_PROJECTION = re.compile(rf"(model\.layers\.\d+\.self_attn\.qkv_proj\.)({'|'.join(PROJECTIONS)})\.(weight|bias)")
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
    def __init__(self, config: ZayaConfig, quant: QuantConfig | None = None):
        """`quant`: FP8 for the projections and experts (core/quant.py; its ignore rules match native checkpoint
        names); the embeddings, LM head, routers and convs stay as they are."""
        super().__init__()
        self.config = config
        self.model = ZayaModel(config, QuantScope(quant).child("model"))
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, config.lm_head_bias, tied_to=tied)

    # --- what the runner needs to know -------------------------------------------------------------------
    # The CCA state is a few rows per layer, so every KV page carries a copy of the state after its last token
    # (a footer, written during the forward): prefix-cache hits are usable at any page boundary.
    state_checkpoints = "per_page"
    # Its prefill kernels read only the batch's device tensors and host bounds (token count, rows, max_model_len
    # keys), so prefill and mixed steps can replay a CUDA graph per token bucket (runtime/prefill_graphs.py).
    prefill_graphs = True

    @property
    def history_len(self) -> int:
        """Carried rows the batch lays out in front of each sequence: only the torch reference of the conv reads
        that layout (`batch.token_history`); the kernel reads the state pool directly."""
        device = self.model.embed_tokens.weight.device
        return 0 if backends.use_triton("conv", device) else self.config.conv_history

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        attn = self.model.layers[0].self_attn.qkv_proj
        shape = (attn.k_heads, self.config.head_dim)
        window = tuple(i for i, kind in enumerate(self.config.layer_types) if kind == "hybrid_sliding")
        return KVCacheSpec(num_layers=self.config.num_layers, fields={"k": shape, "v": shape}, dtype=dtype,
                           window_layers=window, sliding_window=self.config.sliding_window if window else None)

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

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out)

    def prepare_kernels(self) -> None:
        """Each router's fc1 folded into its down-projection for the decode kernels (`EDARouter.prepare_kernels`)."""
        for layer in self.model.layers:
            layer.mlp.gate.prepare_kernels()

    # --- checkpoint names --------------------------------------------------------------------------------
    def checkpoint_target(self, name: str) -> tuple[str, Hashable | None] | None:
        """Parameter (and shard) a checkpoint tensor fills; None for tensors that are deliberately not loaded."""
        if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        target, shard = self._legacy_target(name) if self.config.legacy_layout else (name, None)
        projection = _PROJECTION.fullmatch(target)
        if projection:  # one block of the fused q | k | v_current | v_delayed projection
            prefix, which, kind = projection.groups()
            return f"{prefix}qkvv_proj.{kind}", PROJECTIONS.index(which)
        return target, shard

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
