"""ZAYA1's EDA router in fp32 Triton kernels (contract: ops/reference/zaya_router.py).

Three launches, each spread over the product's output columns as well as its tokens: (carry +) RMSNorm + fc1 +
GELU, fc2 + GELU, then the E + 1 class logits with softmax and the biased argmax. The router is a few hundred KB
of fp32 weights and a few tokens per decode step, so what costs is reading those weights: one program per token
block (the former single-launch form) read all of them through one SM (the H200 profile of a 64-row decode step:
71 us per call; one token: 23 us). Split 16 columns per program, every program reads 1/16 of a matrix. Products
are tl.dot in IEEE fp32 over the whole width at once (a top-1 choice can flip on a near-tie, so nothing here is
rounded below fp32); a program's rows are padded to 16, which costs nothing next to the weight reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.ops.reference.zaya_router import Routing

BLOCK_T = 16  # tokens per program (tl.dot's minimum)
BLOCK_N = 16  # output columns per program of the two R x R layers


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _dense_gelu_kernel(x_ptr, carry_ptr, scale_ptr, carry_out_ptr, norm_ptr, w_ptr, b_ptr, out_ptr, num_tokens, eps,
                       K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, HAS_CARRY: tl.constexpr, NORM: tl.constexpr):
    """out[:, cols] = GELU(x' @ w[cols]^T + b[cols]) for this program's columns and tokens, where x' is x (+ carry *
    scale, written to carry_out by the first column block) (RMS-normalised times norm weight, with NORM)."""
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    k = tl.arange(0, BLOCK_K)
    k_ok = k < K
    tile = rows[:, None] * K + k[None, :]
    ok = row_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + tile, mask=ok, other=0.0)
    if HAS_CARRY:
        x += tl.load(carry_ptr + tile, mask=ok, other=0.0) * tl.load(scale_ptr + k, mask=k_ok, other=0.0)[None, :]
        if tl.program_id(0) == 0:
            tl.store(carry_out_ptr + tile, x, mask=ok)  # the carry handed to the next layer's router
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)
        x = tl.load(norm_ptr + k, mask=k_ok, other=0.0)[None, :] * (x * rstd[:, None])
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    acc = tl.dot(x, w, input_precision="ieee") + tl.load(b_ptr + n, mask=n_ok, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * N + n[None, :], _gelu(acc), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _select_kernel(u_ptr, wo_ptr, bias_ptr, choice_ptr, weight_ptr, ids_ptr, expert_w_ptr, skip_w_ptr, num_tokens,
                   K: tl.constexpr, CLASSES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """Class logits, softmax, argmax over p + balancing biases, and the routing outputs of BLOCK_T tokens."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    k = tl.arange(0, BLOCK_K)
    k_ok = k < K
    u = tl.load(u_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    c = tl.arange(0, BLOCK_C)
    c_valid = c < CLASSES
    wo = tl.load(wo_ptr + c[None, :] * K + k[:, None], mask=k_ok[:, None] & c_valid[None, :], other=0.0)
    logits = tl.dot(u, wo, input_precision="ieee")
    c_ok = c_valid[None, :]
    logits = tl.where(c_ok, logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = e / tl.sum(e, axis=1)[:, None]
    biased = tl.where(c_ok, probs + tl.load(bias_ptr + c, mask=c_valid, other=0.0)[None, :], float("-inf"))
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
              balancing_biases: torch.Tensor) -> Routing:
    tokens, width = z.shape
    classes = out_weight.shape[0]
    params = (norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight, balancing_biases)
    if any(p.dtype != torch.float32 or not p.is_contiguous() for p in (z, *params)):
        raise ValueError("the router kernel takes contiguous fp32 tensors")
    has_carry = states_scale is not None and carry is not None
    # Two allocations per call (the host cost of an allocation is a few us, 40 layers a step): the int64 outputs
    # in one buffer; the fp32 outputs, the two hidden layers and the new carry in another. Each starts on a 16-byte
    # boundary (rows padded to `padded`), as Triton specialises pointers on that: the same variants for any count.
    padded = -(-tokens // 4) * 4
    choice, ids = torch.empty(2, padded, 1, device=z.device, dtype=torch.int64)[:, :tokens]
    rows_of_width = 3 if has_carry else 2
    floats = torch.empty(padded * (3 + rows_of_width * width), device=z.device, dtype=torch.float32)
    weight, expert_w, skip_w = floats[:3 * padded].view(3, padded, 1)[:, :tokens]
    hidden = floats[3 * padded:].view(rows_of_width, padded, width)[:, :tokens]
    new_carry = hidden[2] if has_carry else z
    if tokens:
        block_k = max(16, triton.next_power_of_2(width))
        grid = (triton.cdiv(width, BLOCK_N), triton.cdiv(tokens, BLOCK_T))
        layer = dict(K=width, N=width, BLOCK_T=BLOCK_T, BLOCK_K=block_k, BLOCK_N=BLOCK_N, num_warps=4)
        _dense_gelu_kernel[grid](z, carry if has_carry else z, states_scale if has_carry else z, new_carry,
                                 norm_weight, fc1_weight, fc1_bias, hidden[0], tokens, eps,
                                 HAS_CARRY=has_carry, NORM=True, **layer)
        _dense_gelu_kernel[grid](hidden[0], z, z, z, z, fc2_weight, fc2_bias, hidden[1], tokens, eps,
                                 HAS_CARRY=False, NORM=False, **layer)
        _select_kernel[(triton.cdiv(tokens, BLOCK_T),)](
            hidden[1], out_weight, balancing_biases, choice, weight, ids, expert_w, skip_w, tokens,
            K=width, CLASSES=classes, BLOCK_T=BLOCK_T, BLOCK_K=block_k,
            BLOCK_C=max(16, triton.next_power_of_2(classes)), num_warps=4)
    return Routing(choice[:, 0], weight, ids, expert_w, skip_w, new_carry)
