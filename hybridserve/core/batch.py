"""ForwardBatch: one packed forward pass described as data, and the device packing that builds it.

The scheduler describes each row as a `ScheduledChunk` (core/chunk.py, host lists only). `build_forward_batch`
turns them into flat device tensors plus the host-side lengths that fix every shape, so that no layer ever reads a device value
back to the host. Rows are packed without padding: prefill chunks of any length and decode rows of one token may
share a batch.
"""
from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass, field
from itertools import accumulate, chain

import torch

from hybridserve.core.chunk import ScheduledChunk
from hybridserve.core.upload import upload


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
class VerifyLayout:
    """The verify rows of a batch (speculative decoding): where the recurrent state after each of their tokens goes.

    A verify row's state after its token j is written to `token_slots` of that token (its working slot for j = 0,
    an intermediate slot for each draft), and its state after the whole row is *not* written to its working slot;
    the committed state is chosen after acceptance (`spec.verify.commit_states`). Every other row is unaffected.
    """

    rows: list[int]  # host: the batch rows that verify drafts
    row_index: torch.Tensor  # [R] the same rows on the device
    token_slots: torch.Tensor  # [T] per token: the slot for the state after it, -1 outside verify rows
    tokens: torch.Tensor  # [N] packed indices of the verify rows' tokens, row after row


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
    # The window group's page table and KV rows (models with sliding-window layers; None without a window group).
    window_page_table: torch.Tensor | None = None  # [B, W] like page_table, 0 before each row's window
    window_slot_mapping: torch.Tensor | None = None  # [T]
    verify: VerifyLayout | None = None  # speculative verify rows, if the batch has any
    _window_view: ForwardBatch | None = field(default=None, init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def window_view(self) -> ForwardBatch:
        """The batch as a sliding-window layer sees it: the window group's page table and KV rows in place of the
        full group's (the batch itself when the caches have no window group)."""
        if self.window_page_table is None:
            return self
        if self._window_view is None:
            self._window_view = dataclasses.replace(self, page_table=self.window_page_table,
                                                    slot_mapping=self.window_slot_mapping)
        return self._window_view

    def kv_slots(self, seq: int, kv_len: int) -> torch.Tensor:
        """KV rows of positions [0, kv_len) of one sequence."""
        pages = self.page_table[seq, : -(-kv_len // self.page_size)]
        return (pages[:, None] * self.page_size + self.page_offsets[None, :]).flatten()[:kv_len]

    def padded_kv_slots(self) -> torch.Tensor:
        """[B, W * page_size] KV rows of every row's page table; rows past kv_len point into valid pages."""
        rows = self.page_table[:, :, None] * self.page_size + self.page_offsets[None, None, :]
        return rows.flatten(1)


_ARRAY_CODES = {torch.long: "q", torch.int32: "i", torch.bool: "b"}


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """`values` as a CPU tensor. A flat list goes through array.array, which converts a list of ints about three
    times faster than torch.tensor (0.19 against 0.62 ms for 8,192 of them on the CPU VM); nested lists (tables)
    through torch.tensor."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not values or isinstance(values[0], list):
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array(code, values), dtype=dtype)


class HostPack:
    """Every per-step index tensor packed into one pinned host buffer and moved with one host-to-device copy.

    Segments start on 16-byte boundaries, so each is a typed view of the same device buffer (int64, int32 or bool)
    with the alignment Triton specialises pointers on: a kernel compiled at start-up is the one every step reuses.
    """

    def __init__(self) -> None:
        self._segments: list[tuple[str, torch.dtype, torch.Tensor]] = []

    def add(self, name: str, values: list, dtype: torch.dtype = torch.long) -> None:
        self._segments.append((name, dtype, host_tensor(values, dtype)))

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


class GroupTable:
    """One KV group's page table on the device, one row per running sequence plus the all-dummy `dummy_row`.

    A step writes only what changed in a row since the step before: the pages appended to it, and (window group)
    the entries of pages the sequence released, set back to the dummy page 0. Released pages are always a prefix
    of the row (positions that fell out of the window), so a row's change is found without scanning it whole.
    """

    def __init__(self, max_rows: int, max_pages: int, device: torch.device):
        self.pages = torch.zeros(max_rows + 1, max_pages, dtype=torch.long, device=device)  # padded with page 0
        self._synced = [0] * max_rows  # entries of each row already on the device (0: a new row)
        self._cleared = [0] * max_rows  # leading entries known to be 0 on the device

    def reset(self, row: int) -> None:
        self._synced[row] = self._cleared[row] = 0

    def truncate(self, row: int, pages: int) -> None:
        """The row's sequence gave back its pages from column `pages` on: later pages there are new entries."""
        self._synced[row] = min(self._synced[row], pages)
        self._cleared[row] = min(self._cleared[row], pages)

    def updates(self, row: int, page_ids: list[int], cols: list[int], pages: list[int]) -> None:
        """Append to (cols, pages) the entries of `row` to write for `page_ids`."""
        if len(page_ids) > self.pages.shape[1]:
            raise ValueError(f"{len(page_ids)} pages exceed the page table's width {self.pages.shape[1]}")
        synced, cleared = self._synced[row], self._cleared[row]
        while cleared < synced and page_ids[cleared] == 0:  # released since the last step
            cols.append(cleared)
            pages.append(0)
            cleared += 1
        cols.extend(range(synced, len(page_ids)))
        pages.extend(page_ids[synced:])
        if cleared == synced:
            while cleared < len(page_ids) and page_ids[cleared] == 0:
                cleared += 1
        self._synced[row], self._cleared[row] = len(page_ids), cleared


class PageTables:
    """The page tables (one per KV group) and the state-slot table on the device, one row per running sequence,
    kept across steps.

    The scheduler gives each running sequence a table row for as long as it runs (`ScheduledChunk.table_row`) and
    names the rows it handed to a new sequence since the last step (`reset`). A step then uploads only the entries
    that changed in each row since the step before (`GroupTable`), and the row's slot when the row is new; the
    batch's page tables are gathers of its rows. CUDA graphs replay over these same tensors.

    One more row than sequences, `dummy_row`, stays all page 0 and slot 0 (the dummies): the padding rows of a
    CUDA-graph decode batch point at it.
    """

    def __init__(self, max_rows: int, max_pages: int, device: torch.device, window: bool = False):
        self.full = GroupTable(max_rows, max_pages, device)
        self.window = GroupTable(max_rows, max_pages, device) if window else None
        self.slots = torch.zeros(max_rows + 1, dtype=torch.long, device=device)
        self.dummy_row = max_rows
        self._new = [True] * max_rows  # rows whose slot is not on the device yet

    def reset(self, rows: list[int]) -> None:
        for row in rows:
            self._new[row] = True
            for group in (self.full, self.window):
                if group is not None:
                    group.reset(row)

    def truncate(self, rows: list[tuple[int, int]]) -> None:
        """(row, pages kept) of sequences that gave back their last pages (`GroupTable.truncate`)."""
        for row, pages in rows:
            for group in (self.full, self.window):
                if group is not None:
                    group.truncate(row, pages)

    def pack_updates(self, chunks: list[ScheduledChunk], pack: HostPack) -> None:
        """Add this step's changed entries and the chunks' table rows to `pack`, for `apply`."""
        pack.add("table_rows", [c.table_row for c in chunks])
        for name, values in self._changes(chunks):
            pack.add(name, values)

    def _changes(self, chunks: list[ScheduledChunk]) -> list[tuple[str, list[int]]]:
        """This step's changed entries (named as `apply` reads them), marked as synced."""
        rows, cols, pages, slot_rows, slots = [], [], [], [], []
        w_rows, w_cols, w_pages = [], [], []
        for chunk in chunks:
            row = chunk.table_row
            if self._new[row]:
                slot_rows.append(row)
                slots.append(chunk.state_slot)
                self._new[row] = False
            before = len(cols)
            self.full.updates(row, chunk.page_ids, cols, pages)
            rows.extend([row] * (len(cols) - before))
            if self.window is not None:
                before = len(w_cols)
                self.window.updates(row, chunk.window_page_ids, w_cols, w_pages)
                w_rows.extend([row] * (len(w_cols) - before))
        named = [("update_rows", rows), ("update_cols", cols), ("update_pages", pages), ("slot_rows", slot_rows),
                 ("slots", slots)]
        if self.window is not None:
            named += [("window_rows", w_rows), ("window_cols", w_cols), ("window_pages", w_pages)]
        return named

    def apply(self, uploaded: dict[str, torch.Tensor]) -> None:
        """Write the entries `pack_updates` packed (now on the device) into the tables."""
        self.full.pages.index_put_((uploaded["update_rows"], uploaded["update_cols"]), uploaded["update_pages"])
        if self.window is not None:
            self.window.pages.index_put_((uploaded["window_rows"], uploaded["window_cols"]), uploaded["window_pages"])
        self.slots.index_put_((uploaded["slot_rows"],), uploaded["slots"])

    def upload_updates(self, chunks: list[ScheduledChunk]) -> None:
        """This step's changed entries written into the tables in one upload of their own (a CUDA-graph step, which
        builds no batch); nothing at all on the steps where no row changed (most decode steps: a row gains a page
        every page_size tokens). Packing, pinning and copying empty lists was a fifth of a batch-1 decode step's
        host work under cProfile (H200, 40 layers)."""
        changes = self._changes(chunks)
        if not any(values for _, values in changes):
            return
        pack = HostPack()
        for name, values in changes:
            pack.add(name, values)
        self.apply(pack.upload(self.slots.device))


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


def kv_row(page_ids: list[int], pos: int, page_size: int) -> int:
    """The KV cache row of position `pos` of a sequence whose pages are `page_ids`."""
    return page_ids[pos // page_size] * page_size + pos % page_size


def kv_rows(page_ids: list[int], start: int, end: int, page_size: int) -> list[int]:
    """The KV cache rows of positions [start, end), a range per page (a prefill chunk's thousands of positions
    took milliseconds of host time one by one)."""
    rows = []
    while start < end:
        page = start // page_size
        stop = min(end, (page + 1) * page_size)
        offset = (page_ids[page] - page) * page_size
        rows.extend(range(offset + start, offset + stop))
        start = stop
    return rows


def token_history(chunks: list[ScheduledChunk], length: int, device: torch.device) -> TokenHistory:
    """The TokenHistory of rows shaped like `chunks` (only their token counts matter)."""
    total_rows, token_index, history_index, final_index = _token_history_rows(chunks, length)
    return TokenHistory(length, total_rows, *(torch.tensor(index, device=device)
                                              for index in (token_index, history_index, final_index)))


def decode_token_history(rows: int, length: int, device: torch.device, row_tokens: int = 1) -> TokenHistory:
    """The TokenHistory of `rows` rows of `row_tokens` tokens each (it depends on nothing else: CUDA-graph decode
    and verify batches)."""
    return token_history([ScheduledChunk([0] * row_tokens, 0, [], 0, False)] * rows, length, device)


def page_ends(chunk: ScheduledChunk, start: int, page_size: int) -> tuple[list[int], list[int]]:
    """(packed token index, page) of every page the chunk fills up, its first token packed at `start`."""
    prefix = chunk.prefix_len
    ends = range((prefix // page_size + 1) * page_size - 1, prefix + len(chunk.token_ids), page_size)
    return [start + pos - prefix for pos in ends], [chunk.page_ids[pos // page_size] for pos in ends]


def verify_token_slots(chunks: list[ScheduledChunk]) -> list[int]:
    """Per packed token: the slot its state goes to in a verify row (the working slot, then the draft slots), -1 in
    other rows."""
    slots = []
    for chunk in chunks:
        if chunk.draft_slots:
            if len(chunk.token_ids) != 1 + chunk.num_drafts:
                raise ValueError(f"a verify row runs its last token and {chunk.num_drafts} drafts, not "
                                 f"{len(chunk.token_ids)} tokens")
            slots += chunk.verify_slots
        else:
            slots += [-1] * len(chunk.token_ids)
    return slots


def future_inputs(chunks: list[ScheduledChunk], starts: list[int]) -> tuple[list[int], list[int]]:
    """(input rows, indices into the previous step's draws) of the chunks' last tokens still being drawn; `starts`
    are the chunks' first rows in the step's input ids."""
    rows, sources = [], []
    for chunk, start in zip(chunks, starts):
        if chunk.future_token is not None:
            rows.append(start + len(chunk.token_ids) - 1)
            sources.append(chunk.future_token)
    return rows, sources


def resolve_future_inputs(input_ids: torch.Tensor, rows: list[int], sources: list[int],
                          previous: torch.Tensor | None,
                          index: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write the previous step's drawn tokens into the input rows that wait for them (device to device): one copy
    where the rows and their sources are both runs of consecutive indices (a decode step whose rows drew in the same
    order the step before: the steady state), else a gather through `index`, (rows, sources) on the device (uploaded
    here when None)."""
    if not rows:
        return
    if previous is None:
        raise RuntimeError("a chunk waits for a token of a step that drew nothing")
    count = len(rows)
    if is_run(rows) and is_run(sources):
        input_ids[rows[0]:rows[0] + count].copy_(previous[sources[0]:sources[0] + count])
        return
    if index is None:
        index = upload([rows, sources], input_ids.device, torch.long)
    input_ids.index_copy_(0, index[0], previous.index_select(0, index[1]))


def is_run(values: list[int]) -> bool:
    """Whether non-empty `values` are consecutive ascending indices: a slice then stands for an index tensor."""
    return values == list(range(values[0], values[0] + len(values)))


def build_forward_batch(chunks: list[ScheduledChunk], page_size: int, device: torch.device,
                        history_len: int = 0, tables: PageTables | None = None,
                        previous_draws: torch.Tensor | None = None) -> ForwardBatch:
    """Pack scheduled chunks into one ForwardBatch: host work, then one non-blocking upload.

    With `tables` (the engine) the page tables and the slots come from the persistent device tables, updated by
    this step's changed entries; without (tests driving a model by hand) they are built from the chunks' lists.
    Chunks with `window_page_ids` also give the window group's page table and KV rows. Chunks with a
    `future_token` take that input from `previous_draws`, the step before's tokens on the device.
    """
    if not chunks or any(not c.token_ids for c in chunks):
        raise ValueError("a forward batch needs at least one row and every row needs at least one token")
    query_lens = [len(c.token_ids) for c in chunks]
    query_starts = [0, *accumulate(query_lens)][:-1]
    width = max(len(c.page_ids) for c in chunks)
    input_ids, positions, slot_mapping, logits_indices, page_end_tokens, page_end_pages = [], [], [], [], [], []
    seq_ids = list(chain.from_iterable([row] * n for row, n in enumerate(query_lens)))
    kv_lens = [c.prefix_len + len(c.token_ids) for c in chunks]
    window = chunks[0].window_page_ids is not None
    window_slots = []
    verify_rows = [row for row, c in enumerate(chunks) if c.draft_slots]
    for chunk, start in zip(chunks, query_starts):
        end = chunk.prefix_len + len(chunk.token_ids)
        if len(chunk.page_ids) * page_size < end:
            raise ValueError(f"{len(chunk.page_ids)} pages cannot hold {end} tokens")
        if window and (chunk.window_page_ids is None or len(chunk.window_page_ids) != len(chunk.page_ids)):
            raise ValueError("every chunk needs one window page entry per page when the caches have a window group")
        input_ids.extend(chunk.token_ids)
        positions.extend(range(chunk.prefix_len, end))
        slot_mapping += kv_rows(chunk.page_ids, chunk.prefix_len, end, page_size)
        if window:
            window_slots += kv_rows(chunk.window_page_ids, chunk.prefix_len, end, page_size)
        ends, pages = page_ends(chunk, start, page_size)
        page_end_tokens += ends
        page_end_pages += pages
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
    if window:
        pack.add("window_slot_mapping", window_slots)
    if verify_rows:
        pack.add("verify_rows", verify_rows)
        pack.add("verify_token_slots", verify_token_slots(chunks))
        pack.add("verify_tokens", [t for row in verify_rows
                                   for t in range(query_starts[row], query_starts[row] + query_lens[row])])
    if tables is None:
        pack.add("page_table", [c.page_ids + [0] * (width - len(c.page_ids)) for c in chunks])
        if window:
            pack.add("window_page_table", [c.window_page_ids + [0] * (width - len(c.page_ids)) for c in chunks])
        pack.add("state_slots", [c.state_slot for c in chunks])
    else:
        if (tables.window is not None) != window:
            raise ValueError("the chunks' window pages and the page tables' window group disagree")
        tables.pack_updates(chunks, pack)
    future_rows, future_sources = future_inputs(chunks, query_starts)
    if future_rows:
        pack.add("future_rows", future_rows)
        pack.add("future_sources", future_sources)
    if history_len:
        total_rows, token_index, history_index, final_index = _token_history_rows(chunks, history_len)
        pack.add("token_index", token_index)
        pack.add("history_index", history_index)
        pack.add("final_index", final_index)
    t = pack.upload(device)
    if future_rows:
        resolve_future_inputs(t["input_ids"], future_rows, future_sources, previous_draws,
                              (t["future_rows"], t["future_sources"]))
    if tables is not None:
        tables.apply(t)
        page_table = tables.full.pages[:, :width].index_select(0, t["table_rows"])
        window_table = tables.window.pages[:, :width].index_select(0, t["table_rows"]) if window else None
        state_slots = tables.slots.index_select(0, t["table_rows"])
    else:
        page_table, state_slots, window_table = t["page_table"], t["state_slots"], t.get("window_page_table")
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
        window_page_table=window_table,
        window_slot_mapping=t.get("window_slot_mapping"),
        verify=VerifyLayout(verify_rows, t["verify_rows"], t["verify_token_slots"],
                                                       t["verify_tokens"]) if verify_rows else None,
    )
