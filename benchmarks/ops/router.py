"""Ling-2.6-flash router cases (256 experts, 8 groups keep 4, top-8), each kernel against the torch reference:
- from fp32 logits, the selection kernel (`grouped_topk`); minimum bytes: logits + bias read, ids (int64) and
  weights (fp32) written;
- at decode sizes, from the norm's fp32 copy of x (hidden 4096): the logits GEMV and the selection in one launch
  (`route`) beside the pair it replaces (cuBLAS's fp32 GEMM, then the selection launch), each timed as a decode
  step's worth of calls: 31 MoE layers with their own 4 MB weights, replayed from a CUDA graph (launched one by one
  from Python, a call this small measures the host). Minimum bytes: the weights, x, and the outputs."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.ops._micro import OpCase, graphed
from hybridserve.ops.reference import router as reference

TOKENS = (1, 64, 256, 8192)
DECODE_TOKENS = (1, 4, 16)
EXPERTS, N_GROUP, TOPK_GROUP, TOP_K, SCALE = 256, 8, 4, 8, 2.5
HIDDEN, LAYERS = 4096, 31  # Ling-2.6-flash's hidden size and MoE layers (32 layers, the first one dense)


def _decode_step(route, x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor):
    return graphed([partial(route, x, weight, bias, N_GROUP, TOPK_GROUP, TOP_K, SCALE) for weight in weights])


def cases(device: torch.device) -> list[OpCase]:
    from hybridserve.ops.triton import router as kernel
    bias = torch.randn(EXPERTS, device=device) * 0.1
    out = []
    for tokens in TOKENS:
        args = (torch.randn(tokens, EXPERTS, device=device), bias, N_GROUP, TOPK_GROUP, TOP_K, SCALE)
        out.append(OpCase("router", f"ling-2.6-flash T={tokens}", partial(kernel.grouped_topk, *args),
                          partial(reference.grouped_topk, *args),
                          bytes=tokens * EXPERTS * 4 + EXPERTS * 4 + tokens * TOP_K * (8 + 4)))

    def torch_pair(x, weight, *args):
        return reference.grouped_topk(F.linear(x, weight), *args)

    def cublas_and_selection(x, weight, *args):
        return kernel.grouped_topk(F.linear(x, weight), *args)

    weights = [torch.randn(EXPERTS, HIDDEN, device=device) / 64 for _ in range(LAYERS)]
    for tokens in DECODE_TOKENS:
        x = torch.randn(tokens, HIDDEN, device=device)
        moved = LAYERS * (EXPERTS * HIDDEN * 4 + tokens * HIDDEN * 4 + tokens * TOP_K * (8 + 4))
        flops = LAYERS * 2 * tokens * EXPERTS * HIDDEN
        for label, route in (("one launch", kernel.route), ("cuBLAS GEMM + selection", cublas_and_selection)):
            out.append(OpCase("router", f"ling-2.6-flash x@W + select T={tokens}, {LAYERS} layers: {label}",
                              _decode_step(route, x, weights, bias), _decode_step(torch_pair, x, weights, bias),
                              bytes=moved, flops=flops))
    return out
