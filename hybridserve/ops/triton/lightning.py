"""Lightning attention in Triton: the decayed linear recurrence with every row's state read and written in place in
the state pool, by slot (no gather, copy or scatter of states).

Same contract as `ops.reference.lightning` (the oracle): per head, log-decay g < 0, a = exp(g), c = d^-1/2,
    S_t = a * S_{t-1} + k_t^T v_t,    o_t = c * q_t S_t          (fp32 state [d_k, d_v], K-major)
A row reads its slot only when `has_initial_state` says so (otherwise it starts from zero, whatever the slot holds);
a negative slot (CUDA-graph padding) is neither read nor written.

- Decode (one token per row): one program per (row, head, v-block) does the step in fp32 registers.
- Prefill and mixed batches: one program per (row, head, v-block) walks the row's chunks of CHUNK tokens with its
  state block in registers: o = c * [((q k^T) * M) v + a^(i+1) * (q S)], then S = a^b S + (k * a^(b-1-j))^T v,
  M_ij = a^(i-j) for j <= i built in log space. The grid covers rows x heads x v-blocks, so one 8k-token row at
  Ling-2.6-flash widths (32 heads x 128, BLOCK_V 64) is 64 programs of 128 sequential chunks each.
- Verify rows (speculative decoding, `batch.verify`: a row's last token and its drafts): one program per (verify
  row, head, v-block) runs the decode step token by token and stores the state after each token in that token's
  slot (the working slot after the first, intermediate slots after the drafts), never the row's final state. In a
  batch that also has other rows, the prefill kernel runs first with the verify rows' slots masked out (negative:
  neither read nor written), and the verify kernel then writes those rows' outputs.

Precision: the state and every accumulator are fp32. q k^T runs in the input dtype (bf16 products are exact in the
fp32 accumulator); the dots with an fp32 operand (the decay-weighted scores, the state, the decayed keys) run with
`DOT_PRECISION` ("tf32x3" by default: three tf32 products, fp32-level error, still on the tensor cores; "tf32" and
"ieee" are the alternatives tests/gpu/test_ling_kernels_gpu.py measures). The state itself is never rounded: only
the new contribution of a chunk goes through a dot.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from hybridserve.core.batch import ForwardBatch
from hybridserve.ops.reference.lightning import QKNormRope
from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.pdl import wait_for_previous
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2

CHUNK = 64
DOT_PRECISION = "tf32x3"
PRECISIONS = ("ieee", "tf32", "tf32x3")


@triton.jit
def _scores(q, k, PRECISION: tl.constexpr):
    """q k^T: 16-bit inputs multiply exactly into the fp32 accumulator; only fp32 inputs take PRECISION."""
    if q.dtype == tl.float32:
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    else:
        scores = tl.dot(q, tl.trans(k))
    return scores


@triton.jit
def _load_state(state_ptr, slots_ptr, has_state_ptr, row, head, offs_k, offs_v, mask_k, mask_v,
                stride_slot, stride_sh, stride_sk):
    """A row's [BLOCK_K, BLOCK_V] state block in its slot: (values, zeros unless restored; pointers; store mask,
    false for a negative slot)."""
    slot = tl.load(slots_ptr + row)
    live = slot >= 0
    ptrs = state_ptr + slot * stride_slot + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(ptrs, mask=mask & (tl.load(has_state_ptr + row) & live), other=0.0)
    return state, ptrs, mask & live


@triton.jit
def _head_weights(weight_ptr, offs, mask, HALF: tl.constexpr, NORM_ROPE: tl.constexpr, HAS_NORM: tl.constexpr):
    """`_norm_rope`'s norm weights of each channel and of its rotated partner (fp32; ones unless HAS_NORM)."""
    w, w_partner = 1.0, 1.0
    if NORM_ROPE and HAS_NORM:
        rotated = offs < 2 * HALF
        partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w_partner = tl.load(weight_ptr + partner, mask=mask & rotated, other=0.0).to(tl.float32)
    return w, w_partner


@triton.jit
def _load_head(ptr, offs, mask, HALF: tl.constexpr, NORM_ROPE: tl.constexpr):
    """One q or k head [BLOCK_K] as stored, and with NORM_ROPE each rotated channel's partner in fp32 (else 0)."""
    x = tl.load(ptr + offs, mask=mask, other=0.0)
    other = 0.0
    if NORM_ROPE:
        partner = tl.where(offs < HALF, offs + HALF, offs - HALF)  # the other channel of each rotated pair
        other = tl.load(ptr + partner, mask=mask & (offs < 2 * HALF), other=0.0).to(tl.float32)
    return x, other


