"""ZAYA1's EDA router in one fp32 Triton kernel (contract: ops/reference/zaya_router.py).

One program routes BLOCK_T tokens. Layer outputs pass through a per-token fp32 scratch row between the three
matrix products (K-chunked against the [R, R] weight in fp32: a top-1 choice can flip on a near-tie, so nothing
here is rounded below fp32); barriers order the scratch writes and reads of one program. With a carry, z (the
caller's fresh down-projection output) is updated in place and returned as the new carry.

Two forms of the products: 16-token blocks use tl.dot (IEEE fp32), which pads every block to 16 rows; decode
batches (up to DOT_FROM tokens) run one token per program as multiply-and-sum over K-chunks instead, so that a
handful of tokens spread over as many SMs rather than one program doing 16 padded rows (the profile of a 64-row
ZAYA1 decode step on the H200 had this kernel at 71 us per call with 16-token blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.ops.reference.zaya_router import Routing

DOT_FROM = 64  # tokens from which 16-token tl.dot blocks replace one token per program (to be tuned on the GPU)


@triton.jit
def _matmul_rows(x_ptr, rows, row_ok, w_ptr, K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[rows, :K] @ w[:N, :K]^T in fp32 -> [BLOCK_T, BLOCK_N] (columns >= N are zero)."""
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=(k < K)[:, None] & (n < N)[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision="ieee")
    return acc


