"""Fused-MoE cases at ZAYA1-8B (16 experts, top-1) and Ling-2.6-flash (256 experts, top-8) shapes, bf16, uniform
random routing. Minimum bytes: the weights of the experts actually chosen + x + the output; FLOPs: 2*T*K*3*I*H.
The reference is the torch path the kernel replaces on GPU (gathered below E pairs, dense above).

Decode forms ("gemv vs grouped"): the few-pair GEMV form (ops.triton.moe_gemv) as the kernel and the grouped-GEMM
form (ops.triton.moe) as the reference, at the decode sizes around ops.triton.moe_gemv.MAX_PAIRS, each one CUDA
graph of `DECODE_CALLS` calls with their own routing (as a step's layers: one call's experts would stay in L2;
at one ZAYA1 token the calls take the 16 experts in turn). The "vs ref" column is grouped time over GEMV time: the
lead moves MAX_PAIRS to where it drops below 1."""
from __future__ import annotations

from functools import partial

import torch

from benchmarks.ops._micro import OpCase, graphed
from hybridserve.ops.reference import moe as reference

TOKENS = (1, 16, 64, 256, 8192)
SHAPES = {"zaya1-8b": (16, 1, 2048, 2048), "ling-2.6-flash": (256, 8, 4096, 1024)}  # E, K, H, I
DECODE_TOKENS = {"zaya1-8b": (1, 2, 4, 8, 16), "ling-2.6-flash": (1, 2, 4)}
DECODE_CALLS = 16


def routing(tokens: int, experts: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct uniformly random experts per token, fp32 weights."""
    ids = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
    return ids, torch.rand(tokens, top_k, device=device)


def decode_cases(name: str, w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> list[OpCase]:
    """GEMV form vs grouped form at decode sizes, each a CUDA graph of DECODE_CALLS differently routed calls,
    unreduced (as Ling's layers call it on one rank; the same as reduced at top-1)."""
    from hybridserve.ops.triton import moe as grouped
    from hybridserve.ops.triton import moe_gemv as gemv
    experts, hidden, inter = w13.shape[0], w13.shape[2], w2.shape[2]
    out = []
    for tokens in DECODE_TOKENS[name]:
        calls, touched = [], 0  # (x, w13, w2, ids, weights) of each call; experts read over all calls
        for call in range(DECODE_CALLS):
            ids, weights = routing(tokens, experts, top_k, w13.device)
            if tokens * top_k == 1:
                ids.fill_(call % experts)
            calls.append((torch.randn(tokens, hidden, device=w13.device).bfloat16(), w13, w2, ids, weights))
            touched += ids.unique().numel()
        out.append(OpCase(
            "moe", f"{name} T={tokens} gemv vs grouped x{DECODE_CALLS} graph",
            graphed([partial(gemv.fused_experts, *call, reduce=False) for call in calls]),
            graphed([partial(grouped.fused_experts, *call, reduce=False) for call in calls]),
            bytes=touched * 3 * inter * hidden * 2 + DECODE_CALLS * 2 * tokens * hidden * 2,
            flops=DECODE_CALLS * 2 * tokens * top_k * 3 * inter * hidden))
    return out


def cases(device: torch.device) -> list[OpCase]:
    from hybridserve.ops.triton import moe as kernel
    out = []
    for name, (experts, top_k, hidden, inter) in SHAPES.items():
        w13 = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).bfloat16()
        out += decode_cases(name, w13, w2, top_k)
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
