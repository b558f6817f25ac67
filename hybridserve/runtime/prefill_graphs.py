"""Prefill steps of one row replayed from CUDA graphs, one graph per token bucket.

An eager prefill step is bound by the host, not the device: on the H200 a 512-token prompt's step over 40
ZAYA1-8B layers took 45 ms to queue its ~560 Triton launches and the cuBLAS and torch ops around them, where the
device ran them in 7.7 ms (benchmarks/prefill_host.py). A step of one row is what a lone request's prompt runs:
batch-1 time to first token, an idle server's next request, a long prompt's chunks when nothing else runs. Such a
step of L tokens (L <= the largest size) replays the graph of the smallest size >= L. The size - L tokens after the
row form a second row, the padding row, on the dummies (page 0 through the page tables' dummy row, state slot 0),
as a decode graph's padding rows; it is empty when L is the size.

Shapes come from the size alone: the kernels see 2 rows of up to `size` tokens (grids, tiles) and max_model_len
keys (the attention's key splits, as in decode graphs: splits past the row's keys are empty). Everything else is
read from static device buffers written by one host-to-device copy before the replay: tokens, positions, KV rows,
the row boundaries, key counts, the initial-state flag, the wanted logits position; the page table and the state
slot are gathered inside the graph from the persistent `PageTables`. Only models whose prefill forward reads no
other host value take part (`model.prefill_graphs`).

Without `capture` (CPU tests) the same static-buffer forward runs eagerly. With every op on its kernel the batch
then carries the same placeholder host fields as a captured one; with torch references it carries the step's own
(the references walk rows on the host and read the conv's token-history layout and the page ends).
"""
from __future__ import annotations

import logging
import time

import torch

from hybridserve.core.batch import (
    ForwardBatch,
    PageTables,
    ScheduledChunk,
    future_inputs,
    kv_rows,
    page_ends,
    resolve_future_inputs,
    token_history,
)
from hybridserve.core.upload import upload
from hybridserve.ops.backends import all_triton
from hybridserve.runtime.warmup import DUMMY_PAGE, DUMMY_SLOT, dummy_row

logger = logging.getLogger(__name__)

MIN_SIZE = 16


