"""Ling's RMS-norm fusions at Ling-2.6-flash widths (hidden 4096, 32 heads x 128, 4 norm groups), bf16 model dtype,
decode batch 1, 64, 256 and an 8192-token prefill: residual add + RMSNorm, QK RMSNorm + partial RoPE on the q/k
heads of the Q|K|V|G projection output, GroupRMSNorm of the fp32 lightning output times sigmoid(gate).

Bytes: every input read once and every output written once (no FLOP floor: these are bandwidth-bound).
"""
from __future__ import annotations

import torch

from benchmarks.op_microbench import OpCase
from hybridserve.ops.reference import ling_norm as reference
from hybridserve.ops.triton import ling_norm as kernel

HIDDEN, HEADS, DIM, GROUPS, EPS = 4096, 32, 128, 4, 1e-6


def _cases(tokens: int, label: str, device: torch.device) -> list[OpCase]:
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    x, residual, weight = randn(tokens, HIDDEN), randn(tokens, HIDDEN), randn(HIDDEN)
    qkvg = randn(tokens, 4, HEADS, DIM)
    qk, gate = qkvg[:, :2], qkvg[:, 3].flatten(1)
    q_weight, k_weight = randn(DIM), randn(DIM)
    positions = torch.arange(tokens, device=device) + 1000
    inv_freq = 1.0 / (6e6 ** (torch.arange(0, DIM // 2, 2, device=device, dtype=torch.float32) / (DIM // 2)))
    lightning_out = randn(tokens, HIDDEN, dtype=torch.float32)
    return [
        OpCase("ling_norm", f"add_rms_norm {label}", lambda: kernel.add_rms_norm(x, residual, weight, EPS),
               lambda: reference.add_rms_norm(x, residual, weight, EPS), bytes=tokens * HIDDEN * 2 * 4),
        OpCase("ling_norm", f"qk_norm_rope {label}",
               lambda: kernel.qk_norm_rope(qk, q_weight, k_weight, positions, inv_freq, EPS),
               lambda: reference.qk_norm_rope(qk, q_weight, k_weight, positions, inv_freq, EPS),
               bytes=tokens * 2 * HEADS * DIM * 2 * 2),
        OpCase("ling_norm", f"gated group_rms_norm {label}",
               lambda: kernel.group_rms_norm(lightning_out, weight, GROUPS, EPS, gate),
               lambda: reference.group_rms_norm(lightning_out, weight, GROUPS, EPS, gate),
               bytes=tokens * HIDDEN * (4 + 2 + 2)),
    ]


def cases(device: torch.device) -> list[OpCase]:
    return [case for tokens, label in ((1, "B=1"), (64, "B=64"), (256, "B=256"), (8192, "T=8192"))
            for case in _cases(tokens, label, device)]
