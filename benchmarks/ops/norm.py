"""ZAYA1's post-MLP residual update fused with the next RMSNorm (ResidualScaling + MOD skip term + norm) at hidden
2048: bf16 update and skip input, fp32 residual in and out, bf16 normed row; decode 1 / 64 / 256 rows, prefill 8192."""
from __future__ import annotations

import torch

from benchmarks.ops._micro import OpCase

HIDDEN = 2048


def cases(device: torch.device) -> list[OpCase]:
    from hybridserve.ops.reference import norm as reference
    from hybridserve.ops.triton import norm as kernel

    out = []
    for tokens in (1, 64, 256, 8192):
        bf16 = dict(device=device, dtype=torch.bfloat16)
        vectors = [torch.rand(HIDDEN, **bf16) + 0.5 for _ in range(5)]
        args = dict(update=torch.randn(tokens, HIDDEN, **bf16), norm_weight=vectors[4], eps=1e-5,
                    residual=torch.randn(tokens, HIDDEN, device=device), update_bias=vectors[0],
                    update_scale=vectors[1], residual_bias=vectors[2], residual_scale=vectors[3],
                    skip_weight=torch.rand(tokens, 1, device=device), skip_input=torch.randn(tokens, HIDDEN, **bf16))
        moved = tokens * HIDDEN * (2 + 4 + 2 + 4 + 2) + 5 * HIDDEN * 2
        out.append(OpCase("norm", f"residual+norm T={tokens}", lambda a=args: kernel.residual_rms_norm(**a),
                          lambda a=args: reference.residual_rms_norm(**a), moved))
    return out
