"""ZAYA1's EDA router, down-projection included (hidden 2048, router width 256, 16 experts + skip, fp32).

Decode sizes (1 / 16 / 64 / 256 tokens, the fused form) are timed as one decode step's worth of calls, 40 layers
each with its own weights (together 92 MB: they do not all stay in L2, as in the model), replayed from a CUDA graph,
kernel and reference alike: launched one by one from Python, a call this small measures the host. Prefill 2048
and 8192 tokens (the 3xTF32 GEMM form; the reference runs cuBLAS fp32 GEMMs) are timed eagerly. Both forms also run
at 256 and 512 tokens, the two sides of the switch FUSED_MAX_TOKENS, to check it."""
from __future__ import annotations

import torch

from benchmarks.ops._micro import OpCase, graphed

HIDDEN, WIDTH, CLASSES = 2048, 256, 17
LAYERS = 40  # ZAYA1-8B's layers: a decode step's router calls


def _inputs(tokens: int, device: torch.device) -> dict:
    f32 = dict(device=device, dtype=torch.float32)
    return dict(x32=torch.randn(tokens, HIDDEN, **f32), down_weight=torch.randn(WIDTH, HIDDEN, **f32) / 45,
                down_bias=torch.randn(WIDTH, **f32) / 10, carry=torch.randn(tokens, WIDTH, **f32),
                states_scale=torch.rand(WIDTH, **f32), norm_weight=torch.rand(WIDTH, **f32) + 0.5, eps=1e-5,
                fc1_weight=torch.randn(WIDTH, WIDTH, **f32) / 16, fc1_bias=torch.randn(WIDTH, **f32),
                fc2_weight=torch.randn(WIDTH, WIDTH, **f32) / 16, fc2_bias=torch.randn(WIDTH, **f32),
                out_weight=torch.randn(CLASSES, WIDTH, **f32) / 16, balancing_biases=torch.zeros(CLASSES, **f32))


def cases(device: torch.device) -> list[OpCase]:
    from hybridserve.ops.reference import zaya_router as reference
    from hybridserve.ops.triton import zaya_router as kernel

    forms = [(tokens, "", kernel.eda_route) for tokens in (1, 16, 64, 256)]
    forms += [(256, " GEMM form", kernel.gemm_route), (512, " fused form", kernel.fused_route),
              (512, " GEMM form", kernel.gemm_route), (2048, "", kernel.eda_route), (8192, "", kernel.eda_route)]
    weights = WIDTH * HIDDEN + WIDTH + 2 * (WIDTH * WIDTH + WIDTH) + 2 * WIDTH + CLASSES * (WIDTH + 1)
    out = []
    for tokens, label, route in forms:
        activations = tokens * (HIDDEN + 2 * WIDTH)  # x32 and the carry in, the new carry out
        moved = 4 * (weights + activations) + tokens * 8 * 5  # + the five [T] routing outputs
        flops = 2 * tokens * WIDTH * (HIDDEN + 2 * WIDTH + CLASSES)
        if tokens > 512:
            args = _inputs(tokens, device)
            out.append(OpCase("router", f"eda route T={tokens}{label}", lambda a=args, f=route: f(**a),
                              lambda a=args: reference.eda_route(**a), moved, flops))
            continue
        layers = [_inputs(tokens, device) for _ in range(LAYERS)]
        out.append(OpCase("router", f"eda route T={tokens}{label} x{LAYERS} graph",
                          graphed([lambda a=a, f=route: f(**a) for a in layers]),
                          graphed([lambda a=a: reference.eda_route(**a) for a in layers]), LAYERS * moved,
                          LAYERS * flops))
    return out
