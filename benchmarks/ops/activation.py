"""SiLU(gate) * up at Ling-2.6-flash widths, bf16: the dense FFN (intermediate 9216) and the shared expert (1024),
decode batch 1, 64, 256 and an 8192-token prefill. Bytes: gate|up read once, the product written once."""
from __future__ import annotations

import torch

from benchmarks.ops._micro import OpCase
from hybridserve.ops.reference import activation as reference
from hybridserve.ops.triton import activation as kernel


def cases(device: torch.device) -> list[OpCase]:
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for width, what in ((9216, "dense FFN"), (1024, "shared expert")):
        for tokens, label in ((1, "B=1"), (64, "B=64"), (256, "B=256"), (8192, "T=8192")):
            x = torch.randn(tokens, 2 * width, device=device, generator=gen).bfloat16()
            out.append(OpCase("activation", f"silu_and_mul {what} {label}", lambda x=x: kernel.silu_and_mul(x),
                              lambda x=x: reference.silu_and_mul(x), bytes=tokens * width * 2 * 3))
    return out
