"""model_type -> how to parse its config and build its model."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from hybridserve.models.ling import LingForCausalLM
from hybridserve.models.ling_config import parse_ling_config
from hybridserve.models.zaya import ZayaForCausalLM
from hybridserve.models.zaya_config import parse_zaya_config


@dataclass(frozen=True)
class ModelFamily:
    parse_config: Callable[[dict], object]
    model_class: Callable[[object], nn.Module]


_FAMILIES: dict[str, ModelFamily] = {
    "zaya": ModelFamily(parse_zaya_config, ZayaForCausalLM),
    "bailing_hybrid": ModelFamily(parse_ling_config, LingForCausalLM),
}


def model_family(config: dict) -> ModelFamily:
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_FAMILIES)}")
    return _FAMILIES[model_type]
