"""Softmax attention over a paged KV cache: the pure-torch reference (CPU, and the oracle of the Triton kernels).

Queries of one packed batch attend to keys already written into the cache. Prefill rows are handled one sequence
at a time (host-side lengths give every shape); an all-decode batch is handled in one vectorised pass over the
padded page table, with validity masks built on the device, so it needs no host synchronisation.
"""
from __future__ import annotations

import torch

from hybridserve.core.batch import ForwardBatch


def _key_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and optionally sliding-window, inclusive of the query) visibility: [..., q, k] booleans."""
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return visible


def _softmax_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [..., Hk, G, Q, D], k [..., Hk, K, D], v [..., Hk, K, Dv], visible broadcastable to [..., Q, K]."""
    scores = torch.matmul(q, k.unsqueeze(-3).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible.unsqueeze(-3).unsqueeze(-3), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.unsqueeze(-3))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_cache [slots, Hk, D]; v_cache [slots, Hk, Dv] -> [T, Hq, Dv]."""
    if batch.is_decode:
        return _decode_attention(q, k_cache, v_cache, batch, scale, sliding_window)
    num_kv_heads = k_cache.shape[1]
    group = q.shape[1] // num_kv_heads
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    for seq, (start, length) in enumerate(zip(batch.query_starts, batch.query_lens)):
        if not length:  # an empty row (a prefill graph's padding row when the real row fills the size)
            continue
        prefix, kv_len = batch.prefix_lens[seq], batch.prefix_lens[seq] + length
        first = max(0, prefix - sliding_window + 1) if sliding_window else 0  # pages before it may be released
        slots = batch.kv_slots(seq, kv_len)[first:]
        k, v = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)  # [Hk, K, D]
        qs = q[start:start + length].view(length, num_kv_heads, group, -1).permute(1, 2, 0, 3)  # [Hk, G, Q, D]
        q_pos = torch.arange(prefix, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(first, kv_len, device=q.device)[None, :]
        o = _softmax_attend(qs, k, v, _key_mask(q_pos, k_pos, sliding_window), scale)
        out[start:start + length] = o.permute(2, 0, 1, 3).reshape(length, q.shape[1], -1)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                      scale: float, sliding_window: int | None) -> torch.Tensor:
    """One query per row; keys gathered through the whole padded page table and masked by each row's length."""
    rows, num_heads = q.shape[0], q.shape[1]
    num_kv_heads = k_cache.shape[1]
    slots = batch.padded_kv_slots()  # [B, Kmax]
    k = k_cache[slots].permute(0, 2, 1, 3)  # [B, Hk, Kmax, D]
    v = v_cache[slots].permute(0, 2, 1, 3)
    qs = q.view(rows, num_kv_heads, num_heads // num_kv_heads, 1, -1)
    q_pos = (batch.kv_lens - 1).view(rows, 1, 1)
    k_pos = torch.arange(slots.shape[1], device=q.device).view(1, 1, -1)
    o = _softmax_attend(qs, k, v, _key_mask(q_pos, k_pos, sliding_window), scale)  # [B, Hk, G, 1, Dv]
    return o.reshape(rows, num_heads, -1)
