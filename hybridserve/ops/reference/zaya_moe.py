"""ZAYA1's MoE half of a layer as its reference ops, in order: the EDA router, the routed experts (skip tokens run
expert 0 with weight 0), the residual norm with MOD's scaled identity as its skip term (contract of
`ops.zaya_moe.routed_experts_residual_norm`, which the one-launch kernel is tested against)."""
from __future__ import annotations

from dataclasses import replace

import torch

from hybridserve.ops.reference import moe, norm as norm_reference
from hybridserve.ops.reference.zaya_router import EDARouterWeights, Routing, eda_route
from hybridserve.ops.residual_norm_args import ResidualNormArgs


def routed_experts_residual_norm(x: torch.Tensor, x32: torch.Tensor, carry: torch.Tensor | None,
                                 router: EDARouterWeights, w13: torch.Tensor, w2: torch.Tensor, norm: ResidualNormArgs,
                                 scaled_identity: bool) -> tuple[tuple, Routing]:
    route = eda_route(*router.route_args(x32, carry))
    if scaled_identity:
        norm = replace(norm, skip_weight=route.skip_weight, skip_input=x)
    update = moe.fused_experts(x, w13, w2, route.expert_ids, route.expert_weights)
    return norm_reference.residual_rms_norm(update, **vars(norm)), route
