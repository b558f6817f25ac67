"""Decode and verify steps replayed from CUDA graphs: one launch of the whole forward and the logits instead of ~15
per layer.

A step of B rows runs the graph captured for the smallest size >= B; rows B.. are padding that points at the
dummies (page 0 through the page tables' dummy row, state slot 0, position 0, one key), so they touch nothing a
request owns. Every input the graph reads lives in static device buffers: the per-step values (per token: id,
position, KV row, the window group's KV row for sliding-window layers, and for verify graphs the state slot; per
row: key count, table row, initial-state flag) are written into a pinned staging buffer (core/staging.py: reused
only once its last copy has run) and moved with one copy before the replay; the page tables (both KV groups) and
the state slots are gathered from the persistent `PageTables` inside the graph. Shapes come from the size alone:
the attention kernel plans its key splits for `max_model_len` keys (splits beyond a row's keys are empty), so one
graph serves any context length.

Verify graphs (speculative decoding, `row_tokens` = 1 + k): every row runs 1 + k tokens, its last drawn token and
its drafts, padded with token 0 up to k drafts. The padding positions write KV into the row's own pages (the
scheduler reserves pages for 1 + k positions; a row without them runs eagerly) and their states into the dummy
slot 0; their draws are never made and their drafts never accepted. A 1-token row without drafts (or a 1-token
prompt chunk) rides along the same way. With a draft layer (Ling's MTP) a second graph per size drafts after the
step's draws: `draft` fills its static inputs (each position's next token, each row's last committed position)
from the draws and the accepted counts on the device and replays it.

All graphs share one memory pool, captured largest first so the smaller graphs reuse its blocks. A graph's output
outlives its capture, so each size writes its logits into the rows of the largest size's instead of keeping its
own (35 sizes of fp32 logits over a 262k vocabulary held 4.2 GiB of the pool): `capture_logits`, which the prefill
graphs use too. The model runner's memory plan reserves what a trial capture of all graphs took, and each capture
logs what it really took.
Without `capture` (CPU tests) the same static-buffer forward runs eagerly, which checks everything but the capture.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from hybridserve.core.batch import (
    ForwardBatch,
    HostPack,
    PageTables,
    VerifyLayout,
    decode_token_history,
    future_inputs,
    kv_row,
    resolve_future_inputs,
)
from hybridserve.core.chunk import ScheduledChunk
from hybridserve.core.staging import StagingBuffers
from hybridserve.models.base import CausalLM
from hybridserve.runtime.warmup import DUMMY_PAGE, DUMMY_SLOT
from hybridserve.spec.mtp import DraftInputs, MtpDrafter

logger = logging.getLogger(__name__)

# Per-step values in the static buffer, one int64 row each: per token, then per row (the initial-state flags follow
# as bools). The window group's KV rows (sliding-window layers) only with a window group, the state slots only in
# verify graphs; the draft layer's inputs only with a drafter.
_TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "window_slot_mapping", "token_slots", "draft_ids")
_ROW_FIELDS = ("kv_lens", "table_rows", "draft_base", "reach")


def capture_logits(forward: Callable[[torch.Tensor | None], torch.Tensor], rows: int, pool,
                   shared: torch.Tensor | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of `forward` (out -> logits [rows, vocab], written into `out` when given) in `pool`, and the
    tensor its logits land in: the first `rows` rows of `shared`, the logits of the largest size, captured first
    (None then: its own logits become `shared`). A graph's output outlives its capture, so the sizes share one
    logits tensor rather than keep one each."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = forward(None if shared is None else shared[:rows])
    return graph, logits if shared is None else shared


def capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_size` (and `max_size` itself)."""
    sizes = [n for n in (1, 2, 4, 8) if n <= max_size] + list(range(16, max_size + 1, 8))
    return sorted(set(sizes) | {max_size})


