"""ZAYA1's MoE half of a decode layer in one launch: the EDA router, the top-1 routed SwiGLU expert (MOD's skip
class runs no expert; its scaled identity joins the norm) and the residual norm after it.

    routing = eda_route(x32, carry)                        ops.zaya_router
    u = experts(x, routing)                                ops.moe (expert 0 with weight 0 for skip tokens)
    (x_new, h) = norm(u [+ skip_weight * x])               ops.norm's ResidualNorm (the skip term: scaled identity)

The model runs these three ops as they are (the reference: ops/reference/zaya_moe.py), except where `takes` says
one persistent launch does them all (ops/triton/zaya_moe.py): CUDA, one rank, a decode-sized step, and only with
HYBRIDSERVE_ONE_LAUNCH_MOE=1. It is off by default because it has not shown a gain: with a program per SM
it decoded 40-layer ZAYA1-8B at batch 1 at 356 tok/s against the separate kernels' 431 on an H200
(benchmarks/results/h200-zaya1-8b-40layers-one-launch-moe.json); two programs per SM do not fit
(ops/triton/zaya_moe.py). docs/performance.md has the A/B command."""
from __future__ import annotations

import functools
import os

import torch

from hybridserve.core.parallel import tp_size
from hybridserve.core.quant import Fp8Scales
from hybridserve.ops import backends
from hybridserve.ops.norm import ResidualNorm
from hybridserve.ops.reference.zaya_router import EDARouterWeights


@functools.cache
def enabled() -> bool:
    """Whether HYBRIDSERVE_ONE_LAUNCH_MOE=1 asks for the one launch (read once per process)."""
    return os.environ.get("HYBRIDSERVE_ONE_LAUNCH_MOE", "0") == "1"


def takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, fp8: tuple[Fp8Scales, Fp8Scales] | None) -> bool:
    """Whether the one launch runs this step (host sizes only): asked for (`enabled`), the Triton kernels on CUDA,
    one rank (the experts' output is whole before the norm), at most the kernel's MAX_TOKENS tokens, 16-bit experts
    (FP8 ones keep the separate kernels)."""
    if not enabled() or fp8 is not None or tp_size() != 1 or not backends.use_triton("zaya_moe", x.device):
        return False
    from hybridserve.ops.triton import zaya_moe as kernel
    return kernel.takes(x, w13, w2)


def routed_experts_residual_norm(x: torch.Tensor, x32: torch.Tensor, carry: torch.Tensor | None,
                                 router: EDARouterWeights, w13: torch.Tensor, w2: torch.Tensor, norm: ResidualNorm,
                                 scaled_identity: bool):
    """x [T, H] (the normed MoE input) and x32, its fp32 copy; carry [T, R] fp32 (None in the first layer); w13
    [E, 2I, H], w2 [E, H, I] (16-bit); `norm` the residual norm taking the expert output;
    `scaled_identity`: skip tokens add skip_weight * x to it. Only where `takes`. -> (`norm`'s (x, h, h32), the
    Routing, whose carry goes to the next layer's router)."""
    if not takes(x, w13, w2, None):
        raise ValueError("the one-launch MoE step runs on CUDA, one rank, decode-sized steps (ops.zaya_moe.takes)")
    from hybridserve.ops.triton import zaya_moe as kernel
    return kernel.routed_experts_residual_norm(x, x32, carry, router, w13, w2, norm, scaled_identity)
