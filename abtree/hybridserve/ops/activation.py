"""SwiGLU's activation, SiLU(gate) * up, over a fused gate|up projection output in one pass (Ling's dense FFN and
shared expert). Backend op "activation"."""
from __future__ import annotations

import torch

from hybridserve.ops import backends
from hybridserve.ops.reference import activation as reference


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] (rows may be strided) -> SiLU(gate) * up [T, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs [T, 2I] = [gate | up]; got {tuple(x.shape)}")
    if backends.use_triton("activation", x.device):
        from hybridserve.ops.triton import activation as kernel
        return kernel.silu_and_mul(x)
    return reference.silu_and_mul(x)
