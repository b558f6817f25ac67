"""ZAYA1's EDA router: the pure-torch reference, all fp32.

    z = down_proj(x32) (+ carry * router_states_scale)      -> the EDA carry handed to the next layer's router
    logits = out_proj(GELU(fc2(GELU(fc1(RMSNorm(z))))))      exact (erf) GELU; E experts + the MOD skip class E
    p = softmax(logits); choice = argmax(p + balancing_biases); weight = p[choice]
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybridserve.ops.reference.norm import rms_normalize


class DeferredSelection(NamedTuple):
    """A decode routing whose class selection the experts' launches make (`ops.triton.zaya_router.normed_route`
    with defer_selection, `ops.triton.moe_gemv`): its tensors are device buffers the selecting kernels read or
    write, not values yet."""
    partials: torch.Tensor  # [T, parts, C] fp32: per token, partial class logits that sum to the logits
    balancing_biases: torch.Tensor  # [E + 1] fp32
    choice: torch.Tensor  # the Routing's outputs the selecting launch writes besides expert_ids / expert_weights
    weight: torch.Tensor
    skip_weight: torch.Tensor


class FoldedFc1(NamedTuple):
    """fc1 folded into the down-projection, for the decode kernels (`ops.triton.zaya_router.normed_route`).
    fc1(RMSNorm(z)) = rstd(z) * y' + fc1_bias with y' = fc1_weight @ (norm_weight * z), and z is linear in the
    router's input x and carry c: y' = weight @ x + bias (+ carry_weight @ c). So launch 1 computes y' beside z, and
    fc2's launch makes fc1's output from them (rstd needs all of z, which only exists after launch 1): a launch
    fewer, for 2 MB more fp32 weights read a layer at ZAYA1-8B's widths. The products are taken in float64 and
    rounded once, so y' differs from the unfolded fc1's sums by fp32 rounding only."""
    weight: torch.Tensor  # [R, H] fp32: fc1_weight @ diag(norm_weight) @ down_weight
    bias: torch.Tensor  # [R] fp32: fc1_weight @ (norm_weight * down_bias)
    carry_weight: torch.Tensor | None  # [R, R] fp32: fc1_weight @ diag(norm_weight * states_scale); None without EDA


def fold_fc1(down_weight: torch.Tensor, down_bias: torch.Tensor, states_scale: torch.Tensor | None,
             norm_weight: torch.Tensor, fc1_weight: torch.Tensor) -> FoldedFc1:
    """The three tensors as views of one fp32 allocation: the bias and the carry weight alone would sit in the
    caching allocator's small segments beside other tensors (graph-pool measurements then vary by a segment)."""
    width, hidden = down_weight.shape
    scaled = fc1_weight.double() * norm_weight.double()[None, :]
    sizes = (width * hidden, width, width * width if states_scale is not None else 0)
    weight, bias, carry = torch.empty(sum(sizes), device=down_weight.device, dtype=torch.float32).split(sizes)
    weight = weight.view(width, hidden).copy_(scaled @ down_weight.double())
    bias.copy_(scaled @ down_bias.double())
    if states_scale is None:
        return FoldedFc1(weight, bias, None)
    return FoldedFc1(weight, bias, carry.view(width, width).copy_(scaled * states_scale.double()[None, :]))


class Routing(NamedTuple):
    choice: torch.Tensor  # [T] int64: the expert, or E for the skip class
    weight: torch.Tensor  # [T, 1] fp32: the (unrenormalised) probability of the choice
    expert_ids: torch.Tensor  # [T, 1] int64: the choice, skip mapped to expert 0 (which it then runs with weight 0)
    expert_weights: torch.Tensor  # [T, 1] fp32: the weight, 0 for skip tokens
    skip_weight: torch.Tensor  # [T, 1] fp32: the weight for skip tokens, else 0 (MOD's scaled identity)
    carry: torch.Tensor  # [T, R] fp32
    # Where set, the fields above but carry are written by the experts' launch that consumes this routing.
    selection: DeferredSelection | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """choice .. carry: the routing's tensors, without its deferred selection."""
        return tuple(self)[:-1]


def routing_from_probs(probs: torch.Tensor, balancing_biases: torch.Tensor, carry: torch.Tensor) -> Routing:
    choice = (probs + balancing_biases).argmax(dim=-1)
    weight = probs.gather(-1, choice[:, None])
    skip = (choice == probs.shape[-1] - 1)[:, None]
    return Routing(choice, weight, choice[:, None].masked_fill(skip, 0), weight.masked_fill(skip, 0.0),
                   torch.where(skip, weight, 0.0), carry)


def router_probs(z: torch.Tensor, norm_weight: torch.Tensor, eps: float, fc1_weight: torch.Tensor,
                 fc1_bias: torch.Tensor, fc2_weight: torch.Tensor, fc2_bias: torch.Tensor,
                 out_weight: torch.Tensor) -> torch.Tensor:
    """softmax over the E + 1 classes of the router MLP applied to z (after the carry term)."""
    u = norm_weight * rms_normalize(z, eps).to(norm_weight.dtype)
    u = F.gelu(F.linear(u, fc1_weight, fc1_bias))
    return torch.softmax(F.linear(F.gelu(F.linear(u, fc2_weight, fc2_bias)), out_weight), dim=-1)


def eda_route(x32: torch.Tensor, down_weight: torch.Tensor, down_bias: torch.Tensor, carry: torch.Tensor | None,
              states_scale: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, fc1_weight: torch.Tensor,
              fc1_bias: torch.Tensor, fc2_weight: torch.Tensor, fc2_bias: torch.Tensor, out_weight: torch.Tensor,
              balancing_biases: torch.Tensor) -> Routing:
    z = F.linear(x32, down_weight, down_bias)
    if states_scale is not None and carry is not None:
        z = z + carry * states_scale
    probs = router_probs(z, norm_weight, eps, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight)
    return routing_from_probs(probs, balancing_biases, z)
