"""Ling's grouped sigmoid router: fp32 logits [T, E] -> (top-k expert ids, weights), and at decode sizes the logits
GEMV and the selection in one launch.

The selection holds a token's E scores as a [groups, group size] tile (padded to powers of two with -inf). Every
"pick the best" is a max followed by the minimum index attaining it, so the lower group / expert index wins ties,
exactly as the reference's stable sort (`ops.reference.router`).

`route` (steps of at most FUSED_MAX_TOKENS tokens): the logits x @ W^T in the decode form of `ops.triton.fp32_gemv`
(about PROGRAMS programs, each reading its experts' rows of the 4 MB fp32 weight), stored to an fp32 buffer; each
program then bumps its token block's arrival counter (acq_rel) and the last to arrive reads the block's logits back
through L2, selects for each of its tokens and resets the counter (ops/triton/counters.py). A cuBLAS fp32 GEMV and a
selection launch took about 8 + 4 us a layer at one token on an H200; larger steps keep that pair (`grouped_topk`
after torch's GEMM), where the GEMM is no longer a GEMV.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.counters import arrival_counters
from hybridserve.ops.triton.fp32_gemv import fused_tiles, k_loop, rows_times_cols
from hybridserve.ops.triton.pdl import prefetch_rows, wait_for_previous
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2

FUSED_MAX_TOKENS = 16  # steps of at most this many tokens take `route`'s one launch


@triton.jit
def _select_experts(logits, bias, ids_out, weights_out, token, logits_stride, scaling, HAS_BIAS: tl.constexpr,
                    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                    G_P2: tl.constexpr, S_P2: tl.constexpr, K_P2: tl.constexpr, CACHE: tl.constexpr):
    """The top-k ids and weights of one token's logits row (read with the cache modifier CACHE)."""
    group = tl.arange(0, G_P2)
    member = tl.arange(0, S_P2)
    valid = (group[:, None] < N_GROUP) & (member[None, :] < GROUP_SIZE)
    expert = group[:, None] * GROUP_SIZE + member[None, :]  # padded lanes alias real ids: mask with `valid`
    scores = tl.sigmoid(tl.load(logits + token * logits_stride + expert, mask=valid, other=0.0,
                                 cache_modifier=CACHE))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias + expert, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))

    # A group's score: its best value plus the best of the rest (the top-2 sum).
    best = tl.max(choice, axis=1)
    first = tl.min(tl.where(choice == best[:, None], member[None, :], S_P2), axis=1)
    second = tl.max(tl.where(member[None, :] == first[:, None], float("-inf"), choice), axis=1)
    group_score = best + second

    open_group = group < N_GROUP
    kept = group < 0
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.max(tl.where(open_group, group_score, float("-inf")), axis=0)
        pick = tl.min(tl.where(open_group & (group_score == top), group, G_P2), axis=0)
        kept = kept | (group == pick)
        open_group = open_group & (group != pick)

    candidate = valid & kept[:, None]
    slot = tl.arange(0, K_P2)
    ids = tl.zeros([K_P2], dtype=tl.int32)
    weights = tl.zeros([K_P2], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        top = tl.max(tl.max(tl.where(candidate, choice, float("-inf")), axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(candidate & (choice == top), expert, N_GROUP * GROUP_SIZE), axis=1), axis=0)
        weight = tl.sum(tl.sum(tl.where(valid & (expert == pick), scores, 0.0), axis=1), axis=0)
        ids = tl.where(slot == k, pick, ids)
        weights = tl.where(slot == k, weight, weights)
        candidate = candidate & (expert != pick)

    weights = weights / (tl.sum(weights, axis=0) + 1e-20) * scaling
    tl.store(ids_out + token * TOP_K + slot, ids.to(tl.int64), mask=slot < TOP_K)
    tl.store(weights_out + token * TOP_K + slot, weights, mask=slot < TOP_K)


@triton.jit
def _grouped_topk_kernel(logits, bias, ids_out, weights_out, logits_stride, scaling,
                         HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, G_P2: tl.constexpr, S_P2: tl.constexpr,
                         K_P2: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    _select_experts(logits, bias, ids_out, weights_out, tl.program_id(0).to(tl.int64), logits_stride, scaling,
                    HAS_BIAS, N_GROUP, GROUP_SIZE, TOPK_GROUP, TOP_K, G_P2, S_P2, K_P2, "")


@triton.jit(do_not_specialize=["num_tokens"])  # one variant for every token count of a tile bucket
def _route_kernel(x_ptr, w_ptr, logits_ptr, num_tokens, counter_ptr, bias, ids_out, weights_out, scaling,
                  K: tl.constexpr, E: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  STAGES: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, G_P2: tl.constexpr, S_P2: tl.constexpr,
                  K_P2: tl.constexpr, USE_PDL: tl.constexpr):
    """logits[rows, cols] = x[rows] @ w[cols]^T for this program's BT tokens and BN experts; the token block's last
    program to finish then selects the experts of each of its tokens."""
    rows = tl.program_id(1) * BT + tl.arange(0, BT)
    row_ok = rows < num_tokens
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    col_ok = cols < E
    if USE_PDL:  # no kernel writes the weight: its stream starts before the wait (ops/triton/pdl.py)
        prefetch_rows(w_ptr, cols, col_ok, K, K)
    wait_for_previous(USE_PDL)
    logits, _ = rows_times_cols(x_ptr, w_ptr, x_ptr, rows, row_ok, cols, col_ok, K, BT, BN, BK, STAGES, False,
                                False, "")
    tl.store(logits_ptr + rows[:, None] * E + cols[None, :], logits, mask=row_ok[:, None] & col_ok[None, :])
    tl.debug_barrier()  # every thread's stores precede the release below
    arrived = tl.atomic_add(counter_ptr + tl.program_id(1), 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        for t in tl.range(0, BT):
            token = tl.program_id(1).to(tl.int64) * BT + t
            if token < num_tokens:
                _select_experts(logits_ptr, bias, ids_out, weights_out, token, E, scaling, HAS_BIAS, N_GROUP,
                                GROUP_SIZE, TOPK_GROUP, TOP_K, G_P2, S_P2, K_P2, ".cg")  # .cg: others' logits
        tl.store(counter_ptr + tl.program_id(1), 0)


def _selection(experts: int, n_group: int, topk_group: int, top_k: int, has_bias: bool) -> dict:
    """The selection's constexprs."""
    return dict(HAS_BIAS=has_bias, N_GROUP=n_group, GROUP_SIZE=experts // n_group, TOPK_GROUP=topk_group,
                TOP_K=top_k, G_P2=next_power_of_2(n_group), S_P2=next_power_of_2(experts // n_group),
                K_P2=next_power_of_2(top_k))


def _outputs(tokens: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(tokens, top_k, dtype=torch.int64, device=device),
            torch.empty(tokens, top_k, dtype=torch.float32, device=device))


def grouped_topk(logits: torch.Tensor, expert_bias: torch.Tensor | None, n_group: int, topk_group: int, top_k: int,
                 routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [T, E] -> (expert ids [T, top_k] int64, weights [T, top_k] fp32); see `ops.router`."""
    tokens, experts = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids, weights = _outputs(tokens, top_k, logits.device)
    if tokens == 0:
        return ids, weights
    bias = expert_bias.contiguous() if expert_bias is not None else logits  # unread without a bias
    _grouped_topk_kernel[(tokens,)](
        logits, bias, ids, weights, logits.stride(0), float(routed_scaling_factor),
        **_selection(experts, n_group, topk_group, top_k, expert_bias is not None),
        num_warps=1 if experts <= 512 else 4, **pdl.launch(logits.device))
    return ids, weights


def route(x: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor | None, n_group: int, topk_group: int,
          top_k: int, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_topk of the logits x @ weight^T in one launch; x [T, H] (T <= FUSED_MAX_TOKENS) and weight [E, H]
    contiguous fp32; see `ops.router.route`."""
    tokens, hidden = x.shape
    experts = weight.shape[0]
    ids, weights = _outputs(tokens, top_k, x.device)
    if tokens == 0:
        return ids, weights
    logits = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    bt, bn = fused_tiles(tokens, experts)
    bias = expert_bias.contiguous() if expert_bias is not None else x  # unread without a bias
    _route_kernel[(cdiv(experts, bn), cdiv(tokens, bt))](
        x, weight, logits, tokens, arrival_counters("ling_router", FUSED_MAX_TOKENS, x.device), bias, ids, weights,
        float(routed_scaling_factor), K=hidden, E=experts, BT=bt, BN=bn, **k_loop(bt, bn, hidden),
        **_selection(experts, n_group, topk_group, top_k, expert_bias is not None), num_warps=4,
        **pdl.launch(x.device))
    return ids, weights
