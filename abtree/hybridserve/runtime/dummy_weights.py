"""load_format="dummy": random weights from config.json alone, for benchmarking models whose checkpoints are not
on the machine (Ling-2.6-flash is 208 GB in bf16).

Every parameter is filled in place on the device it was built on (no CPU copy, no temporary of its size), by its
role, so activations keep their scale over many layers: matrices ~ N(0, 1/fan_in), norm weights, scales and key
temperatures 1, biases (the routers' selection biases included) 0. Buffers the model computes from its config
(Ling's lightning decay slopes, rotary frequencies) are left as built. One generator seeded with `seed` fills the
parameters in a fixed order, so two loads on the same device are identical.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

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
        if name.endswith(_ONES):
            param.fill_(1.0)
        elif name.endswith(_ZEROS):
            param.zero_()
        elif param.dim() >= 2:
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.normal_(0.0, _fan_in(name, param) ** -0.5, generator=gen)
        else:
            raise ValueError(f"no dummy initialisation rule for parameter {name!r} {tuple(param.shape)}")
    logger.warning("load_format=dummy: %s has RANDOM weights (seed %d); its output is meaningless",
                   type(model).__name__, seed)
