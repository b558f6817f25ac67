"""SiLU(gate) * up in pure torch (the CPU path and the oracle of ops/triton/activation.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> SiLU(gate) * up [T, I]: SiLU computed in fp32 and rounded to x's dtype, then the
    product rounded again (torch's two ops)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
