"""ZAYA1's EDA router after its fp32 down-projection GEMM: EDA carry, RMSNorm, two exact-GELU layers, E + 1
classes, softmax, argmax over p + balancing_biases, in one fp32 pass (reference: ops/reference/zaya_router.py)."""
from __future__ import annotations

import torch

from hybridserve.ops import backends
from hybridserve.ops.reference import zaya_router as reference
from hybridserve.ops.reference.zaya_router import Routing


def eda_route(z: torch.Tensor, carry: torch.Tensor | None, states_scale: torch.Tensor | None,
              norm_weight: torch.Tensor, eps: float, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor,
              fc2_weight: torch.Tensor, fc2_bias: torch.Tensor, out_weight: torch.Tensor,
              balancing_biases: torch.Tensor) -> Routing:
    """z [T, R] fp32 (down_proj output); carry [T, R] fp32 or None; the rest fp32 router parameters
    (out_weight [E + 1, R]). The carry is added only when both it and states_scale are given."""
    args = (z, carry, states_scale, norm_weight, eps, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight,
            balancing_biases)
    if backends.use_triton("zaya_router", z.device):
        from hybridserve.ops.triton import zaya_router as kernel
        return kernel.eda_route(*args)
    return reference.eda_route(*args)
