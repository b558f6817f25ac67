"""ZAYA1's CCA convolution and value lag: the pure-torch reference (CPU, and the oracle of the Triton kernel).

Input: one packed projection `proj` [T, C + 2 * Vh] = [q | k | v_current | v_delayed] per token, where the first
C = (Hq + Hk) * D channels are this rank's raw q|k heads (conv channel order: q heads, then k heads) and the value
projections are replicated (Vh = Hk_total * D / 2 each).

q|k: a causal depthwise conv (kernel K0, bias) then a per-head grouped conv (D -> D, kernel K1, bias) over time,
padded once on the raw input: the carried window holds the raw q|k of a row's last P = K0 + K1 - 2 tokens (oldest
first), zeros for a fresh row. Then the head-mix residuals: q_res[h] = (q[h] + k[h // G]) / 2 and
k_res[j] = mean over j's G query heads of q_res.
v: the first Hk/2 KV heads take v_current of the token, the rest v_delayed of the token before (the carried lag,
or v_delayed(0) = its bias for a fresh row); this rank keeps its KV heads.

Rows are laid out by `batch.token_history`: each sequence's P carried rows in front of its new tokens, so
`row - j` is a token's j-th predecessor wherever it lies. The carried window and lag are overwritten with the
state after each row's last token, and page footers (the state after a page's last token) are written when given.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.core.batch import ForwardBatch


def _conv(qk: torch.Tensor, batch: ForwardBatch, weight0: torch.Tensor, bias0: torch.Tensor, weight1: torch.Tensor,
          bias1: torch.Tensor, conv_state: torch.Tensor, conv_footer: torch.Tensor | None) -> torch.Tensor:
    """Causal conv over [carried raw rows | new raw rows] of every sequence; updates the carried rows (and the
    footer of every page this step completes: the rows as they stand after the page's last token)."""
    layout = batch.token_history
    history = layout.length
    carried = conv_state[batch.state_slots].transpose(1, 2)  # [B, P, C]
    carried = torch.where(batch.has_initial_state[:, None, None], carried, torch.zeros_like(carried))
    rows = qk.new_zeros(layout.total_rows, qk.shape[1])
    rows[layout.history_index.flatten()] = carried.reshape(-1, qk.shape[1])
    rows[layout.token_index] = qk
    conv_state[batch.state_slots] = rows[layout.final_index].transpose(1, 2)
    if conv_footer is not None:
        window = layout.token_index[batch.page_end_tokens][:, None] + torch.arange(1 - history, 1, device=qk.device)
        conv_footer[batch.page_end_pages] = rows[window].transpose(1, 2)
    stage1 = F.conv1d(rows.t()[None], weight0, bias0, groups=qk.shape[1])
    stage2 = F.conv1d(stage1, weight1, bias1, groups=qk.shape[1] // weight1.shape[1])
    # Output column i covers raw rows i .. i + P, so a token at row r reads column r - P.
    return stage2[0].t()[layout.token_index - history]


def _lagged(delayed: torch.Tensor, batch: ForwardBatch, lag_bias: torch.Tensor | None, lag_state: torch.Tensor,
            lag_footer: torch.Tensor | None) -> torch.Tensor:
    """v_proj_delayed of each token's predecessor; a fresh sequence's predecessor is the zero vector."""
    layout = batch.token_history
    fresh = (lag_bias if lag_bias is not None else delayed.new_zeros(delayed.shape[1]))[None].expand(
        batch.num_seqs, -1)
    previous = torch.where(batch.has_initial_state[:, None], lag_state[batch.state_slots], fresh)
    rows = delayed.new_zeros(layout.total_rows, delayed.shape[1])
    rows[layout.history_index[:, -1]] = previous
    rows[layout.token_index] = delayed
    lag_state[batch.state_slots] = rows[layout.final_index[:, -1]]
    if lag_footer is not None:
        lag_footer[batch.page_end_pages] = rows[layout.token_index[batch.page_end_tokens]]
    return rows[layout.token_index - 1]


def cca_conv(proj: torch.Tensor, weight0: torch.Tensor, bias0: torch.Tensor, weight1: torch.Tensor,
             bias1: torch.Tensor, lag_bias: torch.Tensor | None, q_heads: int, kv_head_offset: int,
             batch: ForwardBatch, conv_state: torch.Tensor, lag_state: torch.Tensor,
             conv_footer: torch.Tensor | None = None, lag_footer: torch.Tensor | None = None):
    """-> query [T, Hq, D], key [T, Hk, D], value [T, Hk, D] (this rank's heads; KV heads from kv_head_offset)."""
    tokens, channels = proj.shape[0], weight0.shape[0]
    d = weight1.shape[1]
    k_heads = channels // d - q_heads
    group = q_heads // k_heads
    lag_width = lag_state.shape[-1]
    qk = proj[:, :channels]
    q, k = qk[:, : q_heads * d], qk[:, q_heads * d:]
    q_res = (q.view(tokens, q_heads, d) + k.view(tokens, k_heads, d).repeat_interleave(group, 1)) * 0.5
    k_res = q_res.view(tokens, k_heads, group, d).mean(dim=2)
    mixed = _conv(qk, batch, weight0, bias0, weight1, bias1, conv_state, conv_footer)
    query = mixed[:, : q_heads * d].view(tokens, q_heads, d) + q_res
    key = mixed[:, q_heads * d:].view(tokens, k_heads, d) + k_res
    current, delayed = proj[:, channels:channels + lag_width], proj[:, channels + lag_width:]
    value = torch.cat([current, _lagged(delayed, batch, lag_bias, lag_state, lag_footer)], -1)
    value = value.view(tokens, 2 * lag_width // d, d)[:, kv_head_offset:kv_head_offset + k_heads]
    return query, key, value