@triton.jit
def _matvec_rows(x_ptr, rows, row_ok, w_ptr, K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The same product as `_matmul_rows` for a few rows, as fp32 multiply-adds (no 16-row padding): partial sums
    per K lane, reduced across lanes once at the end."""
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_T, BLOCK_K, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=(k < K)[:, None] & (n < N)[None, :], other=0.0)
        acc += a[:, :, None] * w[None, :, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _product(x_ptr, rows, row_ok, w_ptr, K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
    if USE_DOT:
        return _matmul_rows(x_ptr, rows, row_ok, w_ptr, K, N, BLOCK_T, BLOCK_N, BLOCK_K)
    return _matvec_rows(x_ptr, rows, row_ok, w_ptr, K, N, BLOCK_T, BLOCK_N, BLOCK_K)


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _eda_route_kernel(z_ptr, carry_ptr, scale_ptr, norm_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, wo_ptr, bias_ptr,
                      scratch_ptr, choice_ptr, weight_ptr, ids_ptr, expert_w_ptr, skip_w_ptr, num_tokens, eps,
                      R: tl.constexpr, CLASSES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, HAS_CARRY: tl.constexpr,
                      USE_DOT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    tile = rows[:, None] * R + r[None, :]
    ok = row_ok[:, None] & r_ok[None, :]
    z = tl.load(z_ptr + tile, mask=ok, other=0.0)
    if HAS_CARRY:
        scale = tl.load(scale_ptr + r, mask=r_ok, other=0.0)
        z += tl.load(carry_ptr + tile, mask=ok, other=0.0) * scale[None, :]
        tl.store(z_ptr + tile, z, mask=ok)  # the carry handed on (z is this call's own GEMM output)
    rstd = tl.rsqrt(tl.sum(z * z, axis=1) / R + eps)
    u = tl.load(norm_ptr + r, mask=r_ok, other=0.0)[None, :] * (z * rstd[:, None])
    tl.store(scratch_ptr + tile, u, mask=ok)
    tl.debug_barrier()
    u = _gelu(_product(scratch_ptr, rows, row_ok, w1_ptr, R, R, BLOCK_T, BLOCK_R, BLOCK_K, USE_DOT)
              + tl.load(b1_ptr + r, mask=r_ok, other=0.0)[None, :])
    tl.debug_barrier()
    tl.store(scratch_ptr + tile, u, mask=ok)
    tl.debug_barrier()
    u = _gelu(_product(scratch_ptr, rows, row_ok, w2_ptr, R, R, BLOCK_T, BLOCK_R, BLOCK_K, USE_DOT)
              + tl.load(b2_ptr + r, mask=r_ok, other=0.0)[None, :])
    tl.debug_barrier()
    tl.store(scratch_ptr + tile, u, mask=ok)
    tl.debug_barrier()
    logits = _product(scratch_ptr, rows, row_ok, wo_ptr, R, CLASSES, BLOCK_T, BLOCK_C, BLOCK_K, USE_DOT)

    c = tl.arange(0, BLOCK_C)
    c_ok = (c < CLASSES)[None, :]
    logits = tl.where(c_ok, logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = e / tl.sum(e, axis=1)[:, None]
    biased = tl.where(c_ok, probs + tl.load(bias_ptr + c, mask=c < CLASSES, other=0.0)[None, :], float("-inf"))
    choice = tl.argmax(biased, axis=1, tie_break_left=True)
    weight = tl.sum(tl.where(c[None, :] == choice[:, None], probs, 0.0), axis=1)
    skip = choice == CLASSES - 1
    tl.store(choice_ptr + rows, choice.to(tl.int64), mask=row_ok)
    tl.store(weight_ptr + rows, weight, mask=row_ok)
    tl.store(ids_ptr + rows, tl.where(skip, 0, choice).to(tl.int64), mask=row_ok)
    tl.store(expert_w_ptr + rows, tl.where(skip, 0.0, weight), mask=row_ok)
    tl.store(skip_w_ptr + rows, tl.where(skip, weight, 0.0), mask=row_ok)


def eda_route(z: torch.Tensor, carry: torch.Tensor | None, states_scale: torch.Tensor | None,
              norm_weight: torch.Tensor, eps: float, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor,
              fc2_weight: torch.Tensor, fc2_bias: torch.Tensor, out_weight: torch.Tensor,
              balancing_biases: torch.Tensor, use_dot: bool | None = None) -> Routing:
    """`use_dot` forces a form of the products (benchmarks, tests); by default 16-token tl.dot blocks from
    DOT_FROM tokens on, one token per program below."""
    tokens, width = z.shape
    classes = out_weight.shape[0]
    params = (norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight, balancing_biases)
    if any(p.dtype != torch.float32 or not p.is_contiguous() for p in (z, *params)):
        raise ValueError("the router kernel takes contiguous fp32 tensors")
    has_carry = states_scale is not None and carry is not None
    # Two allocations per call (the host cost of an allocation is a few us, 40 layers a step): the int64 outputs
    # in one buffer, the fp32 outputs and the scratch rows in another. Each output starts on a 16-byte boundary
    # (rows padded to `padded`), as Triton specialises pointers on that: the same kernel variants for any count.
    padded = -(-tokens // 4) * 4
    choice, ids = torch.empty(2, padded, 1, device=z.device, dtype=torch.int64)[:, :tokens]
    floats = torch.empty(padded * (3 + width), device=z.device, dtype=torch.float32)
    weight, expert_w, skip_w = floats[:3 * padded].view(3, padded, 1)[:, :tokens]
    scratch = floats[3 * padded:].view(padded, width)[:tokens]
    if tokens:
        use_dot = tokens >= DOT_FROM if use_dot is None else use_dot
        block_t = 16 if use_dot else 1
        block_r = max(16, triton.next_power_of_2(width))
        block_k = min(32, max(16, triton.next_power_of_2(width)))
        _eda_route_kernel[(triton.cdiv(tokens, block_t),)](
            z, carry if has_carry else z, states_scale if has_carry else z, *params[:6], balancing_biases, scratch,
            choice, weight, ids, expert_w, skip_w, tokens, eps,
            R=width, CLASSES=classes, BLOCK_T=block_t, BLOCK_R=block_r,
            BLOCK_C=max(16, triton.next_power_of_2(classes)), BLOCK_K=block_k, HAS_CARRY=has_carry,
            # The per-token form keeps [BLOCK_K, BLOCK_R] partial sums: 8 warps hold 32 x 256 in 32 registers each.
            USE_DOT=use_dot, num_warps=4 if use_dot else 8)
    return Routing(choice[:, 0], weight, ids, expert_w, skip_w, z)