def prefill_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, ... up to `max_tokens`, and `max_tokens` itself; none below 16 tokens (such small steps cost
    little to launch eagerly)."""
    if max_tokens < MIN_SIZE:
        return []
    sizes, n = {max_tokens}, MIN_SIZE
    while n <= max_tokens:
        sizes.add(n)
        n *= 2
    return sorted(sizes)


def bounded_shape(size: int, max_kv_len: int) -> dict:
    """The host shape fields of a graph batch of `size` tokens: 2 rows of up to `size` query tokens (the row and
    its padding row) and `max_kv_len` keys (the attention plans its key splits for that many)."""
    return dict(query_lens=[size, 0], query_starts=[0, size], prefix_lens=[max_kv_len - size, 0],
                max_query_len=size, max_kv_len=max_kv_len)


def _segments(tokens: int, window: bool) -> list[tuple[str, torch.dtype, int]]:
    """(field, dtype, elements) of the static input buffer, per-token fields sized for `tokens`."""
    fields = [(name, torch.long, tokens) for name in ("input_ids", "positions", "slot_mapping")]
    if window:
        fields.append(("window_slot_mapping", torch.long, tokens))
    return fields + [("kv_lens", torch.long, 2), ("table_rows", torch.long, 2), ("logits_index", torch.long, 1),
                     ("query_start_loc", torch.int32, 3), ("seq_ids", torch.int32, tokens),
                     ("has_initial_state", torch.bool, 2)]


def _views(buffer: torch.Tensor, segments: list[tuple[str, torch.dtype, int]]) -> dict[str, torch.Tensor]:
    """Typed views of a uint8 buffer laid out by `segments`, each on a 16-byte boundary (the alignment Triton
    specialises pointers on)."""
    views, offset = {}, 0
    for name, dtype, count in segments:
        nbytes = count * dtype.itemsize
        views[name] = buffer[offset:offset + nbytes].view(dtype)
        offset += -(-nbytes // 16) * 16
    return views


def _nbytes(segments: list[tuple[str, torch.dtype, int]]) -> int:
    return sum(-(-count * dtype.itemsize // 16) * 16 for _, dtype, count in segments)


class PrefillGraphs:
    """Static inputs for one row of up to `sizes[-1]` tokens plus its padding row and (with `capture`) a CUDA graph
    per size, all in one memory pool."""

    def __init__(self, model, tables: PageTables, page_size: int, max_model_len: int, sizes: list[int],
                 device: torch.device, capture: bool, pool=None, placeholders: bool | None = None):
        """`placeholders`: give the batch host fields bounded by the size (default: when captured, or when every op
        runs its kernel; the torch references need the step's own)."""
        if not sizes:
            raise ValueError("prefill graphs need at least one size")
        self.model, self.tables, self.page_size, self.max_model_len = model, tables, page_size, max_model_len
        self.sizes, self.device = sizes, device
        self.placeholders = capture or all_triton() if placeholders is None else placeholders
        self._segments = _segments(sizes[-1], tables.window is not None)
        nbytes = _nbytes(self._segments)
        # Two pinned host twins, used in turn: a step's copy may still be queued while the next step is filled.
        self._host = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda") for _ in range(2)]
        self._turn = 0
        self._static = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._inputs = _views(self._static, self._segments)
        self._page_offsets = torch.arange(page_size, device=device)
        self._no_tokens = torch.zeros(0, dtype=torch.long, device=device)
        self._chunk: ScheduledChunk | None = None  # the step's row (the references' host fields)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0  # what the captured graphs added to the pool
        if capture:
            self._capture(pool if pool is not None else torch.cuda.graph_pool_handle())

    def size_for(self, tokens: int) -> int | None:
        return next((size for size in self.sizes if size >= tokens), None)

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a step replays these graphs: one row, not verifying drafts, wanting at most one logits row
        (prompt logprobs run eagerly), with a size for its tokens."""
        if len(chunks) != 1:
            return False
        chunk = chunks[0]
        return not chunk.num_drafts and len(chunk.logits_offsets) <= 1 and \
            self.size_for(len(chunk.token_ids)) is not None

    def _host_fields(self, size: int) -> dict:
        """The batch's host-side shape fields: bounds that depend on the size alone (captured graphs, kernels), or
        the step's own (torch references)."""
        if self.placeholders:
            return bounded_shape(size, self.max_model_len) | dict(
                token_history=None, page_end_tokens=self._no_tokens, page_end_pages=self._no_tokens)
        chunk = self._chunk
        n, prefix = len(chunk.token_ids), chunk.prefix_len
        pad = ScheduledChunk([0] * (size - n), 0, [], DUMMY_SLOT, False)
        ends, pages = page_ends(chunk, 0, self.page_size)
        history = self.model.history_len
        return dict(query_lens=[n, size - n], query_starts=[0, n], prefix_lens=[prefix, 0],
                    max_query_len=max(n, size - n), max_kv_len=max(prefix + n, size - n),
                    token_history=token_history([chunk, pad], history, self.device) if history else None,
                    page_end_tokens=upload(ends, self.device, torch.long),
                    page_end_pages=upload(pages, self.device, torch.long))

    def _batch(self, size: int) -> ForwardBatch:
        inputs, tables = self._inputs, self.tables
        rows = inputs["table_rows"]
        window = tables.window
        return ForwardBatch(
            **self._host_fields(size), page_size=self.page_size, is_decode=False,
            input_ids=inputs["input_ids"][:size], positions=inputs["positions"][:size],
            query_start_loc=inputs["query_start_loc"], seq_ids=inputs["seq_ids"][:size], kv_lens=inputs["kv_lens"],
            page_table=tables.full.pages.index_select(0, rows), slot_mapping=inputs["slot_mapping"][:size],
            state_slots=tables.slots.index_select(0, rows), has_initial_state=inputs["has_initial_state"],
            logits_indices=inputs["logits_index"], page_offsets=self._page_offsets,
            window_page_table=window.pages.index_select(0, rows) if window is not None else None,
            window_slot_mapping=inputs["window_slot_mapping"][:size] if window is not None else None)

    def _forward(self, size: int) -> torch.Tensor:
        batch = self._batch(size)
        hidden = self.model(batch)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

    def _capture(self, pool) -> None:
        page = self.page_size
        start = time.perf_counter()
        for size in self.sizes:  # eager once: compiles any kernel variant the capture would otherwise meet first
            row = dummy_row(size, 0, page)
            row.table_row = self.tables.dummy_row
            row.window_page_ids = list(row.page_ids) if self.tables.window is not None else None
            self._fill(row, size)
            self._forward(size)
            # The fill after next reuses this fill's host twin: its queued copy must have run by then (engine
            # steps are collected before that; these forwards are not).
            torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its blocks
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("CUDA graphs: %d prefill sizes (%s tokens, one row) captured in %.1f s, %.0f MiB",
                    len(self.sizes), ", ".join(map(str, self.sizes)), time.perf_counter() - start,
                    self.memory_bytes / 2**20)

    def _fill(self, chunk: ScheduledChunk, size: int) -> None:
        """Write the step's row, then its padding row up to `size` tokens, into the static buffers."""
        buffer = self._host[self._turn]
        self._turn ^= 1
        host = _views(buffer, self._segments)
        n, prefix, page = len(chunk.token_ids), chunk.prefix_len, self.page_size
        pad = size - n
        positions = range(prefix, prefix + n)
        dummy_kv = [DUMMY_PAGE * page] * pad  # the dummy page's first KV row
        fields = {"input_ids": chunk.token_ids + [0] * pad, "positions": [*positions, *range(pad)],
                  "slot_mapping": kv_rows(chunk.page_ids, prefix, prefix + n, page) + dummy_kv,
                  "kv_lens": [prefix + n, pad], "table_rows": [chunk.table_row, self.tables.dummy_row],
                  "logits_index": chunk.logits_offsets[:1] or [0], "query_start_loc": [0, n, size],
                  "seq_ids": [0] * n + [1] * pad, "has_initial_state": [chunk.has_initial_state, False]}
        if "window_slot_mapping" in host:
            fields["window_slot_mapping"] = kv_rows(chunk.window_page_ids, prefix, prefix + n, page) + dummy_kv
        for name, values in fields.items():
            host[name][:len(values)] = torch.tensor(values, dtype=host[name].dtype)
        self._chunk = chunk
        self._static.copy_(buffer, non_blocking=True)

    def run(self, chunk: ScheduledChunk, previous_draws: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(chunk.logits_offsets), vocab] of a one-row step (the tables already updated). A row with a
        `future_token` reads that input from `previous_draws` (the step before's tokens, on the device)."""
        size = self.size_for(len(chunk.token_ids))
        if size is None:
            raise ValueError(f"{len(chunk.token_ids)} tokens exceed the largest prefill graph's {self.sizes[-1]}")
        self._fill(chunk, size)
        rows, sources = future_inputs([chunk], [0])
        if rows:
            index = upload([rows, sources], self.device, torch.long)
            resolve_future_inputs(self._inputs["input_ids"], index[0], index[1], previous_draws)
        wanted = len(chunk.logits_offsets)
        if not self._graphs:
            return self._forward(size)[:wanted]
        self._graphs[size].replay()
        return self._logits[size][:wanted]
