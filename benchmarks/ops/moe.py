"""Fused-MoE cases at ZAYA1-8B (16 experts, top-1) and Ling-2.6-flash (256 experts, top-8) shapes, bf16, uniform
random routing. Minimum bytes: the weights of the experts actually chosen + x + the output; FLOPs: 2*T*K*3*I*H.
The reference is the torch path the kernel replaces on GPU (gathered below E pairs, dense above)."""
from __future__ import annotations

from functools import partial

import torch

from benchmarks.op_microbench import OpCase
from hybridserve.ops.reference import moe as reference

TOKENS = (1, 16, 64, 256, 8192)
SHAPES = {"zaya1-8b": (16, 1, 2048, 2048), "ling-2.6-flash": (256, 8, 4096, 1024)}  # E, K, H, I


def routing(tokens: int, experts: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct uniformly random experts per token, fp32 weights."""
    ids = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
    return ids, torch.rand(tokens, top_k, device=device)


def cases(device: torch.device) -> list[OpCase]:
    from hybridserve.ops.triton import moe as kernel
    out = []
    for name, (experts, top_k, hidden, inter) in SHAPES.items():
        w13 = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).bfloat16()
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device=device).bfloat16()
            ids, weights = routing(tokens, experts, top_k, device)
            touched = ids.unique().numel()
            args = (x, w13, w2, ids, weights)
            out.append(OpCase("moe", f"{name} T={tokens}", partial(kernel.fused_experts, *args),
                              partial(reference.fused_experts, *args),
                              bytes=touched * 3 * inter * hidden * 2 + 2 * tokens * hidden * 2,
                              flops=2 * tokens * top_k * 3 * inter * hidden))
    return out
