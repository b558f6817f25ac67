"""CCA conv + value lag at ZAYA1-8B widths (conv channels 1280, D 128, lag 128, bf16), page footers on (page 16).

Decode steps of B = 1, 8, 64 and 256 one-token rows (every row resumed from its slot) run in both of the kernel's
forms (heads: a tl.dot per head; columns: each head's output columns split over ~128 programs), the two sides of
COLUMNS_MAX_TOKENS, each timed as one decode step's worth of calls: 40 layers, each with its own weights and state,
replayed from a CUDA graph (launched one by one from Python, a call this small times the host); the reference is
graphed alike. One fresh 8192-token prefill (the heads form) is timed eagerly, at the default token block and at
larger ones (in a prefill chunk of the 40-layer model the conv took 11 of 56 ms, ~15x its bytes' floor)."""
from __future__ import annotations

import torch

from benchmarks.ops._micro import OpCase, graphed
from hybridserve.core.batch import ScheduledChunk, build_forward_batch

Q_HEADS, K_HEADS, HEAD_DIM, PAGE = 8, 2, 128, 16
CHANNELS, LAG = (Q_HEADS + K_HEADS) * HEAD_DIM, K_HEADS * HEAD_DIM // 2
LAYERS = 40  # ZAYA1-8B's layers: a decode step's conv calls


def _layer(batch, rows: int, pages: int, device: torch.device) -> tuple:
    """One layer's cca_conv arguments after `batch`: projection, weights, state (rows + 1 slots), footers."""
    bf16 = dict(device=device, dtype=torch.bfloat16)
    proj = torch.randn(batch.input_ids.numel(), CHANNELS + 2 * LAG, **bf16)
    weights = (torch.randn(CHANNELS, 1, 2, **bf16), torch.randn(CHANNELS, **bf16),
               torch.randn(CHANNELS, HEAD_DIM, 2, **bf16) / HEAD_DIM ** 0.5, torch.randn(CHANNELS, **bf16))
    state = (torch.randn(rows + 1, CHANNELS, 2, **bf16), torch.randn(rows + 1, LAG, **bf16))
    footers = (torch.zeros(pages, CHANNELS, 2, **bf16), torch.zeros(pages, LAG, **bf16))
    return (proj, *weights, None, Q_HEADS, 0, batch, *state, *footers)


def _bytes(tokens: int, rows: int, footers: int) -> int:
    """Fewest bytes one call moves: proj in, q|k (fp32) and v out, state read and written, weights, footers."""
    state = CHANNELS * 2 + LAG  # one slot's (or page footer's) conv window and lag
    return (tokens * (CHANNELS + 2 * LAG) * 2 + tokens * CHANNELS * 4 + tokens * K_HEADS * HEAD_DIM * 2
            + (2 * rows + footers) * state * 2 + CHANNELS * (HEAD_DIM * 2 + 4) * 2)


def cases(device: torch.device) -> list[OpCase]:
    from hybridserve.ops.reference import conv as reference
    from hybridserve.ops.triton import conv as kernel

    out = []
    for rows in (1, 8, 64, 256):
        chunks = [ScheduledChunk([1], 100 + r % 27, list(range(1 + 8 * r, 9 + 8 * r)), r + 1, True, [0])
                  for r in range(rows)]
        batch = build_forward_batch(chunks, PAGE, device, history_len=2)  # history: the reference's layout
        layers = [_layer(batch, rows, 8 * rows + 1, device) for _ in range(LAYERS)]
        moved = LAYERS * _bytes(rows, rows, batch.page_end_tokens.numel())
        flops = LAYERS * 2 * rows * CHANNELS * HEAD_DIM * 2
        ref = graphed([lambda a=a: reference.cca_conv(*a) for a in layers])
        for form in ("heads", "columns"):
            out.append(OpCase("conv", f"decode B={rows} {form} form x{LAYERS} graph",
                              graphed([lambda a=a, f=form: kernel.cca_conv(*a, form=f) for a in layers]), ref,
                              moved, flops))
    tokens = 8192
    batch = build_forward_batch([ScheduledChunk([1] * tokens, 0, list(range(1, tokens // PAGE + 1)), 1, False, [0])],
                                PAGE, device, history_len=2)
    args = _layer(batch, 1, tokens // PAGE + 1, device)
    for block in (None, 64, 128):
        out.append(OpCase("conv", f"prefill {tokens} fresh" + (f" BLOCK_T={block}" if block else ""),
                          lambda b=block: kernel.cca_conv(*args, block_tokens=b), lambda: reference.cca_conv(*args),
                          _bytes(tokens, 1, batch.page_end_tokens.numel()), flops=2 * tokens * CHANNELS * HEAD_DIM * 2))
    return out
