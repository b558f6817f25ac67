"""ZAYA1's EDA router: fp32 down-projection, EDA carry, RMSNorm, two exact-GELU layers, E + 1 classes, softmax,
argmax over p + balancing_biases, all in fp32 (reference: ops/reference/zaya_router.py)."""
from __future__ import annotations

from dataclasses import replace

import torch

from hybridserve.ops import backends
from hybridserve.ops.norm import ResidualNorm
from hybridserve.ops.reference import zaya_router as reference
from hybridserve.ops.reference.zaya_router import FoldedFc1, Routing, fold_fc1


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


def fuses_residual_norm(tokens: int, hidden: int, width: int, device: torch.device) -> bool:
    """Whether `residual_norm_route` runs the norm inside the router's first launch for `tokens` rows of `hidden`
    into a router of `width`; elsewhere the projection that computes the update should run it (its epilogue)."""
    if not backends.use_triton("zaya_router", device):
        return False
    from hybridserve.ops.triton import zaya_router as kernel
    return kernel.takes_residual_norm(tokens, hidden, width)


def residual_norm_route(update: torch.Tensor, norm: ResidualNorm, down_weight: torch.Tensor,
                        down_bias: torch.Tensor, carry: torch.Tensor | None, states_scale: torch.Tensor | None,
                        norm_weight: torch.Tensor, eps: float, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor,
                        fc2_weight: torch.Tensor, fc2_bias: torch.Tensor, out_weight: torch.Tensor,
                        balancing_biases: torch.Tensor, defer_selection: bool = False,
                        folded: FoldedFc1 | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor], Routing]:
    """`norm`(update), then `eda_route` of the normed rows in fp32: -> ((x, h) as `norm` gives them, the routing).
    Where `fuses_residual_norm`, the router's first launch normalises the rows itself (one last-arriving program's
    norm fewer on a decode step's critical path); the results are the same either way. `defer_selection` (only
    where `fuses_residual_norm`, for a consumer that takes it: `ops.moe.fused_experts_residual_norm`): the routing
    comes with its class selection left to the experts' launches (`Routing.selection`). `folded` (`decode_fold`):
    where the norm runs in the router's first launch and fc2's launch takes whole rows, fc1 runs folded into the
    first (a launch fewer); elsewhere unfolded, the same routing up to fp32 rounding."""
    args = (down_weight, down_bias, carry, states_scale, norm_weight, eps, fc1_weight, fc1_bias, fc2_weight,
            fc2_bias, out_weight, balancing_biases)
    if fuses_residual_norm(update.shape[0], update.shape[1], down_weight.shape[0], update.device):
        from hybridserve.ops.triton import zaya_router as kernel
        if folded is not None and not kernel.takes_folded_fc1(update.shape[0], down_weight.shape[0], defer_selection):
            folded = None
        return kernel.normed_route(update, norm, *args, defer_selection=defer_selection, folded=folded)
    if defer_selection:
        raise ValueError("residual_norm_route: a deferred selection needs the fused decode form "
                         "(fuses_residual_norm)")
    x, h, h32 = replace(norm, fp32_copy=True)(update)
    return (x, h), eda_route(h32, *args)


def decode_fold(down_weight: torch.Tensor, down_bias: torch.Tensor, states_scale: torch.Tensor | None,
                norm_weight: torch.Tensor, fc1_weight: torch.Tensor) -> FoldedFc1 | None:
    """fc1 folded into the down-projection (`FoldedFc1`) where the router's decode launches run on this device's
    kernels, else None (nothing would read it)."""
    if not backends.use_triton("zaya_router", down_weight.device):
        return None
    return fold_fc1(down_weight, down_bias, states_scale, norm_weight, fc1_weight)
