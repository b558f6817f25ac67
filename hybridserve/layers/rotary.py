"""Rotary position embeddings, applied to the leading `rotary_dim` channels of each head.

Angles are computed in fp32 from absolute positions on every call (no length-limited cache), and the rotation is
done in fp32; the result is returned in the input's dtype.
"""
from __future__ import annotations

import torch
from torch import nn


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
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        rot = x[..., : self.rotary_dim].float()
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((rotated.to(x.dtype), x[..., self.rotary_dim :]), dim=-1)
