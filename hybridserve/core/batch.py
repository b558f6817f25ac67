"""ForwardBatch: one packed forward pass described as data.

The scheduler describes each row as a `ScheduledChunk` (host lists only). `build_forward_batch` turns them into
flat device tensors plus the host-side lengths that fix every shape, so that no layer ever reads a device value
back to the host. Rows are packed without padding: prefill chunks of any length and decode rows of one token may
share a batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: the new tokens it runs and where its caches live."""

    token_ids: list[int]
    prefix_len: int  # tokens already in the KV cache (and folded into the state, when restored)
    page_ids: list[int]  # KV pages covering positions [0, prefix_len + len(token_ids))
    state_slot: int
    has_initial_state: bool  # the slot holds the state after `prefix_len` tokens (else start from zero)
    logits_offsets: list[int] = field(default_factory=list)  # which new tokens need logits (0-based in chunk)


@dataclass
class TokenHistory:
    """Rows of recent pre-step activations put in front of each sequence's new tokens (short convolutions).

    In the extended layout a sequence occupies `length` history rows followed by its new tokens, so row
    `token_index[t] - j` is token t's j-th predecessor for every j <= length, whether it lies in this chunk or in
    the carried state.
    """

    length: int
    total_rows: int
    token_index: torch.Tensor  # [T]
    history_index: torch.Tensor  # [B, length]: where the carried rows go
    final_index: torch.Tensor  # [B, length]: the last `length` rows after the chunk (the new carried state)


@dataclass
class ForwardBatch:
    # Host-side shape information.
    query_lens: list[int]
    query_starts: list[int]
    prefix_lens: list[int]
    page_size: int
    is_decode: bool  # every row runs exactly one token
    max_query_len: int  # longest row of this step (kernel grids)
    max_kv_len: int  # longest prefix + new tokens of this step (kernel grids, split-K)
    # Device tensors.
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    query_start_loc: torch.Tensor  # [B + 1] int32: row b's tokens are [query_start_loc[b], query_start_loc[b + 1])
    seq_ids: torch.Tensor  # [T] int32: the row each token belongs to
    kv_lens: torch.Tensor  # [B] prefix + new tokens
    page_table: torch.Tensor  # [B, W] padded with the dummy page 0
    slot_mapping: torch.Tensor  # [T] KV row written by each token
    state_slots: torch.Tensor  # [B]
    has_initial_state: torch.Tensor  # [B] bool
    logits_indices: torch.Tensor  # [N] token rows whose logits are wanted
    page_offsets: torch.Tensor  # [page_size] arange, to expand pages into rows
    page_end_tokens: torch.Tensor  # [F] packed token index of the last token of every page this step fills
    page_end_pages: torch.Tensor  # [F] the page each of those tokens completes
    token_history: TokenHistory | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def kv_slots(self, seq: int, kv_len: int) -> torch.Tensor:
        """KV rows of positions [0, kv_len) of one sequence."""
        pages = self.page_table[seq, : -(-kv_len // self.page_size)]
        return (pages[:, None] * self.page_size + self.page_offsets[None, :]).flatten()[:kv_len]

    def padded_kv_slots(self) -> torch.Tensor:
        """[B, W * page_size] KV rows of every row's page table; rows past kv_len point into valid pages."""
        rows = self.page_table[:, :, None] * self.page_size + self.page_offsets[None, None, :]
        return rows.flatten(1)


def _device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _token_history(chunks: list[ScheduledChunk], length: int, device: torch.device) -> TokenHistory:
    token_index, history_index, final_index = [], [], []
    row = 0
    for chunk in chunks:
        history_index.append(list(range(row, row + length)))
        row += length
        token_index.extend(range(row, row + len(chunk.token_ids)))
        row += len(chunk.token_ids)
        final_index.append(list(range(row - length, row)))
    return TokenHistory(
        length=length,
        total_rows=row,
        token_index=_device_tensor(token_index, torch.long, device),
        history_index=_device_tensor(history_index, torch.long, device),
        final_index=_device_tensor(final_index, torch.long, device),
    )


def build_forward_batch(chunks: list[ScheduledChunk], page_size: int, device: torch.device,
                        history_len: int = 0) -> ForwardBatch:
    """Pack scheduled chunks into one ForwardBatch (host work + non-blocking uploads only)."""
    if not chunks or any(not c.token_ids for c in chunks):
        raise ValueError("a forward batch needs at least one row and every row needs at least one token")
    query_lens = [len(c.token_ids) for c in chunks]
    query_starts = [0, *accumulate(query_lens)][:-1]
    width = max(len(c.page_ids) for c in chunks)
    input_ids, positions, slot_mapping, logits_indices, page_end_tokens, page_end_pages = [], [], [], [], [], []
    seq_ids = [row for row, n in enumerate(query_lens) for _ in range(n)]
    kv_lens = [c.prefix_len + len(c.token_ids) for c in chunks]
    for chunk, start in zip(chunks, query_starts):
        end = chunk.prefix_len + len(chunk.token_ids)
        if len(chunk.page_ids) * page_size < end:
            raise ValueError(f"{len(chunk.page_ids)} pages cannot hold {end} tokens")
        input_ids.extend(chunk.token_ids)
        for pos in range(chunk.prefix_len, end):
            positions.append(pos)
            slot_mapping.append(chunk.page_ids[pos // page_size] * page_size + pos % page_size)
            if (pos + 1) % page_size == 0:
                page_end_tokens.append(start + pos - chunk.prefix_len)
                page_end_pages.append(chunk.page_ids[pos // page_size])
        logits_indices.extend(start + i for i in chunk.logits_offsets)
    return ForwardBatch(
        query_lens=query_lens,
        query_starts=query_starts,
        prefix_lens=[c.prefix_len for c in chunks],
        page_size=page_size,
        is_decode=all(n == 1 for n in query_lens),
        max_query_len=max(query_lens),
        max_kv_len=max(kv_lens),
        input_ids=_device_tensor(input_ids, torch.long, device),
        positions=_device_tensor(positions, torch.long, device),
        query_start_loc=_device_tensor([*query_starts, query_starts[-1] + query_lens[-1]], torch.int32, device),
        seq_ids=_device_tensor(seq_ids, torch.int32, device),
        kv_lens=_device_tensor(kv_lens, torch.long, device),
        page_table=_device_tensor([c.page_ids + [0] * (width - len(c.page_ids)) for c in chunks], torch.long, device),
        slot_mapping=_device_tensor(slot_mapping, torch.long, device),
        state_slots=_device_tensor([c.state_slot for c in chunks], torch.long, device),
        has_initial_state=_device_tensor([c.has_initial_state for c in chunks], torch.bool, device),
        logits_indices=_device_tensor(logits_indices, torch.long, device),
        page_offsets=torch.arange(page_size, device=device),
        page_end_tokens=_device_tensor(page_end_tokens, torch.long, device),
        page_end_pages=_device_tensor(page_end_pages, torch.long, device),
        token_history=_token_history(chunks, history_len, device) if history_len else None,
    )
