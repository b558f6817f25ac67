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
    table_row: int = 0  # the sequence's row in the device PageTables while it runs (engine steps only)


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


class HostPack:
    """Every per-step index tensor packed into one pinned host buffer and moved with one host-to-device copy.

    Segments start on 16-byte boundaries, so each is a typed view of the same device buffer (int64, int32 or bool)
    with the alignment Triton specialises pointers on: a kernel compiled at start-up is the one every step reuses.
    """

    def __init__(self) -> None:
        self._segments: list[tuple[str, torch.dtype, torch.Tensor]] = []

    def add(self, name: str, values: list, dtype: torch.dtype = torch.long) -> None:
        self._segments.append((name, dtype, torch.tensor(values, dtype=dtype)))

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        offsets, total = [], 0
        for _, _, host in self._segments:
            offsets.append(total)
            total += -(-host.numel() * host.element_size() // 16) * 16
        buffer = torch.empty(max(total, 16), dtype=torch.uint8, pin_memory=device.type == "cuda")
        for (_, dtype, host), offset in zip(self._segments, offsets):
            nbytes = host.numel() * host.element_size()
            buffer[offset:offset + nbytes].view(dtype).view(host.shape).copy_(host)
        buffer = buffer.to(device, non_blocking=True)
        views = {}
        for (name, dtype, host), offset in zip(self._segments, offsets):
            nbytes = host.numel() * host.element_size()
            views[name] = buffer[offset:offset + nbytes].view(dtype).view(host.shape)
        return views


class PageTables:
    """The page table and the state-slot table on the device, one row per running sequence, kept across steps.

    The scheduler gives each running sequence a table row for as long as it runs (`ScheduledChunk.table_row`) and
    names the rows it handed to a new sequence since the last step (`reset`). A step then uploads only the pages
    appended to each row since the step before, and the row's slot when the row is new; the batch's page table is
    a gather of its rows. CUDA graphs replay over these same tensors.

    One more row than sequences, `dummy_row`, stays all page 0 and slot 0 (the dummies): the padding rows of a
    CUDA-graph decode batch point at it.
    """

    def __init__(self, max_rows: int, max_pages: int, device: torch.device):
        self.pages = torch.zeros(max_rows + 1, max_pages, dtype=torch.long, device=device)  # padded with page 0
        self.slots = torch.zeros(max_rows + 1, dtype=torch.long, device=device)
        self.dummy_row = max_rows
        self._synced = [0] * max_rows  # pages of each row already on the device (0: a new row)

    def reset(self, rows: list[int]) -> None:
        for row in rows:
            self._synced[row] = 0

    def updates(self, chunks: list[ScheduledChunk]) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """(rows, columns, pages) of the entries to write, and (rows, slots) of rows whose slot is new."""
        rows, cols, pages, slot_rows, slots = [], [], [], [], []
        for chunk in chunks:
            row, synced = chunk.table_row, self._synced[chunk.table_row]
            if len(chunk.page_ids) > self.pages.shape[1]:
                raise ValueError(f"{len(chunk.page_ids)} pages exceed the page table's width {self.pages.shape[1]}")
            if synced == 0:
                slot_rows.append(row)
                slots.append(chunk.state_slot)
            new = chunk.page_ids[synced:]
            rows.extend([row] * len(new))
            cols.extend(range(synced, len(chunk.page_ids)))
            pages.extend(new)
            self._synced[row] = len(chunk.page_ids)
        return rows, cols, pages, slot_rows, slots

    def pack_updates(self, chunks: list[ScheduledChunk], pack: HostPack) -> None:
        """Add this step's new entries (`updates`) and the chunks' table rows to `pack`, for `apply`."""
        rows, cols, pages, slot_rows, slots = self.updates(chunks)
        pack.add("table_rows", [c.table_row for c in chunks])
        for name, values in (("update_rows", rows), ("update_cols", cols), ("update_pages", pages),
                             ("slot_rows", slot_rows), ("slots", slots)):
            pack.add(name, values)

    def apply(self, uploaded: dict[str, torch.Tensor]) -> None:
        """Write the entries `pack_updates` packed (now on the device) into the tables."""
        self.pages.index_put_((uploaded["update_rows"], uploaded["update_cols"]), uploaded["update_pages"])
        self.slots.index_put_((uploaded["slot_rows"],), uploaded["slots"])

    def upload_updates(self, chunks: list[ScheduledChunk]) -> None:
        """`pack_updates` + `apply` in one upload of their own (a CUDA-graph step, which builds no batch)."""
        pack = HostPack()
        self.pack_updates(chunks, pack)
        self.apply(pack.upload(self.pages.device))


def _token_history_rows(chunks: list[ScheduledChunk], length: int) -> tuple[int, list[int], list, list]:
    """(total rows, token_index, history_index, final_index) of the extended layout."""
    token_index, history_index, final_index = [], [], []
    row = 0
    for chunk in chunks:
        history_index.append(list(range(row, row + length)))
        row += length
        token_index.extend(range(row, row + len(chunk.token_ids)))
        row += len(chunk.token_ids)
        final_index.append(list(range(row - length, row)))
    return row, token_index, history_index, final_index


def decode_token_history(rows: int, length: int, device: torch.device) -> TokenHistory:
    """The TokenHistory of `rows` one-token rows (it depends on nothing else: CUDA-graph decode batches)."""
    total_rows, token_index, history_index, final_index = _token_history_rows(
        [ScheduledChunk([0], 0, [], 0, False)] * rows, length)
    return TokenHistory(length, total_rows, *(torch.tensor(index, device=device)
                                              for index in (token_index, history_index, final_index)))


def build_forward_batch(chunks: list[ScheduledChunk], page_size: int, device: torch.device,
                        history_len: int = 0, tables: PageTables | None = None) -> ForwardBatch:
    """Pack scheduled chunks into one ForwardBatch: host work, then one non-blocking upload.

    With `tables` (the engine) the page table and the slots come from the persistent device tables, updated by
    this step's new entries; without (tests driving a model by hand) they are built from the chunks' lists.
    """
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
    pack = HostPack()
    pack.add("input_ids", input_ids)
    pack.add("positions", positions)
    pack.add("query_start_loc", [*query_starts, query_starts[-1] + query_lens[-1]], torch.int32)
    pack.add("seq_ids", seq_ids, torch.int32)
    pack.add("kv_lens", kv_lens)
    pack.add("slot_mapping", slot_mapping)
    pack.add("has_initial_state", [c.has_initial_state for c in chunks], torch.bool)
    pack.add("logits_indices", logits_indices)
    pack.add("page_offsets", list(range(page_size)))
    pack.add("page_end_tokens", page_end_tokens)
    pack.add("page_end_pages", page_end_pages)
    if tables is None:
        pack.add("page_table", [c.page_ids + [0] * (width - len(c.page_ids)) for c in chunks])
        pack.add("state_slots", [c.state_slot for c in chunks])
    else:
        tables.pack_updates(chunks, pack)
    if history_len:
        total_rows, token_index, history_index, final_index = _token_history_rows(chunks, history_len)
        pack.add("token_index", token_index)
        pack.add("history_index", history_index)
        pack.add("final_index", final_index)
    t = pack.upload(device)
    if tables is not None:
        tables.apply(t)
        page_table = tables.pages[:, :width].index_select(0, t["table_rows"])
        state_slots = tables.slots.index_select(0, t["table_rows"])
    else:
        page_table, state_slots = t["page_table"], t["state_slots"]
    history = None
    if history_len:
        history = TokenHistory(length=history_len, total_rows=total_rows, token_index=t["token_index"],
                               history_index=t["history_index"], final_index=t["final_index"])
    return ForwardBatch(
        query_lens=query_lens,
        query_starts=query_starts,
        prefix_lens=[c.prefix_len for c in chunks],
        page_size=page_size,
        is_decode=all(n == 1 for n in query_lens),
        max_query_len=max(query_lens),
        max_kv_len=max(kv_lens),
        input_ids=t["input_ids"],
        positions=t["positions"],
        query_start_loc=t["query_start_loc"],
        seq_ids=t["seq_ids"],
        kv_lens=t["kv_lens"],
        page_table=page_table,
        slot_mapping=t["slot_mapping"],
        state_slots=state_slots,
        has_initial_state=t["has_initial_state"],
        logits_indices=t["logits_indices"],
        page_offsets=t["page_offsets"],
        page_end_tokens=t["page_end_tokens"],
        page_end_pages=t["page_end_pages"],
        token_history=history,
    )
