"""ZAYA1's EDA router after its down-projection (router width 256, 16 experts + skip, fp32): decode 1 / 16 / 64 / 256
tokens, prefill 8192."""
from __future__ import annotations

import torch

from benchmarks.op_microbench import OpCase

WIDTH, CLASSES = 256, 17


def cases(device: torch.device) -> list[OpCase]:
    from hybridserve.ops.reference import zaya_router as reference
    from hybridserve.ops.triton import zaya_router as kernel

    out = []
    for tokens in (1, 16, 64, 256, 8192):
        f32 = dict(device=device, dtype=torch.float32)
        args = dict(z=torch.randn(tokens, WIDTH, **f32), carry=torch.randn(tokens, WIDTH, **f32),
                    states_scale=torch.rand(WIDTH, **f32), norm_weight=torch.rand(WIDTH, **f32) + 0.5, eps=1e-5,
                    fc1_weight=torch.randn(WIDTH, WIDTH, **f32) / 16, fc1_bias=torch.randn(WIDTH, **f32),
                    fc2_weight=torch.randn(WIDTH, WIDTH, **f32) / 16, fc2_bias=torch.randn(WIDTH, **f32),
                    out_weight=torch.randn(CLASSES, WIDTH, **f32) / 16, balancing_biases=torch.zeros(CLASSES, **f32))
        moved = tokens * WIDTH * 4 * 3 + (2 * WIDTH * WIDTH + CLASSES * WIDTH) * 4 + tokens * 8 * 5
        flops = 2 * tokens * WIDTH * (2 * WIDTH + CLASSES)
        out.append(OpCase("router", f"eda route T={tokens}", lambda a=args: kernel.eda_route(**a),
                          lambda a=args: reference.eda_route(**a), moved, flops))
    return out
