"""Rotary position embeddings, applied to the leading `rotary_dim` channels of each head.

Angles are computed in fp32 from absolute positions on every call (no length-limited cache), and the rotation is
done in fp32; the result is returned in the input's dtype (`ops.reference.rotary`).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridserve.ops.reference.rotary import apply_rotary


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, base: float, interleaved: bool = False):
        """`interleaved=False`: NeoX rotate-half pairs (i, i + rot/2); True: GPT-J adjacent pairs (2i, 2i + 1)."""
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; positions: [T]."""
        return apply_rotary(positions, x, self.inv_freq, self.interleaved)