class DecodeGraphs:
    """Static inputs for up to `sizes[-1]` rows of `row_tokens` tokens (1: decode; 1 + k: verify), and (with
    `capture`) a CUDA graph per size; with `drafter` (verify graphs only) a draft graph per size."""

    def __init__(self, model: CausalLM, tables: PageTables, page_size: int, max_model_len: int, sizes: list[int],
                 device: torch.device, capture: bool, row_tokens: int = 1, drafter: MtpDrafter | None = None,
                 pool=None):
        if drafter is not None and row_tokens == 1:
            raise ValueError("a draft layer drafts in verify graphs (row_tokens = 1 + k)")
        self.model, self.tables, self.page_size, self.max_model_len = model, tables, page_size, max_model_len
        self.sizes, self.device, self.row_tokens, self.drafter = sizes, device, row_tokens, drafter
        verify, window = row_tokens > 1, tables.window is not None
        self._token_fields = [f for f in _TOKEN_FIELDS if (f != "window_slot_mapping" or window)
                              and (f != "token_slots" or verify) and (f != "draft_ids" or drafter is not None)]
        self._row_fields = [f for f in _ROW_FIELDS if f in ("kv_lens", "table_rows") or drafter is not None]
        rows = sizes[-1]
        tokens = rows * row_tokens
        self._longs = len(self._token_fields) * tokens + len(self._row_fields) * rows
        self.staging = StagingBuffers(self._longs * 8 + rows, device)  # the host side of the static inputs
        self._static = torch.zeros(self._longs * 8 + rows, dtype=torch.uint8, device=device)
        self._token_values, self._row_values, self._flags = self._views(self._static)
        self._query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device) * row_tokens
        self._seq_ids = torch.arange(rows, dtype=torch.int32, device=device).repeat_interleave(row_tokens)
        self._token_index = torch.arange(tokens, device=device)
        self._row_index = torch.arange(rows, device=device)
        self._page_offsets = torch.arange(page_size, device=device)
        self._no_tokens = torch.zeros(0, dtype=torch.long, device=device)
        history = model.history_len  # the conv's torch reference reads this layout; the kernel does not
        self._history = {size: decode_token_history(size, history, device, row_tokens) for size in sizes} \
            if history else {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._draft_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._drafts: dict[int, torch.Tensor] = {}
        self._size = 0  # the size of the step last run (its hidden states are the draft graph's input)
        self._prefix_lens: list[int] = []  # the last step's, padding rows 0
        self.memory_bytes = 0  # what the captured graphs' pool holds
        self.captured = capture
        if capture:
            self._capture(pool if pool is not None else torch.cuda.graph_pool_handle())

    def _views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-token values [fields, rows * row_tokens], per-row values [fields, rows], flags [rows]) of a buffer
        laid out like the static one."""
        rows = self.sizes[-1]
        tokens = rows * self.row_tokens
        longs = buffer[:self._longs * 8].view(torch.long)
        split = len(self._token_fields) * tokens
        return (longs[:split].view(len(self._token_fields), tokens),
                longs[split:].view(len(self._row_fields), rows), buffer[self._longs * 8:].view(torch.bool))

    def size_for(self, rows: int) -> int | None:
        """The captured size a step of `rows` rows runs at (None: more rows than the largest size)."""
        return next((size for size in self.sizes if size >= rows), None)

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a step can replay these graphs: every row decode-shaped (1 token, or a verify row with at most
        row_tokens - 1 drafts), with pages for all row_tokens positions, and a size for them."""
        n = self.row_tokens
        return self.size_for(len(chunks)) is not None and all(
            len(c.token_ids) == 1 + c.num_drafts <= n and (n == 1 or len(c.page_ids) * self.page_size >=
                                                            c.prefix_len + n) for c in chunks)

    def _batch(self, size: int) -> ForwardBatch:
        """The batch of `size` rows over the static buffers (the page table gathered from the tables). Its host
        prefix lengths are placeholders when captured (the kernels read the device key counts); without capture,
        for the torch references, they are the step's own."""
        n = self.row_tokens
        tokens = size * n
        field = dict(zip(self._token_fields, self._token_values[:, :tokens]))
        field.update(zip(self._row_fields, self._row_values[:, :size]))
        rows = field["table_rows"]
        window = self.tables.window
        verify = None
        if n > 1:
            verify = VerifyLayout(list(range(size)), self._row_index[:size], field["token_slots"],
                                  self._token_index[:tokens])
        return ForwardBatch(
            query_lens=[n] * size, query_starts=list(range(0, tokens, n)),
            prefix_lens=[self.max_model_len - n] * size if self.captured else self._prefix_lens[:size],
            page_size=self.page_size, is_decode=n == 1,
            max_query_len=n, max_kv_len=self.max_model_len, input_ids=field["input_ids"],
            positions=field["positions"], query_start_loc=self._query_start_loc[:size + 1],
            seq_ids=self._seq_ids[:tokens], kv_lens=field["kv_lens"],
            page_table=self.tables.full.pages.index_select(0, rows), slot_mapping=field["slot_mapping"],
            state_slots=self.tables.slots.index_select(0, rows), has_initial_state=self._flags[:size],
            logits_indices=self._token_index[:tokens], page_offsets=self._page_offsets,
            page_end_tokens=self._no_tokens, page_end_pages=self._no_tokens, token_history=self._history.get(size),
            window_page_table=window.pages.index_select(0, rows) if window is not None else None,
            window_slot_mapping=field.get("window_slot_mapping"), verify=verify)

    def _draft_inputs(self, size: int, batch: ForwardBatch) -> DraftInputs:
        field = dict(zip(self._token_fields, self._token_values[:, :size * self.row_tokens]))
        field.update(zip(self._row_fields, self._row_values[:, :size]))
        k = self.row_tokens - 1
        return DraftInputs(field["draft_ids"], field["draft_base"], self._row_index[:size], field["reach"],
                           batch.page_table, self.max_model_len + 2 * k)

    def _forward(self, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.model(self._batch(size))
        if self.drafter is not None:  # the draft graph's input: kept alive (its blocks stay out of the pool)
            self._hidden[size] = hidden
        return self.model.compute_logits(hidden, out)

    def _draft(self, size: int) -> torch.Tensor:
        batch = self._batch(size)
        return self.drafter.run(batch, self._hidden[size], self._draft_inputs(size, batch))

    def _capture(self, pool) -> None:
        self._fill([], self.sizes[-1])  # every row a padding row
        start = time.perf_counter()
        for size in self.sizes:
            self._forward(size)  # eager once: compiles any kernel variant the capture would otherwise meet first
            if self.drafter is not None:
                self._draft(size)
        # Only the graphs' pool allocates from here on, so the growth of reserved memory is that pool.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        shared = None
        for size in reversed(self.sizes):
            rows = size * self.row_tokens
            self._graphs[size], shared = capture_logits(functools.partial(self._forward, size), rows, pool, shared)
            self._logits[size] = shared[:rows]
            if self.drafter is not None:  # reads the forward graph's hidden states, kept alive in self._hidden
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._drafts[size] = self._draft(size)
                self._draft_graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        kind = "decode" if self.row_tokens == 1 else f"verify ({self.row_tokens} tokens per row" + \
            (", with drafting)" if self.drafter is not None else ")")
        logger.info("CUDA graphs: %d %s sizes (%s) captured in %.1f s, %.0f MiB", len(self.sizes), kind,
                    _describe(self.sizes), time.perf_counter() - start, self.memory_bytes / 2**20)

    def _fill(self, chunks: list[ScheduledChunk], size: int) -> None:
        """Write the step's per-token and per-row values, then padding up to `size` rows, into the static buffers."""
        token_values, row_values, flags = self._views(self.staging.take())
        n, page = self.row_tokens, self.page_size
        tok = {name: [] for name in self._token_fields}
        row = {name: [] for name in self._row_fields}
        dummy_kv = DUMMY_PAGE * page  # the dummy page's first KV row
        for chunk in chunks:
            pos = chunk.prefix_len
            positions = range(pos, pos + n)
            tok["input_ids"] += chunk.token_ids + [0] * (n - len(chunk.token_ids))
            tok["positions"] += positions
            tok["slot_mapping"] += [kv_row(chunk.page_ids, p, page) for p in positions]
            if "window_slot_mapping" in tok:
                tok["window_slot_mapping"] += [kv_row(chunk.window_page_ids, p, page) for p in positions]
            if "token_slots" in tok:  # the row's slot after its first token, the draft slots, the dummy after that
                tok["token_slots"] += chunk.verify_slots + [DUMMY_SLOT] * (n - len(chunk.token_ids))
            row["kv_lens"].append(pos + n)
            row["table_rows"].append(chunk.table_row)
            if "reach" in row:
                row["reach"].append(len(chunk.page_ids) * page)
        pad = size - len(chunks)
        for name, fill in (("input_ids", 0), ("positions", None), ("slot_mapping", dummy_kv),
                           ("window_slot_mapping", dummy_kv), ("token_slots", DUMMY_SLOT)):
            if name in tok:
                tok[name] += list(range(n)) * pad if fill is None else [fill] * (n * pad)
        for name, fill in (("kv_lens", n), ("table_rows", self.tables.dummy_row), ("reach", 0)):
            if name in row:
                row[name] += [fill] * pad
        if self.drafter is not None:  # completed on the device after the draws (`draft`)
            tok["draft_ids"] = [0] * (size * n)
            row["draft_base"] = list(range(0, size * n, n))
        token_values[:, :size * n] = torch.tensor([tok[name] for name in self._token_fields], dtype=torch.long)
        row_values[:, :size] = torch.tensor([row[name] for name in self._row_fields], dtype=torch.long)
        flags[:size] = torch.tensor([c.has_initial_state for c in chunks] + [False] * pad)
        self._prefix_lens = [c.prefix_len for c in chunks] + [0] * pad
        self.staging.copy_to(self._static)

    def run(self, chunks: list[ScheduledChunk], previous_draws: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(chunks) * row_tokens, vocab] of a step (the tables already updated): row i's token j at
        i * row_tokens + j. Decode rows with a `future_token` read their input from `previous_draws` (the step
        before's tokens, on the device)."""
        size = self.size_for(len(chunks))
        if size is None:
            raise ValueError(f"{len(chunks)} rows exceed the largest graph size {self.sizes[-1]}")
        self._fill(chunks, size)
        self._size = size
        rows, sources = future_inputs(chunks, list(range(0, len(chunks) * self.row_tokens, self.row_tokens)))
        resolve_future_inputs(self._token_values[0], rows, sources, previous_draws)
        used = len(chunks) * self.row_tokens
        if not self._graphs:
            return self._forward(size)[:used]
        self._graphs[size].replay()
        return self._logits[size][:used]

    def draft(self, chunks: list[ScheduledChunk], first_draws: list[int | None], drawn: torch.Tensor,
              accepted: torch.Tensor | None) -> torch.Tensor:
        """The draft layer's drafts [len(chunks), k] after the step `run` last ran (chunk i's draws start at
        `first_draws[i]` in `drawn`; `accepted`: the verify chunks' accepted counts, plan order). Rows that did not
        draw get drafts nobody reads."""
        n = self.row_tokens
        pack = HostPack()
        draw_rows, draw_index, known_rows, known_tokens, verify_rows = [], [], [], [], []
        for i, (chunk, first) in enumerate(zip(chunks, first_draws)):
            if first is None:
                if chunk.next_token_id is not None:
                    known_rows.append(i * n)
                    known_tokens.append(chunk.next_token_id)
                continue
            draw_rows += range(i * n, i * n + 1 + chunk.num_drafts)
            draw_index += range(first, first + 1 + chunk.num_drafts)
            if chunk.num_drafts:
                verify_rows.append(i)
        for name, values in (("draw_rows", draw_rows), ("draw_index", draw_index), ("known_rows", known_rows),
                             ("known_tokens", known_tokens), ("verify_rows", verify_rows)):
            pack.add(name, values)
        t = pack.upload(self.device)
        values = dict(zip(self._token_fields, self._token_values))
        values.update(zip(self._row_fields, self._row_values))
        values["draft_ids"].index_copy_(0, t["draw_rows"], drawn.index_select(0, t["draw_index"]))
        values["draft_ids"].index_copy_(0, t["known_rows"], t["known_tokens"])
        if accepted is not None:
            values["draft_base"].index_add_(0, t["verify_rows"], accepted)
        size = self._size
        if not self._draft_graphs:
            return self._draft(size)[:len(chunks)]
        self._draft_graphs[size].replay()
        return self._drafts[size][:len(chunks)]


def _describe(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{', '.join(map(str, sizes[:5]))}, ..., {sizes[-1]}"
