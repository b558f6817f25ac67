"""Lightning (simple gated linear) attention with a constant per-head decay: the pure-torch reference.

Per head, with log-decay g < 0 (a = exp(g)), scale c = d^-1/2 and a K-major fp32 state S [d_k, d_v]:
    S_t = a * S_{t-1} + k_t^T v_t,    o_t = c * q_t S_t          (the current token is included)
Prefill evaluates this in chunked-parallel form, from a zero or a carried state: inside a chunk a causal decay
mask built in log space, between chunks the state. Decode is the recurrence itself, one vectorised step for every row.

Each row's state lives in the state pool at `batch.state_slots[row]`; it is read only where
`batch.has_initial_state` says it holds the state after the row's prefix (otherwise the row starts from zero,
whatever the slot contains) and is overwritten with the state after the row's tokens. Verify rows of speculative
decoding (`batch.verify`) run the recurrence token by token instead and write the state after each token to that
token's slot (`VerifyLayout`). Shapes come from the host-side lengths only, so nothing here reads a device value
back.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from hybridserve.core.batch import ForwardBatch
from hybridserve.ops.reference.ling_norm import qk_norm_rope


class QKNormRope(NamedTuple):
    """Per-head RMSNorm (weights None: none) + partial NeoX RoPE of raw q and k before the recurrence, with
    `ops.ling_norm.qk_norm_rope`'s contract (its output rounded to q's dtype)."""
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    positions: torch.Tensor
    inv_freq: torch.Tensor
    eps: float

CHUNK_SIZE = 64


def initial_states(state_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """[B, H, d_k, d_v] states the rows start from: their slot where it holds a valid state, else zeros."""
    states = state_pool[batch.state_slots]
    return torch.where(batch.has_initial_state[:, None, None, None], states, 0.0)


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, state: torch.Tensor,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of b tokens: q, k [H, b, d_k], v [H, b, d_v], state [H, d_k, d_v] -> (o [H, b, d_v], new state)."""
    b = q.shape[1]
    index = torch.arange(b, device=q.device, dtype=torch.float32)
    g = log_decay[:, None]  # [H, 1]
    distance = index[:, None] - index[None, :]  # i - j
    # M_ij = a^(i-j) for j <= i: exponents masked to -inf *before* exp, so no overflow above the diagonal.
    mask = torch.where(distance >= 0, g[:, :, None] * distance, float("-inf")).exp()  # [H, b, b]
    intra = ((q @ k.transpose(1, 2)) * mask) @ v
    inter = torch.exp(g * (index + 1))[:, :, None] * (q @ state)
    out = scale * (intra + inter)
    k_weight = torch.exp(g * (b - 1 - index))[:, :, None]  # a^(b-1-j)
    state = torch.exp(g * b)[:, :, None] * state + (k * k_weight).transpose(1, 2) @ v
    return out, state


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each row: q, k [B, H, d_k], v [B, H, d_v], state [B, H, d_k, d_v] -> (o [B, H, d_v], new state)."""
    decay = torch.exp(log_decay.float())[None, :, None, None]
    state = decay * state + k.float()[..., :, None] * v.float()[..., None, :]
    return q.shape[-1] ** -0.5 * torch.einsum("bhk,bhkv->bhv", q.float(), state), state


def lightning_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                      state_pool: torch.Tensor, batch: ForwardBatch, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Packed rows q, k [T, H, d_k], v [T, H, d_v] -> o [T, H, d_v] (fp32); row states updated in the pool."""
    verify = set(batch.verify.rows) if batch.verify is not None else set()
    scale = q.shape[-1] ** -0.5
    states = initial_states(state_pool, batch)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    finals, token_states = [], []
    for row, (start, length) in enumerate(zip(batch.query_starts, batch.query_lens)):
        state = states[row]
        if row in verify:  # token by token (the decode step), keeping the state after each token
            for t in range(start, start + length):
                o, state = _step(q[t:t + 1], k[t:t + 1], v[t:t + 1], log_decay, state[None])
                out[t], state = o[0], state[0]
                token_states.append(state)
            finals.append(states[row])  # rewritten below by the state after the row's first token
            continue
        qt, kt, vt = (x[start:start + length].float().transpose(0, 1) for x in (q, k, v))  # [H, n, d]
        for first in range(0, length, chunk_size):
            end = min(first + chunk_size, length)
            o, state = _chunk(qt[:, first:end], kt[:, first:end], vt[:, first:end], log_decay.float(), state, scale)
            out[start + first:start + end] = o.transpose(0, 1)
        finals.append(state)
    state_pool[batch.state_slots] = torch.stack(finals)
    if verify:
        state_pool[batch.verify.token_slots[batch.verify.tokens]] = torch.stack(token_states)
    return out


def lightning_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                     state_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """One token per row: q, k [B, H, d_k], v [B, H, d_v] -> o [B, H, d_v] (fp32); row states updated in the pool."""
    out, state = _step(q, k, v, log_decay, initial_states(state_pool, batch))
    state_pool[batch.state_slots] = state
    return out


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                        state_pool: torch.Tensor, batch: ForwardBatch,
                        norm_rope: QKNormRope | None = None) -> torch.Tensor:
    if norm_rope is not None:
        q, k = qk_norm_rope(torch.stack((q, k), dim=1), norm_rope.q_weight, norm_rope.k_weight, norm_rope.positions,
                            norm_rope.inv_freq, norm_rope.eps).unbind(1)
    if batch.is_decode:
        return lightning_decode(q, k, v, log_decay, state_pool, batch)
    return lightning_prefill(q, k, v, log_decay, state_pool, batch)
