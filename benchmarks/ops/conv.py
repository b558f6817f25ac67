"""CCA conv + value lag at ZAYA1-8B widths (conv channels 1280, D 128, lag 128, bf16): decode B = 1, 64, 256
(every row resumed from its slot) and one fresh 8192-token prefill, page footers on (page 16)."""
from __future__ import annotations

import torch

from benchmarks.op_microbench import OpCase
from hybridserve.core.batch import ScheduledChunk, build_forward_batch

Q_HEADS, K_HEADS, HEAD_DIM, PAGE = 8, 2, 128, 16
CHANNELS, LAG = (Q_HEADS + K_HEADS) * HEAD_DIM, K_HEADS * HEAD_DIM // 2


def _case(name: str, chunks: list[ScheduledChunk], device: torch.device) -> OpCase:
    from hybridserve.ops.reference import conv as reference
    from hybridserve.ops.triton import conv as kernel

    batch = build_forward_batch(chunks, PAGE, device, history_len=2)
    tokens, rows = batch.input_ids.numel(), len(chunks)
    pages = max(p for c in chunks for p in c.page_ids) + 1
    bf16 = dict(device=device, dtype=torch.bfloat16)
    proj = torch.randn(tokens, CHANNELS + 2 * LAG, **bf16)
    weights = (torch.randn(CHANNELS, 1, 2, **bf16), torch.randn(CHANNELS, **bf16),
               torch.randn(CHANNELS, HEAD_DIM, 2, **bf16) / HEAD_DIM ** 0.5, torch.randn(CHANNELS, **bf16))
    state = (torch.randn(rows + 1, CHANNELS, 2, **bf16), torch.randn(rows + 1, LAG, **bf16))
    footers = (torch.zeros(pages, CHANNELS, 2, **bf16), torch.zeros(pages, LAG, **bf16))
    args = (proj, *weights, None, Q_HEADS, 0, batch, *state, *footers)
    footer_bytes = batch.page_end_tokens.numel() * (CHANNELS * 2 + LAG) * 2
    moved = (proj.numel() * 2 + tokens * CHANNELS * 4 + tokens * K_HEADS * HEAD_DIM * 2  # in, q|k fp32, v
             + 2 * rows * (CHANNELS * 2 + LAG) * 2 + CHANNELS * (HEAD_DIM * 2 + 4) * 2 + footer_bytes)
    return OpCase("conv", name, lambda: kernel.cca_conv(*args), lambda: reference.cca_conv(*args), moved,
                  flops=2 * tokens * CHANNELS * HEAD_DIM * 2)


def cases(device: torch.device) -> list[OpCase]:
    out = []
    for rows in (1, 64, 256):
        chunks = [ScheduledChunk([1], 100 + r % 27, list(range(1 + 8 * r, 9 + 8 * r)), r + 1, True, [0])
                  for r in range(rows)]
        out.append(_case(f"decode B={rows}", chunks, device))
    tokens = 8192
    out.append(_case(f"prefill {tokens} fresh",
                     [ScheduledChunk([1] * tokens, 0, list(range(1, tokens // PAGE + 1)), 1, False, [0])], device))
    return out
