"""Ling-2.6-flash router cases (256 experts, 8 groups keep 4, top-8) from fp32 logits: the one-launch kernel vs
the torch reference. Minimum bytes: logits + bias read, ids (int64) and weights (fp32) written."""
from __future__ import annotations

from functools import partial

import torch

from benchmarks.ops._micro import OpCase
from hybridserve.ops.reference import router as reference

TOKENS = (1, 64, 256, 8192)
EXPERTS, N_GROUP, TOPK_GROUP, TOP_K, SCALE = 256, 8, 4, 8, 2.5


def cases(device: torch.device) -> list[OpCase]:
    from hybridserve.ops.triton import router as kernel
    bias = torch.randn(EXPERTS, device=device) * 0.1
    out = []
    for tokens in TOKENS:
        args = (torch.randn(tokens, EXPERTS, device=device), bias, N_GROUP, TOPK_GROUP, TOP_K, SCALE)
        out.append(OpCase("router", f"ling-2.6-flash T={tokens}", partial(kernel.grouped_topk, *args),
                          partial(reference.grouped_topk, *args),
                          bytes=tokens * EXPERTS * 4 + EXPERTS * 4 + tokens * TOP_K * (8 + 4)))
    return out