@triton.jit
def _norm_rope(x, other, w, w_partner, offs, cos, sin, eps,
               DK: tl.constexpr, HALF: tl.constexpr, NORM_ROPE: tl.constexpr, HAS_NORM: tl.constexpr):
    """`_load_head`'s head in fp32; with NORM_ROPE, per-head RMSNorm (HAS_NORM; `_head_weights`) and NeoX RoPE
    (cos, sin of each channel's angle) of its first 2 * HALF channels first, rounded to the input's dtype:
    `ops.ling_norm.qk_norm_rope`'s output, fused."""
    if NORM_ROPE:
        rotated = offs < 2 * HALF
        x32 = x.to(tl.float32)
        if HAS_NORM:
            rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / DK + eps)
            x32 = x32 * rstd * w
            other = other * rstd * w_partner
        out = x32 * cos + tl.where(offs < HALF, -other, other) * sin
        x = tl.where(rotated, out, x32).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, state_ptr, slots_ptr, has_state_ptr, log_decay_ptr,
                   q_weight_ptr, k_weight_ptr, positions_ptr, inv_freq_ptr, eps,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   stride_slot, stride_sh, stride_sk, scale,
                   DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                   HALF: tl.constexpr, NORM_ROPE: tl.constexpr, HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr):
    row, head, vblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    # Before the wait: the state (this layer's previous step), the step's metadata and the weights; only q, k, v
    # come from the projection before.
    state, state_ptrs, store_mask = _load_state(state_ptr, slots_ptr, has_state_ptr, row, head, offs_k, offs_v,
                                                 mask_k, mask_v, stride_slot, stride_sh, stride_sk)
    decay = tl.exp(tl.load(log_decay_ptr + head))
    q_w, q_w_partner = _head_weights(q_weight_ptr, offs_k, mask_k, HALF, NORM_ROPE, HAS_NORM)
    k_w, k_w_partner = _head_weights(k_weight_ptr, offs_k, mask_k, HALF, NORM_ROPE, HAS_NORM)
    cos, sin = 1.0, 0.0
    if NORM_ROPE:
        angle = tl.load(positions_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + offs_k % HALF,
                                                                        mask=offs_k < 2 * HALF, other=0.0)
        cos, sin = tl.cos(angle), tl.sin(angle)
    wait_for_previous(USE_PDL)
    # q, k and v all loaded before q's norm: no load moves across its reduction's barrier.
    q, q_other = _load_head(q_ptr + row * stride_qt + head * stride_qh, offs_k, mask_k, HALF, NORM_ROPE)
    k, k_other = _load_head(k_ptr + row * stride_kt + head * stride_kh, offs_k, mask_k, HALF, NORM_ROPE)
    v = tl.load(v_ptr + row * stride_vt + head * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    q = _norm_rope(q, q_other, q_w, q_w_partner, offs_k, cos, sin, eps, DK, HALF, NORM_ROPE, HAS_NORM)
    k = _norm_rope(k, k_other, k_w, k_w_partner, offs_k, cos, sin, eps, DK, HALF, NORM_ROPE, HAS_NORM)
    state = decay * state + k[:, None] * v[None, :]
    tl.store(state_ptrs, state, mask=store_mask)
    out = tl.sum(q[:, None] * state, axis=0) * scale
    tl.store(o_ptr + row * stride_ot + head * stride_oh + offs_v, out, mask=mask_v)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, state_ptr, starts_ptr, slots_ptr, has_state_ptr, log_decay_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    stride_slot, stride_sh, stride_sk, scale,
                    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                    CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    row, head, vblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(starts_ptr + row)
    length = tl.load(starts_ptr + row + 1) - start
    offs_t = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    state, state_ptrs, store_mask = _load_state(state_ptr, slots_ptr, has_state_ptr, row, head, offs_k, offs_v,
                                                 mask_k, mask_v, stride_slot, stride_sh, stride_sk)

    g = tl.load(log_decay_ptr + head)
    index = offs_t.to(tl.float32)
    # M_ij = a^(i-j) for j <= i: the exponent is masked to -inf before exp, so nothing above the diagonal overflows.
    distance = index[:, None] - index[None, :]
    decay_mask = tl.exp(tl.where(distance >= 0, g * distance, float("-inf")))
    query_decay = tl.exp(g * (index + 1.0))  # a^(i+1): how much of the chunk's initial state token i sees

    q_rows = q_ptr + head * stride_qh + offs_k[None, :]
    k_rows = k_ptr + head * stride_kh + offs_k[None, :]
    v_rows = v_ptr + head * stride_vh + offs_v[None, :]
    o_rows = o_ptr + head * stride_oh + offs_v[None, :]
    for first in range(0, length, CHUNK):
        n = tl.minimum(length - first, CHUNK)
        valid = offs_t < n
        tokens = (start + first + offs_t).to(tl.int64)[:, None]
        q = tl.load(q_rows + tokens * stride_qt, mask=valid[:, None] & mask_k[None, :], other=0.0)
        k = tl.load(k_rows + tokens * stride_kt, mask=valid[:, None] & mask_k[None, :], other=0.0)
        v = tl.load(v_rows + tokens * stride_vt, mask=valid[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        scores = _scores(q, k, PRECISION) * decay_mask
        out = tl.dot(scores, v, input_precision=PRECISION)
        out += query_decay[:, None] * tl.dot(q.to(tl.float32), state, input_precision=PRECISION)
        tl.store(o_rows + tokens * stride_ot, out * scale, mask=valid[:, None] & mask_v[None, :])
        # S <- a^n S + sum_j a^(n-1-j) k_j^T v_j (rows past n are zero; their weight is masked, not overflowed).
        key_decay = tl.where(valid, tl.exp(g * (n - 1 - index)), 0.0)
        decayed_keys = k.to(tl.float32) * key_decay[:, None]
        state = tl.exp(g * n) * state + tl.dot(tl.trans(decayed_keys), v, input_precision=PRECISION)
    tl.store(state_ptrs, state, mask=store_mask)


@triton.jit
def _verify_kernel(q_ptr, k_ptr, v_ptr, o_ptr, state_ptr, rows_ptr, starts_ptr, slots_ptr, has_state_ptr,
                   token_slots_ptr, log_decay_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_ot, stride_oh, stride_slot, stride_sh, stride_sk, scale,
                   DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.load(rows_ptr + tl.program_id(0))
    head, vblock = tl.program_id(1), tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    state, _, mask = _load_state(state_ptr, slots_ptr, has_state_ptr, row, head, offs_k, offs_v, mask_k, mask_v,
                                 stride_slot, stride_sh, stride_sk)
    decay = tl.exp(tl.load(log_decay_ptr + head))
    start = tl.load(starts_ptr + row)
    for t in range(start, tl.load(starts_ptr + row + 1)):
        q = tl.load(q_ptr + t * stride_qt + head * stride_qh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + head * stride_kh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        state = decay * state + k[:, None] * v[None, :]
        tl.store(o_ptr + t * stride_ot + head * stride_oh + offs_v, tl.sum(q[:, None] * state, axis=0) * scale,
                 mask=mask_v)
        slot = tl.load(token_slots_ptr + t)
        tl.store(state_ptr + slot * stride_slot + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :],
                 state, mask=mask)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state_pool: torch.Tensor) -> None:
    """Host-side layout checks (strides only: no device value is read)."""
    if q.shape != k.shape or q.shape[:2] != v.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if any(t.stride(-1) != 1 for t in (q, k, v, state_pool)):
        raise ValueError("lightning kernels need unit stride along the head dimension of q, k, v and the state")
    if state_pool.dtype != torch.float32 or state_pool.shape[1:] != (q.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(f"state pool {tuple(state_pool.shape)} {state_pool.dtype} does not hold fp32 "
                         f"[H, d_k, d_v] = {(q.shape[1], q.shape[2], v.shape[2])} states")


def _block(n: int) -> int:
    """tl.dot and tl.arange need power-of-two blocks of at least 16."""
    return max(16, next_power_of_2(n))


def lightning_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                     state_pool: torch.Tensor, batch: ForwardBatch, block_v: int = 32,
                     norm_rope: QKNormRope | None = None) -> torch.Tensor:
    """One token per row: q, k [B, H, d_k], v [B, H, d_v] -> o [B, H, d_v] fp32; states updated in the pool.
    With `norm_rope`, q and k are raw and its norm + RoPE is applied on load (`ops.lightning.QKNormRope`)."""
    _check(q, k, v, state_pool)
    rows, heads, dk = q.shape
    dv = v.shape[2]
    out = torch.empty(rows, heads, dv, device=q.device, dtype=torch.float32)
    block_v = min(block_v, _block(dv))
    grid = (rows, heads, cdiv(dv, block_v))
    half, has_norm = 0, False
    weights = (log_decay, log_decay)  # unread without norm_rope
    positions, inv_freq = batch.positions, log_decay
    if norm_rope is not None:
        half, has_norm = norm_rope.inv_freq.numel(), norm_rope.q_weight is not None
        if has_norm:
            weights = (norm_rope.q_weight.contiguous(), norm_rope.k_weight.contiguous())
        positions, inv_freq = norm_rope.positions, norm_rope.inv_freq.contiguous()
        if 2 * half > dk or positions.shape != (rows,):
            raise ValueError(f"RoPE of 2*{half} channels of d_k={dk}, positions {tuple(positions.shape)}")
    _decode_kernel[grid](q, k, v, out, state_pool, batch.state_slots, batch.has_initial_state,
                         log_decay.float().contiguous(), *weights, positions, inv_freq,
                         norm_rope.eps if norm_rope is not None else 0.0, q.stride(0), q.stride(1), k.stride(0),
                         k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                         state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), dk ** -0.5,
                         DK=dk, DV=dv, BLOCK_K=_block(dk), BLOCK_V=block_v, HALF=max(half, 1),
                         NORM_ROPE=norm_rope is not None, HAS_NORM=has_norm, num_warps=4,
                         **pdl.launch(q.device))
    return out


def lightning_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                      state_pool: torch.Tensor, batch: ForwardBatch, precision: str = DOT_PRECISION,
                      block_v: int = 64, num_warps: int | None = None) -> torch.Tensor:
    """Packed rows of any length (decode rows included): q, k [T, H, d_k], v [T, H, d_v] -> o [T, H, d_v] fp32."""
    _check(q, k, v, state_pool)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype; got {q.dtype} and {k.dtype}")
    tokens, heads, dk = q.shape
    dv = v.shape[2]
    out = torch.empty(tokens, heads, dv, device=q.device, dtype=torch.float32)
    block_v = min(block_v, _block(dv))
    if num_warps is None:
        # 8 warps for the real widths (d = 128, BLOCK_V = 64); small tiles take 4: on the H200 8 warps over 16-wide
        # dots (d = 16 test shapes) made an illegal memory access, which 4 warps do not.
        num_warps = 8 if _block(dk) >= 64 and block_v >= 64 else 4
    grid = (batch.num_seqs, heads, cdiv(dv, block_v))
    _prefill_kernel[grid](q, k, v, out, state_pool, batch.query_start_loc, batch.state_slots,
                          batch.has_initial_state, log_decay.float().contiguous(),
                          q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                          out.stride(0), out.stride(1), state_pool.stride(0), state_pool.stride(1),
                          state_pool.stride(2), dk ** -0.5, DK=dk, DV=dv, BLOCK_K=_block(dk), BLOCK_V=block_v,
                          CHUNK=CHUNK, PRECISION=precision, num_warps=num_warps,
                          # The next chunk's q/k/v prefetched while this one computes; fp32 inputs at d = 128
                          # would need twice the shared memory, so they are not pipelined.
                          num_stages=2 if q.element_size() == 2 else 1)
    return out


def lightning_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                     state_pool: torch.Tensor, batch: ForwardBatch, block_v: int = 32) -> torch.Tensor:
    """A batch with verify rows (`batch.verify`; q and k already normed and roped): o [T, H, d_v] fp32. The verify
    rows' states go to their tokens' slots; any other rows run the prefill kernel."""
    _check(q, k, v, state_pool)
    verify = batch.verify
    if len(verify.rows) == batch.num_seqs:
        out = torch.empty(v.shape, device=q.device, dtype=torch.float32)
    else:  # the other rows; the verify rows' slots masked out (their outputs are overwritten below)
        others = dataclasses.replace(batch, state_slots=batch.state_slots.index_fill(0, verify.row_index, -1))
        out = lightning_prefill(q, k, v, log_decay, state_pool, others)
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    block_v = min(block_v, _block(dv))
    grid = (len(verify.rows), heads, cdiv(dv, block_v))
    _verify_kernel[grid](q, k, v, out, state_pool, verify.row_index, batch.query_start_loc, batch.state_slots,
                         batch.has_initial_state, verify.token_slots, log_decay.float().contiguous(),
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         out.stride(0), out.stride(1), state_pool.stride(0), state_pool.stride(1),
                         state_pool.stride(2), dk ** -0.5, DK=dk, DV=dv, BLOCK_K=_block(dk), BLOCK_V=block_v,
                         num_warps=4)
    return out


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                        state_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    if batch.verify is not None:
        return lightning_verify(q, k, v, log_decay, state_pool, batch)
    if batch.is_decode:
        return lightning_decode(q, k, v, log_decay, state_pool, batch)
    return lightning_prefill(q, k, v, log_decay, state_pool, batch)
