"""FP8 (e4m3) linear layers and routed experts in pure torch: the definition the Triton kernels are tested against.

W8A8, as the checkpoint formats prescribe (or weight-only, `weight_only=True`, the decode sizes' form: x is not
quantized, core/quant.py says when): the activation is quantized to e4m3 first (one scale per row,
`activation="token"`; per row and 128 columns, `"group"`; or the checkpoint's static scale, `"static"`), and the
product of the e4m3 values is taken exactly (fp32 here; fp32 accumulation in the kernels), then scaled by the
activation's and the weight's scales (per output row, or per 128x128 block). Scales are fp32. A dynamic scale is
amax / 448 (the largest e4m3 value), floored at SCALE_EPS so that an all-zero row gives zeros.

Weights at run time: `weight` [N, K] (experts [E, N, K]) float8_e4m3fn; `scale` per row [N] ([E, N]) or per block
[ceil(N/bn), ceil(K/bk)] ([E, ...]); `input_scale` a 0-d fp32 tensor for the static scheme, else None.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.core.quant import FP8_DTYPE, FP8_MAX, SCALE_EPS, Fp8Scheme, dequantize


def dynamic_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale of values whose largest magnitude is `amax`: amax / 448 correctly rounded, at least SCALE_EPS.
    The divisor is a tensor because torch on CUDA divides by a Python number as a multiply by its reciprocal,
    which rounds differently from the CPU's (and the kernels') true division for some amax."""
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_min(SCALE_EPS)


def quantize_activations(x: torch.Tensor, scheme: Fp8Scheme, input_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 values [T, K], scales): [T] per row ("token"), [T, ceil(K/g)] per group ("group"), or
    the 0-d static scale ("static"); x ~ values * scale."""
    x = x.float()
    if scheme.activation == "static":
        if input_scale is None:
            raise ValueError("the static FP8 activation scheme needs the checkpoint's input_scale")
        scale = input_scale.float().reshape(())
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    if scheme.activation == "token":
        scale = dynamic_scale(x.abs().amax(-1))
        return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    group = scheme.group
    tokens, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x, (0, groups * group - k)).view(tokens, groups, group)
    scale = dynamic_scale(padded.abs().amax(-1))
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(tokens, -1)[:, :k]
    return q.to(FP8_DTYPE), scale


def activation_values(q: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    """fp32 values of quantized activations [T, K] (`quantize_activations`' output)."""
    if scheme.activation == "static":
        return q.float() * scale
    if scheme.activation == "token":
        return q.float() * scale[:, None]
    return q.float() * scale.repeat_interleave(scheme.group, -1)[:, :q.shape[1]]


def fake_quantize(x: torch.Tensor, scheme: Fp8Scheme, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] rounded as the scheme quantizes it, in fp32."""
    return activation_values(*quantize_activations(x, scheme, input_scale), scheme)


def quantize_weight_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 16-bit weight [..., N, K] -> (e4m3 [..., N, K], one fp32 scale per row [..., N]): online quantization."""
    w = weight.float()
    scale = dynamic_scale(w.abs().amax(-1))
    return (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_weight(weight: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """A 16-bit weight [N, K] -> (e4m3, scales laid out as the scheme keeps them: per row, or per block)."""
    if scheme.weight != "block":
        return quantize_weight_rows(weight)
    (bn, bk), (n, k) = scheme.block, weight.shape
    nb, kb = -(-n // bn), -(-k // bk)
    tiles = F.pad(weight.float(), (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    scale = dynamic_scale(tiles.abs().amax((1, 3)))
    values = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:n, :k]
    return values.to(FP8_DTYPE), scale


def _activations(x: torch.Tensor, scheme: Fp8Scheme, input_scale: torch.Tensor | None, weight_only: bool
                 ) -> torch.Tensor:
    """x [T, K] in fp32 as the product sees it: as it is (weight-only) or rounded as the scheme quantizes it."""
    return x.float() if weight_only else fake_quantize(x, scheme, input_scale)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
               weight_only: bool = False) -> torch.Tensor:
    """x [..., K] @ dequantized(weight [N, K])^T (+ bias) with x quantized per `scheme` (`weight_only`: not
    quantized) -> [..., N] in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    out = _activations(flat, scheme, input_scale, weight_only) @ dequantize(weight, scale, scheme).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_fused_experts(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor, scheme: Fp8Scheme,
                      input_scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                      weight_only: bool = False) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows first) and w2 [E, H, I] e4m3 with their scales; topk_ids / weights
    [T, K] -> [T, H] in x's dtype. x is quantized once per token, the SwiGLU output (rounded to x's dtype, as
    the 16-bit path keeps it) per row before the down projection (`weight_only`: neither is); the weighted sum
    over the K choices is fp32, rounded once. `input_scales`: the static scheme's scales of the two projections
    (one per stack)."""
    xq = _activations(x, scheme, input_scales[0], weight_only)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        token, choice = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = (xq[token] @ dequantize(w13[expert], s13[expert], scheme).T).chunk(2, dim=-1)
        h = (F.silu(gate) * up).to(x.dtype)
        y = _activations(h, scheme, input_scales[1], weight_only) @ dequantize(w2[expert], s2[expert], scheme).T
        out.index_add_(0, token, y * topk_weights[token, choice, None].float())
    return out.to(x.dtype)
