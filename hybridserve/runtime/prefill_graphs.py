"""Prefill and mixed steps of up to `max_rows` rows replayed from CUDA graphs, one graph per token bucket.

An eager prefill step is bound by the host, not the device: queueing the ~560 Triton launches of a 40-layer
ZAYA1-8B step and the cuBLAS and torch ops around them takes several times as long as running them does
(`python -m benchmarks.offline prefill-host` measures both), so the device waits for the host. A step of rows
whose tokens add up to L (L <= the largest size; each row at most one logits position, no drafts: prompt chunks,
decode rows, both mixed) replays the graph of the smallest size >= L. The size - L tokens after the rows form the
padding row, on the dummies (page 0 through the page tables' dummy row, state slot 0), as a decode graph's padding
rows; it is empty when L is the size. Row slots the step leaves unused are empty rows on the dummies too.

Shapes come from the size alone: the kernels see max_rows + 1 rows, as if the first held all `size` tokens (grids,
tiles; programs past a row's tokens exit), and max_model_len keys (the attention's key splits, as in decode
graphs: splits past a row's keys are empty). Everything else is read from static device buffers written by one
host-to-device copy before the replay: tokens, positions, KV rows, the row boundaries, key counts, initial-state
flags, the wanted logits positions; the page tables and state slots are gathered inside the graph from the
persistent `PageTables`. The copy's pinned source is reused only once that copy has run (core/staging.py): the
chunks of a long prompt draw nothing, so the host queues them far ahead of the device. Only models whose prefill
forward reads no other host value take part (`model.prefill_graphs`).

Sizes double from 16 to 1024 tokens, then grow by 1024, so a large step pads by at most 1024 tokens.

Without `capture` (CPU tests) the same static-buffer forward runs eagerly. With every op on its kernel the batch
then carries the same placeholder host fields as a captured one; with torch references it carries the step's own
(the references walk rows on the host and read the conv's token-history layout and the page ends).
"""
from __future__ import annotations

import functools
import itertools
import logging
import time

import torch

from hybridserve.core.batch import (
    ForwardBatch,
    PageTables,
    future_inputs,
    host_tensor,
    kv_rows,
    page_ends,
    resolve_future_inputs,
    token_history,
)
from hybridserve.core.chunk import ScheduledChunk
from hybridserve.core.staging import StagingBuffers
from hybridserve.core.upload import upload
from hybridserve.models.base import CausalLM
from hybridserve.ops.backends import all_triton
from hybridserve.runtime.cuda_graphs import capture_logits
from hybridserve.runtime.warmup import DUMMY_PAGE, DUMMY_SLOT, dummy_row

logger = logging.getLogger(__name__)

MIN_SIZE = 16
DOUBLING_UP_TO = 1024  # sizes double up to here, then grow by this many tokens
MAX_ROWS = 32  # rows a graph step can hold: more cost the attention idle programs at every size


def prefill_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, ... 1024, then every multiple of 1024 up to `max_tokens`, and `max_tokens` itself; none below 16
    tokens (such small steps cost little to launch eagerly)."""
    if max_tokens < MIN_SIZE:
        return []
    sizes, n = {max_tokens}, MIN_SIZE
    while n <= min(max_tokens, DOUBLING_UP_TO):
        sizes.add(n)
        n *= 2
    sizes.update(range(2 * DOUBLING_UP_TO, max_tokens + 1, DOUBLING_UP_TO))
    return sorted(sizes)


def bounded_shape(size: int, max_kv_len: int, rows: int) -> dict:
    """The host shape fields of a graph batch of `size` tokens in `rows` row slots and the padding row: as if the
    first row held all of them (query blocks per row, key splits), with `max_kv_len` keys."""
    return dict(query_lens=[size] + [0] * rows, query_starts=[0] + [size] * rows,
                prefix_lens=[max_kv_len - size] + [0] * rows, max_query_len=size, max_kv_len=max_kv_len)


def _segments(tokens: int, rows: int, window: bool) -> list[tuple[str, torch.dtype, int]]:
    """(field, dtype, elements) of the static input buffer: per-token fields sized for `tokens`, per-row fields for
    `rows` row slots and the padding row."""
    fields = [(name, torch.long, tokens) for name in ("input_ids", "positions", "slot_mapping")]
    if window:
        fields.append(("window_slot_mapping", torch.long, tokens))
    return fields + [("kv_lens", torch.long, rows + 1), ("table_rows", torch.long, rows + 1),
                     ("logits_index", torch.long, rows), ("query_start_loc", torch.int32, rows + 2),
                     ("seq_ids", torch.int32, tokens), ("has_initial_state", torch.bool, rows + 1)]


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


def _starts(chunks: list[ScheduledChunk]) -> list[int]:
    """Each row's first packed token, then the total."""
    return list(itertools.accumulate((len(chunk.token_ids) for chunk in chunks), initial=0))


