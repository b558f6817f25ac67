"""load_format="dummy": random weights from config.json alone, for benchmarking models whose checkpoints are not
on the machine (Ling-2.6-flash is 208 GB in bf16).

Every parameter is filled in place on the device it was built on (no CPU copy, no temporary of its size), by its
role, so activations keep their scale over many layers: matrices ~ N(0, 1/fan_in), norm weights, scales and key
temperatures 1, biases (the routers' selection biases included) 0. Buffers the model computes from its config
(Ling's lightning decay slopes, rotary frequencies) are left as built. One generator seeded with `seed` fills the
parameters in a fixed order, so two loads on the same device are identical. An FP8 weight is drawn the same way
one matrix (one expert) at a time and quantized as its scheme keeps it, which fills its scales; a static
activation scale is 1.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from hybridserve.layers.weights import fp8_scales
from hybridserve.ops.reference.fp8 import quantize_weight

logger = logging.getLogger(__name__)

_ONES = ("norm.weight", "_scale", ".temp")  # RMSNorm / group-norm weights, ZAYA1 residual and router scales, QK temp
_ZEROS = ("bias", "_biases")  # linear and conv biases, ZAYA1 residual biases, balancing / expert selection biases


def _fan_in(name: str, param: nn.Parameter) -> int:
    """Inputs per output: the last dim (stacked experts included), times the window for a conv [C, in, kernel]."""
    return param.shape[-1] * (param.shape[-2] if "conv" in name else 1)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of `model` by its role (see the module docstring)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if getattr(param, "fp8_companion", False):
            continue  # an FP8 weight's scales: filled with it
        if name.endswith(_ONES):
            param.fill_(1.0)
        elif name.endswith(_ZEROS):
            param.zero_()
        elif param.dim() >= 2:
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            std = _fan_in(name, param) ** -0.5
            if fp8_scales(param) is None:
                param.normal_(0.0, std, generator=gen)
            else:
                _random_fp8(param, std, gen)
        else:
            raise ValueError(f"no dummy initialisation rule for parameter {name!r} {tuple(param.shape)}")
    logger.warning("load_format=dummy: %s has RANDOM weights (seed %d); its output is meaningless",
                   type(model).__name__, seed)


def _random_fp8(param: nn.Parameter, std: float, gen: torch.Generator) -> None:
    """N(0, std) values quantized into an FP8 weight and its scales, a matrix at a time (no stack-sized temporary)."""
    fp8 = fp8_scales(param)
    values, scales = param.data.view(-1, *param.shape[-2:]), fp8.scale.data.view(-1, *fp8.scale.shape[param.dim() - 2:])
    for matrix, scale in zip(values, scales):
        draw = torch.empty(matrix.shape, device=param.device).normal_(0.0, std, generator=gen)
        quantized, matrix_scale = quantize_weight(draw, fp8.scheme)
        matrix.copy_(quantized)
        scale.copy_(matrix_scale)
    if fp8.input_scale is not None:
        fp8.input_scale.data.fill_(1.0)
