"""ZAYA1's QKNorm + partial RoPE + KV-cache write (8 q / 2 kv heads x 128, rotary 64; fp32 q|k from the conv,
bf16 cache): decode 1 / 64 / 256 tokens, prefill 8192."""
from __future__ import annotations

import torch

from benchmarks.op_microbench import OpCase

Q_HEADS, K_HEADS, HEAD_DIM = 8, 2, 128


def cases(device: torch.device) -> list[OpCase]:
    from hybridserve.ops.reference import zaya_qk as reference
    from hybridserve.ops.triton import zaya_qk as kernel

    out = []
    for tokens in (1, 64, 256, 8192):
        qk = torch.randn(tokens, Q_HEADS + K_HEADS, HEAD_DIM, device=device)
        caches = [torch.zeros(tokens + 16, K_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(2)]
        args = (qk[:, :Q_HEADS], qk[:, Q_HEADS:],
                torch.randn(tokens, K_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16),
                torch.rand(K_HEADS, device=device, dtype=torch.bfloat16),
                1.0 / 5e6 ** (torch.arange(0, 64, 2, device=device) / 64),
                torch.randint(0, 100000, (tokens,), device=device), torch.randperm(tokens + 16, device=device)[:tokens],
                *caches, torch.bfloat16)
        moved = tokens * HEAD_DIM * ((Q_HEADS + K_HEADS) * 4 + K_HEADS * 2 + Q_HEADS * 2 + 2 * K_HEADS * 2)
        out.append(OpCase("zaya_qk", f"qknorm+rope+kv T={tokens}", lambda a=args: kernel.qk_norm_rope_cache(*a),
                          lambda a=args: reference.qk_norm_rope_cache(*a), moved))
    return out
