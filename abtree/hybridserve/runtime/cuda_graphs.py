"""Decode steps replayed from CUDA graphs: one launch of the whole forward and the logits instead of ~15 per layer.

A decode step of B rows (one token each) runs the graph captured for the smallest size >= B; rows B.. are padding
that points at the dummies (page 0 through the page tables' dummy row, state slot 0, position 0, one key), so they
touch nothing a request owns. Every input the graph reads lives in static device buffers: the per-step values (token,
position, key count, KV row, table row, initial-state flag, and the window group's KV row for sliding-window layers)
are written into a pinned host twin and moved with one copy before the replay; the page tables (both KV groups) and
the state slots are gathered from the persistent `PageTables` inside the graph. Shapes come from the size alone: the
attention kernel plans its key splits for `max_model_len` keys (splits beyond a row's keys are empty), so one graph
serves any context length.

All sizes share one memory pool, captured largest first so the smaller graphs reuse its blocks; the model runner
reserves the largest decode forward's peak for it in the memory plan and logs what the capture really took.
Without `capture` (CPU tests) the same static-buffer forward runs eagerly, which checks everything but the capture.
"""
from __future__ import annotations

import logging
import time

import torch

from hybridserve.core.batch import (
    ForwardBatch,
    PageTables,
    ScheduledChunk,
    decode_token_history,
    future_inputs,
    kv_row,
    resolve_future_inputs,
)
from hybridserve.runtime.warmup import DUMMY_PAGE

logger = logging.getLogger(__name__)

# Per-step values, one int64 row each in the static buffer (the initial-state flags follow as bools); the window
# group's KV rows (sliding-window layers) only when the tables have a window group.
_FIELDS = ("input_ids", "positions", "kv_lens", "slot_mapping", "table_rows", "window_slot_mapping")


def capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_size` (and `max_size` itself)."""
    sizes = [n for n in (1, 2, 4, 8) if n <= max_size] + list(range(16, max_size + 1, 8))
    return sorted(set(sizes) | {max_size})


class DecodeGraphs:
    """Static decode inputs for up to `sizes[-1]` rows, and (with `capture`) a CUDA graph per size."""

    def __init__(self, model, tables: PageTables, page_size: int, max_model_len: int, sizes: list[int],
                 device: torch.device, capture: bool):
        self.model, self.tables, self.page_size, self.max_model_len = model, tables, page_size, max_model_len
        self.sizes, self.device = sizes, device
        self._fields = _FIELDS if tables.window is not None else _FIELDS[:-1]
        rows = sizes[-1]
        longs = len(self._fields) * rows * 8
        # Two pinned host twins, used in turn: a step's copy may still be queued while the next step is filled.
        self._host = [torch.zeros(longs + rows, dtype=torch.uint8, pin_memory=device.type == "cuda")
                      for _ in range(2)]
        self._turn = 0
        self._static = torch.zeros(longs + rows, dtype=torch.uint8, device=device)
        self._longs = self._static[:longs].view(torch.long).view(len(self._fields), rows)
        self._flags = self._static[longs:].view(torch.bool)
        self._query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self._row_index = torch.arange(rows, device=device)
        self._page_offsets = torch.arange(page_size, device=device)
        self._no_tokens = torch.zeros(0, dtype=torch.long, device=device)
        history = model.history_len  # the conv's torch reference reads this layout; the kernel does not
        self._history = {size: decode_token_history(size, history, device) for size in sizes} if history else {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0  # what the captured graphs' pool holds
        if capture:
            self._capture()

    def size_for(self, rows: int) -> int | None:
        """The captured size a decode step of `rows` rows runs at (None: more rows than the largest size)."""
        return next((size for size in self.sizes if size >= rows), None)

    def _batch(self, size: int) -> ForwardBatch:
        """The decode batch of `size` rows over the static buffers (the page table gathered from the tables)."""
        field = dict(zip(self._fields, self._longs[:, :size]))
        rows = field["table_rows"]
        window = self.tables.window
        return ForwardBatch(
            query_lens=[1] * size, query_starts=list(range(size)), prefix_lens=[self.max_model_len - 1] * size,
            page_size=self.page_size, is_decode=True, max_query_len=1, max_kv_len=self.max_model_len,
            input_ids=field["input_ids"], positions=field["positions"],
            query_start_loc=self._query_start_loc[:size + 1], seq_ids=self._query_start_loc[:size],
            kv_lens=field["kv_lens"], page_table=self.tables.full.pages.index_select(0, rows),
            slot_mapping=field["slot_mapping"], state_slots=self.tables.slots.index_select(0, rows),
            has_initial_state=self._flags[:size], logits_indices=self._row_index[:size],
            page_offsets=self._page_offsets, page_end_tokens=self._no_tokens, page_end_pages=self._no_tokens,
            token_history=self._history.get(size),
            window_page_table=window.pages.index_select(0, rows) if window is not None else None,
            window_slot_mapping=field.get("window_slot_mapping"))

    def _forward(self, size: int) -> torch.Tensor:
        batch = self._batch(size)
        return self.model.compute_logits(self.model(batch))

    def _capture(self) -> None:
        self._fill([], self.sizes[-1])  # every row a padding row
        start = time.perf_counter()
        for size in self.sizes:
            self._forward(size)  # eager once: compiles any kernel variant the capture would otherwise meet first
        # Only the graphs' pool allocates from here on, so the growth of reserved memory is that pool.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("CUDA graphs: %d decode sizes (%s) captured in %.1f s, %.0f MiB", len(self.sizes),
                    _describe(self.sizes), time.perf_counter() - start, self.memory_bytes / 2**20)

    def _fill(self, chunks: list[ScheduledChunk], size: int) -> None:
        """Write the step's per-row values, then padding rows up to `size`, into the static buffers."""
        host = self._host[self._turn]
        self._turn ^= 1
        rows = self.sizes[-1]
        fields = len(self._fields)
        longs = host[:fields * rows * 8].view(torch.long).view(fields, rows)
        flags = host[fields * rows * 8:].view(torch.bool)
        values = [[] for _ in range(fields)]
        for chunk in chunks:
            pos = chunk.prefix_len
            values[0].append(chunk.token_ids[0])
            values[1].append(pos)
            values[2].append(pos + 1)
            values[3].append(kv_row(chunk.page_ids, pos, self.page_size))
            values[4].append(chunk.table_row)
            if fields > 5:
                values[5].append(kv_row(chunk.window_page_ids, pos, self.page_size))
        pad = size - len(chunks)
        dummy_kv = DUMMY_PAGE * self.page_size  # the dummy page's first KV row
        fills = (0, 0, 1, dummy_kv, self.tables.dummy_row, dummy_kv)
        for column, fill in zip(values, fills):
            column.extend([fill] * pad)
        longs[:, :size] = torch.tensor(values, dtype=torch.long)
        flags[:size] = torch.tensor([c.has_initial_state for c in chunks] + [False] * pad)
        self._static.copy_(host, non_blocking=True)

    def run(self, chunks: list[ScheduledChunk], previous_draws: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(chunks), vocab] of a decode step (every chunk one token; the tables already updated). Rows
        with a `future_token` read their input from `previous_draws` (the step before's tokens, on the device)."""
        size = self.size_for(len(chunks))
        if size is None:
            raise ValueError(f"{len(chunks)} decode rows exceed the largest graph size {self.sizes[-1]}")
        self._fill(chunks, size)
        rows, sources = future_inputs(chunks, list(range(len(chunks))))
        if rows:
            index = torch.tensor([rows, sources], pin_memory=self.device.type == "cuda").to(self.device,
                                                                                          non_blocking=True)
            resolve_future_inputs(self._longs[0], index[0], index[1], previous_draws)
        if not self._graphs:
            return self._forward(size)[:len(chunks)]
        self._graphs[size].replay()
        return self._logits[size][:len(chunks)]


def _describe(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{', '.join(map(str, sizes[:5]))}, ..., {sizes[-1]}"

