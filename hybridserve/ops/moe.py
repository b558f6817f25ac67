"""Routed SwiGLU experts: each token's weighted sum over its chosen experts.

FP8 experts (`fp8` given: the gate_up and down stacks' scales) run as `ops.reference.fp8.fp8_fused_experts`
defines (backend op "fp8_moe"): weight-only up to `core.quant.WEIGHT_ONLY_MAX_PAIRS` (token, choice) pairs, W8A8
beyond. On CUDA `ops.triton.fp8_moe` (the weight-only GEMV form, its residual-norm epilogue included, then the
grouped W8A8 form), elsewhere that reference.
"""
from __future__ import annotations

import torch

from hybridserve.core.quant import WEIGHT_ONLY_MAX_PAIRS, Fp8Scales, experts_weight_only
from hybridserve.ops import backends
from hybridserve.ops.norm import ResidualNorm
from hybridserve.ops.reference import fp8 as fp8_reference
from hybridserve.ops.reference import moe as reference
from hybridserve.ops.reference.zaya_router import DeferredSelection

ExpertScales = tuple[Fp8Scales, Fp8Scales]  # (gate_up's, down's)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, reduce: bool = True, fp8: ExpertScales | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows first); w2 [E, H, I]; topk_ids/weights [T, K] -> [T, H] in x's dtype.

    `reduce=False`: [T, P, H] rows whose sum over P (in fp32, rounded once) is that output, for a consumer that
    sums them on its way (ops.ling_norm.add_rms_norm): the kernel's K weighted rows per token, the reference's sum
    as P = 1.

    On CUDA up to `ops.triton.moe_gemv.MAX_PAIRS` (token, choice) pairs (decode) take the GEMV form, more the
    grouped-GEMM form (`ops.triton.moe`); the switch depends on host-known sizes only."""
    if fp8 is not None:
        return _fp8_experts(x, w13, w2, topk_ids, topk_weights, reduce, fp8)
    if backends.use_triton("moe", x.device):
        from hybridserve.ops.triton import moe_gemv
        if moe_gemv.takes(x, w13, w2, topk_ids):
            return moe_gemv.fused_experts(x, w13, w2, topk_ids, topk_weights, reduce=reduce)
        from hybridserve.ops.triton import moe as kernel
        return kernel.fused_experts(x, w13, w2, topk_ids, topk_weights, reduce=reduce)
    out = reference.fused_experts(x, w13, w2, topk_ids, topk_weights)
    return out if reduce else out[:, None]


def _fp8_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, reduce: bool, fp8: ExpertScales) -> torch.Tensor:
    gate_up, down = fp8
    input_scales = (gate_up.input_scale, down.input_scale)
    if backends.use_triton("fp8_moe", x.device):
        from hybridserve.ops.triton import fp8_moe
        return fp8_moe.fused_experts(x, w13, gate_up.scale, w2, down.scale, topk_ids, topk_weights, gate_up.scheme,
                                     input_scales, reduce=reduce)
    out = fp8_reference.fp8_fused_experts(x, w13, gate_up.scale, w2, down.scale, topk_ids, topk_weights,
                                          gate_up.scheme, input_scales, experts_weight_only(topk_ids))
    return out if reduce else out[:, None]


def fused_experts_residual_norm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                                topk_weights: torch.Tensor, norm: ResidualNorm, fp8: ExpertScales | None = None,
                                selection: DeferredSelection | None = None):
    """`norm`(fused_experts(...)): in the GEMV form's down launch where that form runs. -> `norm`'s (x, h, h32); h
    an `ops.norm.PendingNorm` (h32 None) where `norm.h_pending` and that form runs.
    `selection`: ZAYA1's routing with its class selection deferred to these launches (`Routing.selection`; they
    then write topk_ids and topk_weights): only where `takes_deferred_selection`."""
    if _gemv_backend(x.device, topk_ids.numel(), fp8):
        from hybridserve.ops.triton import moe_gemv
        if moe_gemv.takes(x, w13, w2, topk_ids):
            return moe_gemv.fused_experts(x, w13, w2, topk_ids, topk_weights, norm=norm, fp8=fp8,
                                          selection=selection)
    if selection is not None:
        raise ValueError("fused_experts_residual_norm: a deferred selection needs the GEMV experts "
                         "(takes_deferred_selection)")
    return norm(fused_experts(x, w13, w2, topk_ids, topk_weights, fp8=fp8))


def takes_deferred_selection(tokens: int, device: torch.device, fp8: ExpertScales | None = None) -> bool:
    """Whether `fused_experts_residual_norm` of `tokens` tokens with one choice each (contiguous stacks, x rows of
    unit column stride) runs the GEMV form, which takes a deferred selection. Host-known sizes only."""
    if not _gemv_backend(device, tokens, fp8):
        return False
    from hybridserve.ops.triton import moe_gemv
    return 0 < tokens <= moe_gemv.MAX_PAIRS


def _gemv_backend(device: torch.device, pairs: int, fp8: ExpertScales | None) -> bool:
    """Whether the experts' Triton backend runs here, at weight-only sizes for FP8 experts."""
    return backends.use_triton("moe" if fp8 is None else "fp8_moe", device) and (
        fp8 is None or pairs <= WEIGHT_ONLY_MAX_PAIRS)
