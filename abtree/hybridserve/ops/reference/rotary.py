"""Rotary position embedding of the leading `rotary_dim` channels of each head: the pure-torch form.

Angles are computed in fp32 from absolute positions on every call (no length-limited cache), and the rotation is
done in fp32; the result is returned in the input's dtype.
"""
from __future__ import annotations

import torch


def apply_rotary(positions: torch.Tensor, x: torch.Tensor, inv_freq: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """x [T, heads, head_dim], positions [T], inv_freq [rotary_dim / 2] fp32. `interleaved=False`: NeoX rotate-half
    pairs (i, i + rot/2); True: GPT-J adjacent pairs (2i, 2i + 1)."""
    rotary_dim = 2 * inv_freq.shape[0]
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    rot = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)
