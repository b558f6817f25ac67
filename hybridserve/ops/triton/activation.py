"""SiLU(gate) * up in Triton, one program per (row, column block); the roundings of ops/reference/activation.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.pdl import wait_for_previous
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < width
    gate = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + col, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # rounded as F.silu's output is
    tl.store(out_ptr + row * stride_o + col, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul needs unit column stride; got strides {x.stride()}")
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, device=x.device, dtype=x.dtype)
    if rows:
        block = min(_BLOCK, next_power_of_2(width))
        _silu_and_mul_kernel[(rows, cdiv(width, block))](x, out, width, x.stride(0), out.stride(0),
                                                         BLOCK=block, num_warps=max(1, min(4, block // 256)),
                                                         **pdl.launch(x.device))
    return out
