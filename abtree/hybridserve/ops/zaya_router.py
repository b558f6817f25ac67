"""ZAYA1's EDA router: fp32 down-projection, EDA carry, RMSNorm, two exact-GELU layers, E + 1 classes, softmax,
argmax over p + balancing_biases, all in fp32 (reference: ops/reference/zaya_router.py)."""
from __future__ import annotations

import torch

from hybridserve.ops import backends
from hybridserve.ops.reference import zaya_router as reference
from hybridserve.ops.reference.zaya_router import Routing


def eda_route(x32: torch.Tensor, down_weight: torch.Tensor, down_bias: torch.Tensor, carry: torch.Tensor | None,
              states_scale: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, fc1_weight: torch.Tensor,
              fc1_bias: torch.Tensor, fc2_weight: torch.Tensor, fc2_bias: torch.Tensor, out_weight: torch.Tensor,
              balancing_biases: torch.Tensor) -> Routing:
    """x32 [T, H] fp32 (the normed MoE input); down_weight [R, H], down_bias [R]; carry [T, R] fp32 or None; the
    rest fp32 router parameters (out_weight [E + 1, R]). The carry is added only when both it and states_scale are
    given. The routing's carry is a tensor of its own: the caller's tensors are left unchanged."""
    args = (x32, down_weight, down_bias, carry, states_scale, norm_weight, eps, fc1_weight, fc1_bias, fc2_weight,
            fc2_bias, out_weight, balancing_biases)
    if backends.use_triton("zaya_router", x32.device):
        from hybridserve.ops.triton import zaya_router as kernel
        return kernel.eda_route(*args)
    return reference.eda_route(*args)
