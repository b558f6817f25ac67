"""The decode bandwidth floor: the bytes one decode step of ZAYA1 or Ling-2.6 must move (the weights it touches,
the KV cache and recurrent state it reads) over HBM bandwidth, as tokens/s. The offline benchmark reports every
decode scenario against it; a step can go no faster."""
from __future__ import annotations

from hybridserve.models.ling_config import parse_ling_config

HBM_BYTES_PER_S = 4.3e12  # what a device-to-device copy reaches on an H200 (read + written), not the 4.8 TB/s datasheet


def decode_floor(config: dict, batch: int, context: int, fp8: bool = False,
                 bandwidth: float = HBM_BYTES_PER_S, experts_touched: float | None = None) -> float:
    """Tokens/s of `config`'s model (a config.json) at `batch` rows of `context` tokens, if a decode step only had
    to move its bytes at HBM speed (`bandwidth` bytes/s: the device's copy rate; by default an H200's). The routed
    experts a MoE layer reads: `experts_touched` (distinct ones, counted in a run), else `expected_experts`."""
    steps = _zaya_step_bytes if config["model_type"] == "zaya" else _ling_step_bytes
    return batch / (steps(config, batch, context, fp8, experts_touched) / bandwidth)


def expected_experts(config: dict, batch: int) -> float:
    """Distinct routed experts a MoE layer reads for `batch` tokens whose choices are independent and uniform:
    what a load-balanced model approaches. Random (dummy) weights route less evenly, so their steps read fewer
    (benchmarks/offline/expert_spread.py counts them)."""
    if config["model_type"] == "zaya":
        experts, per_token = config["num_experts"], 1
    else:
        c = parse_ling_config(config)
        experts, per_token = c.num_experts, c.num_experts_per_tok
    return experts * (1 - (1 - per_token / experts) ** batch)


def _zaya_step_bytes(config: dict, batch: int, context: int, fp8: bool = False,
                     experts_touched: float | None = None) -> float:
    """Bytes one ZAYA1 decode step moves. `fp8`: the projections and experts take one byte a weight (the router and
    the LM head stay as they are)."""
    h, layers, e = config["hidden_size"], config["num_hidden_layers"], config["num_experts"]
    cca = h * 1024 + h * 256 + 2 * h * 128 + 1024 * h
    router = h * 256 + 2 * 256 * 256 + 256 * (e + 1)
    expert = 3 * h * config["moe_intermediate_size"]
    touched = expected_experts(config, batch) if experts_touched is None else experts_touched
    quantized = (1 if fp8 else 2) * layers * (cca + touched * expert)
    weights = quantized + 2 * (layers * router + config["vocab_size"] * h)
    kv = batch * context * layers * 512 * 2
    return weights + kv


def _ling_step_bytes(config: dict, batch: int, context: int, fp8: bool = False,
                     experts_touched: float | None = None) -> float:
    return sum(ling_decode_bytes(config, batch, context, fp8, experts_touched).values())


def ling_decode_bytes(config: dict, batch: int, context: int, fp8: bool = False,
                      experts_touched: float | None = None) -> dict[str, float]:
    """Bytes one Ling decode step moves: the weights it touches (bf16, or with `fp8` one byte for the projections
    and experts but MLA's kv_b_proj; routers fp32; routed experts `experts_touched` distinct ones a MoE layer, else
    `expected_experts`; norms left out), every MLA layer's latent KV of the context (bf16) and every lightning
    layer's fp32 state (read and written)."""
    c = parse_ling_config(config)
    h, heads, qk = c.hidden_size, c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    lightning = 5 * heads * c.head_dim * h  # Q|K|V|G in, dense out
    q = c.q_lora_rank * h + heads * qk * c.q_lora_rank if c.q_lora_rank else heads * qk * h
    w = 1 if fp8 else 2  # bytes per projection or expert weight
    kv_b = 2 * heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank
    mla = w * (q + (c.kv_lora_rank + c.qk_rope_head_dim) * h + heads * c.v_head_dim * h) + kv_b
    touched = expected_experts(config, batch) if experts_touched is None else experts_touched
    moe = w * (touched * 3 * c.moe_intermediate_size + 3 * c.shared_expert_width) * h + 4 * c.num_experts * h
    dense = w * 3 * c.intermediate_size * h
    weights = sum((mla if c.is_mla(i) else w * lightning) + (dense if c.is_dense(i) else moe)
                  for i in range(c.num_layers)) + 2 * c.vocab_size * h  # + the LM head
    kv = batch * context * len(c.mla_layers) * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    states = batch * len(c.lightning_layers) * heads * c.head_dim ** 2 * 4 * 2
    return {"weights": weights, "kv": kv, "states": states}
