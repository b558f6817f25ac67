"""Rotary position embedding of the leading channels of each head: the one formula every RoPE path uses."""
from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotate the first 2 * len(inv_freq) channels of x [T, ..., head_dim] by the angles positions * inv_freq.

    Angles and the rotation in fp32 (angles from absolute positions on every call: no length-limited cache); the
    result in x's dtype. `interleaved=False`: NeoX rotate-half pairs (i, i + rot/2); True: GPT-J pairs (2i, 2i + 1).
    """
    rotary_dim = 2 * inv_freq.numel()
    angles = positions.float()[:, None] * inv_freq[None, :]
    shape = (angles.shape[0],) + (1,) * (x.dim() - 2) + (angles.shape[1],)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    rot = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)
