"""Lightning attention cases at Ling-2.6-flash widths (32 heads x 128, fp32 state [H, 128, 128] per row): decode at
batch 1, 64, 256 (every row restored from its slot), and 8192-token prefills (one fresh row; 8 fresh rows of 1024),
bf16 q/k/v. The 1-row prefill also runs with the "tf32" and "ieee" dot precisions, to price the default tf32x3,
and a few launch configurations other than the defaults (v-block, warps) are timed to check the choice.

Bytes: states read (restored rows) and written, fp32, B * H * d * d * 4 each way, plus q/k/v (bf16) and o (fp32).
FLOPs of the chunked form (chunk C = 64): per token and head 4 * C * d (q k^T and scores @ v, full chunk tiles)
+ 4 * d * d (q S and the state update); decode 4 * d * d per row and head.
"""
from __future__ import annotations

import functools

import torch

from benchmarks.ops._micro import OpCase
from hybridserve.core.batch import ScheduledChunk, build_forward_batch
from hybridserve.ops.reference import lightning as reference
from hybridserve.ops.triton import lightning as kernel

HEADS, DIM, PAGE = 32, 128, 16


def _case(name: str, lengths: list[int], restored: bool, device: torch.device,
          launch=kernel.lightning_attention) -> OpCase:
    prefix = 100 if restored else 0
    chunks = [ScheduledChunk([0] * n, prefix, list(range(1, 2 + (prefix + n) // PAGE)), slot, restored)
              for slot, n in enumerate(lengths, start=1)]
    batch = build_forward_batch(chunks, PAGE, device)
    tokens, rows = sum(lengths), len(lengths)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(tokens, HEADS, DIM, device=device, generator=gen).bfloat16() for _ in range(3))
    log_decay = -torch.linspace(0.004, 0.84, HEADS, device=device)
    pool = 0.05 * torch.randn(rows + 1, HEADS, DIM, DIM, device=device, generator=gen)
    state_bytes = rows * HEADS * DIM * DIM * 4 * (2 if restored else 1)
    chunk = 1 if batch.is_decode else kernel.CHUNK
    return OpCase(
        op="lightning", name=name,
        kernel=lambda: launch(q, k, v, log_decay, pool, batch),
        reference=lambda: reference.lightning_attention(q, k, v, log_decay, pool, batch),
        bytes=state_bytes + tokens * HEADS * DIM * (3 * 2 + 4),
        flops=tokens * HEADS * (4 * chunk * DIM * (chunk > 1) + 4 * DIM * DIM),
    )


def cases(device: torch.device) -> list[OpCase]:
    out = [_case(f"decode B={b}", [1] * b, True, device) for b in (1, 64, 256)]
    out.append(_case("prefill 1x8192", [8192], False, device))
    out.append(_case("prefill 8x1024", [1024] * 8, False, device))
    for precision in ("tf32", "ieee"):
        out.append(_case(f"prefill 1x8192 {precision}", [8192], False, device,
                         functools.partial(kernel.lightning_prefill, precision=precision)))
    for lengths, label in (([8192], "1x8192"), ([1024] * 8, "8x1024")):
        out.append(_case(f"prefill {label} BV=32 warps=4", lengths, False, device,
                         functools.partial(kernel.lightning_prefill, block_v=32, num_warps=4)))
    for b, block_v in ((1, 16), (256, 64)):
        out.append(_case(f"decode B={b} BV={block_v}", [1] * b, True, device,
                         functools.partial(kernel.lightning_decode, block_v=block_v)))
    return out
