"""Build a model for a checkpoint directory: parse its config, construct it on the target device, then load its
weights (checkpoint.py) or initialise random ones (load_format="dummy")."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from hybridserve.checkpoint import load_weights, read_config
from hybridserve.core.quant import FP8_DTYPE, QuantConfig, parse_quantization
from hybridserve.models.base import CausalLM
from hybridserve.models.registry import model_family
from hybridserve.runtime.dummy_weights import init_dummy_weights

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "half": torch.float16,
           "float": torch.float32}


def resolve_dtype(option: str | torch.dtype, config_dtype: str | None) -> torch.dtype:
    """`auto` takes the checkpoint's torch_dtype (float32 when it names none)."""
    if isinstance(option, torch.dtype):
        return option
    if option == "auto":
        return _DTYPES.get(str(config_dtype).removeprefix("torch."), torch.float32) if config_dtype else torch.float32
    if option not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, bfloat16, float16, float32; got {option!r}")
    return _DTYPES[option]


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                hf_overrides: dict | None = None, progress: bool = False, load_format: str = "auto",
                seed: int = 0, quantization: str | None = None) -> tuple[CausalLM, object]:
    """(model with weights loaded, parsed model config); `progress` shows a bar while the weights load.

    load_format auto / safetensors: the checkpoint's *.safetensors (the only format read); dummy: random weights
    seeded with `seed`, nothing read but config.json (FP8 ones when config.json has a quantization_config or
    `quantization` asks for it). `quantization`: "fp8" quantizes a 16-bit checkpoint's weights as they load; a
    checkpoint's own quantization_config needs nothing (core/quant.py)."""
    start = time.monotonic()
    raw = read_config(model_dir, hf_overrides)
    family = model_family(raw)
    config = family.parse_config(raw)
    quant = parse_quantization(raw, quantization)
    with torch.device(device), _default_dtype(dtype):
        model = family.model_class(config, quant)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        logger.info("initialised %s random weights in %.1f s", type(model).__name__, time.monotonic() - start)
    else:
        load_weights(model, model_dir, progress, quant)
        logger.info("loaded %s weights from %s in %.1f s", type(model).__name__, model_dir, time.monotonic() - start)
    logger.info("weights: %s", describe_weights(model, quant))
    model.prepare_kernels()
    return model.eval(), config


def describe_weights(model: nn.Module, quant: QuantConfig | None) -> str:
    """The weights' bytes on this rank, split into FP8 values, their scales and the rest (16/32-bit)."""
    fp8 = scales = other = 0
    for param in model.parameters():
        size = param.numel() * param.element_size()
        if param.dtype == FP8_DTYPE:
            fp8 += size
        elif getattr(param, "fp8_companion", False):
            scales += size
        else:
            other += size
    total = (fp8 + scales + other) / 2**30
    if quant is None:
        return f"{total:.2f} GiB"
    scheme = quant.scheme
    kind = "online, " if scheme.online else ""
    granularity = f"{scheme.block[0]}x{scheme.block[1]} blocks" if scheme.block else f"per {scheme.weight}"
    return (f"{total:.2f} GiB: FP8 e4m3 {fp8 / 2**30:.2f} GiB ({kind}scales {granularity}, {scales / 2**20:.1f} "
            f"MiB; activations per {scheme.activation}), 16/32-bit {other / 2**30:.2f} GiB")