class PrefillGraphs:
    """Static inputs for up to `max_rows` rows of `sizes[-1]` tokens in all plus the padding row and (with
    `capture`) a CUDA graph per size, all in one memory pool."""

    def __init__(self, model: CausalLM, tables: PageTables, page_size: int, max_model_len: int, sizes: list[int],
                 max_rows: int, device: torch.device, capture: bool, pool=None, placeholders: bool | None = None):
        """`placeholders`: give the batch host fields bounded by the size (default: when captured, or when every op
        runs its kernel; the torch references need the step's own)."""
        if not sizes or max_rows < 1:
            raise ValueError("prefill graphs need at least one size and one row")
        self.model, self.tables, self.page_size, self.max_model_len = model, tables, page_size, max_model_len
        self.sizes, self.max_rows, self.device = sizes, max_rows, device
        self.placeholders = capture or all_triton() if placeholders is None else placeholders
        self._segments = _segments(sizes[-1], max_rows, tables.window is not None)
        nbytes = _nbytes(self._segments)
        self.staging = StagingBuffers(nbytes, device)  # the host side of the static inputs
        self._static = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._inputs = _views(self._static, self._segments)
        self._page_offsets = torch.arange(page_size, device=device)
        self._no_tokens = torch.zeros(0, dtype=torch.long, device=device)
        self._chunks: list[ScheduledChunk] = []  # the step's rows (the references' host fields)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0  # what the captured graphs added to the pool
        if capture:
            self._capture(pool if pool is not None else torch.cuda.graph_pool_handle())

    def size_for(self, tokens: int) -> int | None:
        return next((size for size in self.sizes if size >= tokens), None)

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a step replays these graphs: 1 to max_rows rows, none verifying drafts or wanting more than one
        logits row (prompt logprobs run eagerly), with a size for their tokens."""
        return 0 < len(chunks) <= self.max_rows and \
            all(not chunk.num_drafts and len(chunk.logits_offsets) <= 1 for chunk in chunks) and \
            self.size_for(sum(len(chunk.token_ids) for chunk in chunks)) is not None

    def _rows(self, size: int) -> list[ScheduledChunk]:
        """The step's rows, its padding row up to `size` tokens, then the unused row slots (empty)."""
        pad = size - sum(len(chunk.token_ids) for chunk in self._chunks)
        empty = self.max_rows - len(self._chunks)
        return self._chunks + [ScheduledChunk([0] * pad, 0, [], DUMMY_SLOT, False)] + \
            [ScheduledChunk([], 0, [], DUMMY_SLOT, False) for _ in range(empty)]

    def _host_fields(self, size: int) -> dict:
        """The batch's host-side shape fields: bounds that depend on the size alone (captured graphs, kernels), or
        the step's own (torch references)."""
        if self.placeholders:
            return bounded_shape(size, self.max_model_len, self.max_rows) | dict(
                token_history=None, page_end_tokens=self._no_tokens, page_end_pages=self._no_tokens)
        rows = self._rows(size)
        starts = _starts(rows)
        ends, pages = [], []
        for chunk, start in zip(self._chunks, starts):
            row_ends, row_pages = page_ends(chunk, start, self.page_size)
            ends += row_ends
            pages += row_pages
        lens = [len(row.token_ids) for row in rows]
        history = self.model.history_len
        return dict(query_lens=lens, query_starts=starts[:-1], prefix_lens=[row.prefix_len for row in rows],
                    max_query_len=max(lens), max_kv_len=max(row.prefix_len + n for row, n in zip(rows, lens)),
                    token_history=token_history(rows, history, self.device) if history else None,
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

    def _forward(self, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
        batch = self._batch(size)
        hidden = self.model(batch)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices), out)

    def _capture(self, pool) -> None:
        page = self.page_size
        start = time.perf_counter()
        for size in self.sizes:  # eager once: compiles any kernel variant the capture would otherwise meet first
            row = dummy_row(size, 0, page)
            row.table_row = self.tables.dummy_row
            row.window_page_ids = list(row.page_ids) if self.tables.window is not None else None
            self._fill([row], size)
            self._forward(size)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        shared = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its blocks
            self._graphs[size], shared = capture_logits(functools.partial(self._forward, size), self.max_rows, pool,
                                                        shared)
            self._logits[size] = shared  # max_rows rows at every size
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("CUDA graphs: %d prefill sizes (%s tokens, up to %d rows) captured in %.1f s, %.0f MiB",
                    len(self.sizes), ", ".join(map(str, self.sizes)), self.max_rows, time.perf_counter() - start,
                    self.memory_bytes / 2**20)

    def _fill(self, chunks: list[ScheduledChunk], size: int) -> list[int]:
        """Write the step's rows, then the padding row up to `size` tokens and the empty row slots, into the static
        buffers; -> each row's first packed token, then the total."""
        host = _views(self.staging.take(), self._segments)
        page, dummy = self.page_size, self.tables.dummy_row
        window = "window_slot_mapping" in host
        starts = _starts(chunks)
        ids, positions, kv, window_kv, seq_ids, logits = [], [], [], [], [], []
        for i, (chunk, start) in enumerate(zip(chunks, starts)):
            n, prefix = len(chunk.token_ids), chunk.prefix_len
            ids += chunk.token_ids
            positions += range(prefix, prefix + n)
            kv += kv_rows(chunk.page_ids, prefix, prefix + n, page)
            if window:
                window_kv += kv_rows(chunk.window_page_ids, prefix, prefix + n, page)
            seq_ids += [i] * n
            logits += [start + offset for offset in chunk.logits_offsets]
        pad, unused = size - starts[-1], self.max_rows - len(chunks)
        dummy_kv = [DUMMY_PAGE * page] * pad  # the dummy page's first KV row
        fields = {"input_ids": ids + [0] * pad, "positions": positions + list(range(pad)),
                  "slot_mapping": kv + dummy_kv, "seq_ids": seq_ids + [len(chunks)] * pad,
                  "kv_lens": [c.prefix_len + len(c.token_ids) for c in chunks] + [pad] + [0] * unused,
                  "table_rows": [c.table_row for c in chunks] + [dummy] * (unused + 1),
                  "logits_index": logits + [0] * (self.max_rows - len(logits)),
                  "query_start_loc": starts + [size] * (unused + 1),
                  "has_initial_state": [c.has_initial_state for c in chunks] + [False] * (unused + 1)}
        if window:
            fields["window_slot_mapping"] = window_kv + dummy_kv
        for name, values in fields.items():
            host[name][:len(values)] = host_tensor(values, host[name].dtype)
        self._chunks = chunks
        self.staging.copy_to(self._static)
        return starts

    def run(self, chunks: list[ScheduledChunk], previous_draws: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows wanting one, vocab] of a step that `fits` (the tables already updated), in row order. A row
        with a `future_token` reads that input from `previous_draws` (the step before's tokens, on the device)."""
        tokens = sum(len(chunk.token_ids) for chunk in chunks)
        size = self.size_for(tokens)
        if size is None:
            raise ValueError(f"{tokens} tokens exceed the largest prefill graph's {self.sizes[-1]}")
        rows, sources = future_inputs(chunks, self._fill(chunks, size))
        resolve_future_inputs(self._inputs["input_ids"], rows, sources, previous_draws)
        wanted = sum(len(chunk.logits_offsets) for chunk in chunks)
        if not self._graphs:
            return self._forward(size)[:wanted]
        self._graphs[size].replay()
        return self._logits[size][:wanted]
