"""model_type -> how to parse its config and build its model."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from hybridserve.config import SpeculativeConfig
from hybridserve.core.quant import QuantConfig

from hybridserve.models.ling import LingForCausalLM
from hybridserve.models.ling_config import parse_ling_config
from hybridserve.models.zaya import ZayaForCausalLM
from hybridserve.models.zaya_config import parse_zaya_config


@dataclass(frozen=True)
class ModelFamily:
    parse_config: Callable[[dict], object]
    model_class: Callable[[object, QuantConfig | None], nn.Module]
    # The config dimensions every tensor-parallel size must divide (heads are split, never replicated).
    tp_split: Callable[[object], dict[str, int]]
    # Multi-token-prediction (draft) layers the checkpoint ships: speculative decoding with method "mtp" needs one.
    mtp_layers: Callable[[object], int] = lambda c: 0


def _zaya_split(c) -> dict[str, int]:
    return {"num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "moe_intermediate_size": c.moe_intermediate_size, "vocab_size": c.vocab_size}


def _ling_split(c) -> dict[str, int]:
    split = {"num_attention_heads": c.num_heads, "group_norm_size": c.group_norm_size,
             "moe_intermediate_size": c.moe_intermediate_size, "vocab_size": c.vocab_size}
    if c.first_k_dense_replace:
        split["intermediate_size"] = c.intermediate_size
    if c.shared_expert_width:
        split["shared expert width"] = c.shared_expert_width
    return split


_FAMILIES: dict[str, ModelFamily] = {
    "zaya": ModelFamily(parse_zaya_config, ZayaForCausalLM, _zaya_split),
    "bailing_hybrid": ModelFamily(parse_ling_config, LingForCausalLM, _ling_split,
                                  lambda c: c.num_nextn_predict_layers),
}


def check_tensor_parallel(config: dict, size: int) -> None:
    """Refuse, before any rank starts, a tensor-parallel size the model cannot be sharded by, naming the limit."""
    if size == 1:
        return
    split = model_family(config).tp_split(model_family(config).parse_config(config))
    bad = {name: value for name, value in split.items() if value % size}
    if bad:
        common = math.gcd(*split.values())
        sizes = [t for t in range(1, common + 1) if common % t == 0]
        raise ValueError(f"tensor_parallel_size={size} cannot shard this {config.get('model_type')} model: "
                         + ", ".join(f"{name} = {value}" for name, value in bad.items())
                         + f" is not divisible by it (heads are split across ranks, never replicated); sizes "
                           f"that work: {', '.join(map(str, sizes))}; to use more GPUs, run several replicas")


def check_speculative(config: dict, speculative: SpeculativeConfig | None) -> None:
    """Refuse, before loading anything, a draft method the model cannot run."""
    if speculative is None or speculative.method != "mtp":
        return
    family = model_family(config)
    if family.mtp_layers(family.parse_config(config)) < 1:
        raise ValueError(f"speculative method 'mtp' (NEXTN) needs the model's multi-token-prediction layer, and this "
                         f"{config.get('model_type')} checkpoint has none (num_nextn_predict_layers = 0 or not a "
                         "model with one: ZAYA1 has none); use method 'ngram' (NGRAM) instead")


def model_family(config: dict) -> ModelFamily:
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_FAMILIES)}")
    return _FAMILIES[model_type]
