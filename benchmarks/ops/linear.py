"""Dense linear layers at decode sizes (1..16 tokens, bf16): the GEMV kernel (ops.triton.linear) vs cuBLAS through
F.linear, at the projections of ZAYA1-8B and Ling-2.6-flash that run every layer.

Each case is one CUDA graph of calls over enough weight copies (each call its own) that together they far exceed
the H200's 50 MB L2, as a decode step's layers do: a single small weight would be timed from L2. Minimum bytes: the
weights once each call plus x and the output. The "vs ref" column is cuBLAS's time over the kernel's:
ops.triton.linear.FASTER_UP_TO_TOKENS / FASTER_UP_TO_WEIGHT_BYTES sit where it drops below 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.ops._micro import OpCase, graphed

TOKENS = (1, 2, 4, 8, 16)
SHAPES = {  # name: (K, N)
    "zaya1 q|k|v|v": (2048, 1536), "zaya1 o_proj": (1024, 2048),
    "ling Q|K|V|G": (4096, 16384), "ling dense": (4096, 4096), "ling MLA q_a|kv_a": (4096, 2112),
    "ling MLA q_b": (1536, 6144), "ling shared gate|up": (4096, 2048), "ling shared down": (1024, 4096),
}
STREAMED_BYTES = 256 * 2**20  # weight copies per graph: at least this much, about 5x the L2
MAX_COPIES = 40


def cases(device: torch.device) -> list[OpCase]:
    from hybridserve.ops.triton import linear as kernel
    out = []
    for name, (k, n) in SHAPES.items():
        copies = min(MAX_COPIES, max(2, -(-STREAMED_BYTES // (2 * n * k))))
        weights = [(torch.randn(n, k, device=device) / k**0.5).bfloat16() for _ in range(copies)]
        for tokens in TOKENS:
            x = torch.randn(tokens, k, device=device).bfloat16()
            gemv = graphed([lambda w=w, x=x: kernel.linear(x, w) for w in weights])
            cublas = graphed([lambda w=w, x=x: F.linear(x, w) for w in weights])
            out.append(OpCase("linear", f"{name} T={tokens} x{copies} graph", gemv, cublas,
                              bytes=copies * 2 * (n * k + tokens * (n + k)), flops=copies * 2 * tokens * n * k))
    return out
