"""ModelRunner: owns the model and the cache pools on one device, and executes StepPlans."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from hybridserve.cache.kv_pool import KVPool
from hybridserve.cache.memory import MemoryPlan, plan_memory
from hybridserve.cache.state_pool import StatePool
from hybridserve.checkpoint import read_config
from hybridserve.config import EngineConfig
from hybridserve.core.batch import ForwardBatch, PageTables, build_forward_batch, is_run
from hybridserve.core.chunk import ScheduledChunk
from hybridserve.core.parallel import tp_rank
from hybridserve.core.step import CacheOps, ChunkResult, SamplingRow, StepPlan
from hybridserve.core.upload import upload
from hybridserve.layers.sampler import Draws, Sampler, logprob_dicts
from hybridserve.ops.backends import all_triton, select_kernels
from hybridserve.runtime.build_model import build_model, resolve_dtype
from hybridserve.runtime.control_channel import ControlChannel
from hybridserve.runtime.cuda_graphs import DecodeGraphs, capture_sizes
from hybridserve.runtime.memory_profile import cache_budget
from hybridserve.runtime.prefill_graphs import MAX_ROWS, PrefillGraphs, prefill_sizes
from hybridserve.runtime.warmup import DUMMY_PAGE, DUMMY_SLOT, warmup_batches
from hybridserve.spec.mtp import MtpDrafter
from hybridserve.spec.verify import IntermediateSlots, commit_states
from hybridserve.structured.bitmask import TokenMask

logger = logging.getLogger(__name__)


@dataclass
class DraftWork:
    """What the draft layer (MTP) needs from a launched step once its draws are made: the eager batch and hidden
    states, or the graphs that ran the step; the chunks and where each one's draws start (None: no draw)."""

    chunks: list[ScheduledChunk]
    first_draws: list[int | None]
    batch: ForwardBatch | None = None
    hidden: torch.Tensor | None = None
    graphs: DecodeGraphs | None = None


@dataclass
class ChunkDraws:
    """One chunk's draws: where its results go, its sampling rows and the logits row each row draws from."""

    result: ChunkResult
    rows: list[SamplingRow]
    logits_rows: list[int]


@dataclass
class StepDraws:
    """A launched step's draws to make from its wanted logits rows, in plan order; its verify rows (chunk, index of
    its first draw), whose state is committed after the draws; and each chunk's first draw (None: no draw)."""

    logits: torch.Tensor
    chunks: list[ChunkDraws]
    verify: list[tuple[ScheduledChunk, int]]
    first_draws: list[int | None]


@dataclass
class StepHandle:
    """A launched step: its chunks' results (filled by `collect`), the draws still on their way to the host, and
    how many of them (in plan order) each result takes. A step with grammar rows keeps its logits, sampling rows
    and verify rows (`pending`) until `draw_masked` gives the masks; a step with a draft layer drafts after its
    draws (`draft_work`)."""

    results: list[ChunkResult]
    draws: list[Draws] = field(default_factory=list)
    draw_counts: list[tuple[ChunkResult, int]] = field(default_factory=list)
    pending: StepDraws | None = None
    draft_work: DraftWork | None = None
    drafts: torch.Tensor | None = None  # [R, k] the draft layer's proposals (MTP)
    draft_results: list[ChunkResult | None] = field(default_factory=list)  # whose each row is (None: nobody's)

    @property
    def awaits_mask(self) -> bool:
        return self.pending is not None

class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str, channel: ControlChannel | None = None):
        """`channel`: with tensor parallelism, the control channel to the other ranks (rank 0 sends them every call
        below that runs the model; the workers make the same calls on their shards)."""
        self.config = config
        self.channel = channel
        self.device = config.torch_device()
        select_kernels(self.device, config.kernel_backend)
        self.use_graphs = self._graphs_possible()
        raw = read_config(model_dir, config.hf_overrides)
        self.dtype = resolve_dtype(config.dtype, raw.get("torch_dtype") or raw.get("dtype"))
        self.model, self.model_config = build_model(model_dir, self.dtype, self.device, config.hf_overrides,
                                                    config.use_tqdm, config.load_format, config.seed,
                                                    config.quantization)
        caching = config.enable_prefix_caching
        self.page_footers = caching and self.model.state_checkpoints == "per_page"
        self.sparse_checkpoints = caching and self.model.state_checkpoints == "sparse"
        self.kv_spec, state_spec = self.model.kv_cache_spec(self.dtype), self.model.state_spec(self.dtype)
        speculative = config.speculative_config
        self.drafter = None
        if speculative is not None and speculative.method == "mtp":
            # The MTP layer's MLA gets a KV layer of its own after the main ones (same fields, same pages).
            self.kv_spec = dataclasses.replace(self.kv_spec, num_layers=self.kv_spec.num_layers + 1)
            self.drafter = MtpDrafter(self.model, speculative.num_speculative_tokens, config.page_size)
        full_spec, window_spec = self.kv_spec.groups()
        self.sliding_window = self.kv_spec.sliding_window if window_spec is not None else None
        page_bytes = full_spec.bytes_per_token() * config.page_size
        if self.page_footers:
            page_bytes += state_spec.bytes_per_slot()
        budget = cache_budget(self)
        self.graph_reserve = budget.graph_reserve  # of the device memory left beside the caches
        self.memory = plan_memory(
            self._agreed(budget.bytes), page_bytes, state_spec.bytes_per_slot(),
            max_running_requests=config.max_running_requests, state_to_kv_ratio=config.state_to_kv_ratio,
            slots_per_request=1 + config.checkpoint_slots_per_request if self.sparse_checkpoints else 1,
            num_speculative_tokens=config.num_speculative_tokens, max_state_slots=config.max_state_slots,
            slots_hold_checkpoints=self.sparse_checkpoints,
            window_page_bytes=window_spec.bytes_per_token() * config.page_size if window_spec else 0,
            sliding_window=self.sliding_window, page_size=config.page_size,
            max_num_batched_tokens=config.max_num_batched_tokens, max_total_tokens=config.max_total_tokens)
        logger.info("memory plan: %s", self.memory.describe(config.page_size))
        self.kv_pool = KVPool(full_spec, self.memory.num_pages + 1, config.page_size, self.device)
        self.window_pool = KVPool(window_spec, self.memory.num_window_pages + 1, config.page_size, self.device) \
            if window_spec is not None else None
        # Speculative decoding: k intermediate states per running request, after the allocator's slots.
        k = config.num_speculative_tokens
        self.intermediate_slots = IntermediateSlots(self.memory.num_state_slots + 1, k) if k else None
        if k:
            logger.info("speculative decoding: %s, %d draft tokens; %d intermediate states of %.2f MiB reserved "
                        "(%d per running request, %d running)", config.speculative_config.method, k,
                        k * self.memory.max_running_requests, state_spec.bytes_per_slot() / 2**20, k,
                        self.memory.max_running_requests)
        self.state_pool = StatePool(state_spec, self.memory.num_state_slots + k * self.memory.max_running_requests,
                                    self.device)
        self.footer_pool = StatePool(state_spec, self.memory.num_pages, self.device) if self.page_footers else None
        self.bind_pools(self.kv_pool, self.window_pool, self.state_pool, self.footer_pool)
        self.sampler = Sampler(config.max_running_requests)
        self.tables: PageTables | None = None
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # speculative decoding: rows of 1 + k tokens
        self.prefill_graphs: PrefillGraphs | None = None  # prefill and mixed steps of a few rows
        self._awaiting_mask: StepHandle | None = None  # the launched step whose draws wait for grammar masks
        self._no_draws = torch.zeros(0, dtype=torch.long, device=self.device)
        self._drawn_tokens: torch.Tensor | None = None  # the last launched step's draws, in plan order

    def _graphs_possible(self) -> bool:
        """CUDA graphs for decode: on CUDA, with every op on its kernel (the references may sync), unless eager."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return False
        if not all_triton():
            logger.info("CUDA graphs off: some ops run their pure-torch reference (kernel_backend=%s)",
                        self.config.kernel_backend)
            return False
        return True

    @property
    def draft_lookahead(self) -> int:
        """Positions after a drawing row whose KV the draft layer writes in the same step (its chain)."""
        return self.drafter.k - 1 if self.drafter is not None else 0

    def prefill_graph_sizes(self) -> list[int]:
        """Token sizes of the prefill graphs (empty: none): on a model whose prefill can replay them, up to
        --prefill-graph-max-tokens and at most a step's tokens; not with a draft layer, which drafts from the eager
        step's hidden states."""
        config = self.config
        if not self.use_graphs or not self.model.prefill_graphs or self.drafter is not None:
            return []
        return prefill_sizes(min(config.prefill_graph_max_tokens, config.max_num_batched_tokens))

    def prefill_graph_rows(self, sizes: list[int]) -> int:
        """Row slots of the prefill graphs: MAX_ROWS, at most the running requests and the largest size's tokens."""
        return min(MAX_ROWS, self.config.max_running_requests, sizes[-1])

    def graph_rows(self) -> int:
        """Rows of the largest decode graph: --cuda-graph-max-bs, else 256 or the running cap, whichever is less."""
        rows = self.config.cuda_graph_max_bs or 256
        return min(rows, self.config.max_running_requests, self.config.max_num_batched_tokens)

    def _agreed(self, budget: int) -> int:
        """The cache budget every rank can afford (ranks must plan the same pools: rank 0's scheduler hands out the
        page and slot ids for all of them)."""
        return self.channel.min_int(budget) if self.channel is not None else budget

    def _tell_workers(self, call: str, *args) -> None:
        """Rank 0 of a tensor-parallel group: have the other ranks make the same call."""
        if self.channel is not None and tp_rank() == 0:
            self.channel.send((call, args))

    def create_tables(self, max_rows: int, max_model_len: int) -> None:
        """The persistent device page/slot tables: one row per running sequence, wide enough for max_model_len."""
        self._tell_workers("create_tables", max_rows, max_model_len)
        self.tables = self.page_tables(max_rows, max_model_len, window=self.window_pool is not None)

    def page_tables(self, rows: int, max_model_len: int, window: bool) -> PageTables:
        """Page/slot tables of `rows` rows wide enough for max_model_len (with a window group's table if asked)."""
        # Speculative rows reach up to 2k positions past their last token (verify padding, an MTP chain).
        width = -(-(max_model_len + 2 * self.config.num_speculative_tokens) // self.config.page_size) + 1
        return PageTables(rows, width, self.device, window=window)

    def capture_graphs(self, max_rows: int, max_model_len: int) -> None:
        """Capture the decode graphs and, with speculative decoding, the verify graphs (after `create_tables`; the
        caches are bound for good by then). Verify graphs cover as many tokens as the largest decode graph; with
        a draft layer they replace the decode graphs (every decode step drafts)."""
        self._tell_workers("capture_graphs", max_rows, max_model_len)
        if not self.use_graphs:
            return
        self.prefill_graphs, self.verify_graphs, self.graphs = self.build_graphs(
            self.tables, min(self.graph_rows(), max_rows), max_model_len)

    def build_graphs(self, tables: PageTables, rows: int, max_model_len: int
                 ) -> tuple[PrefillGraphs | None, DecodeGraphs | None, DecodeGraphs | None]:
        """(prefill, verify, decode) graphs over `tables`, decode graphs of up to `rows` rows, all in one pool."""
        k = self.config.num_speculative_tokens
        pool = torch.cuda.graph_pool_handle()
        prefill = verify = decode = None
        sizes = self.prefill_graph_sizes()
        if sizes:  # first: the largest prefill graph usually outgrows the largest decode graph
            prefill = PrefillGraphs(self.model, tables, self.config.page_size, max_model_len, sizes,
                                    self.prefill_graph_rows(sizes), self.device, capture=True, pool=pool)
        if k:
            verify = DecodeGraphs(self.model, tables, self.config.page_size, max_model_len,
                                  capture_sizes(max(1, rows // (k + 1))), self.device, capture=True,
                                  row_tokens=k + 1, drafter=self.drafter, pool=pool)
        if self.drafter is None:
            decode = DecodeGraphs(self.model, tables, self.config.page_size, max_model_len, capture_sizes(rows),
                                  self.device, capture=True, pool=pool)
        return prefill, verify, decode

    def with_window_pages(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Chunks that run outside the scheduler (warm-up, profiling) use the same page ids in the window group.
        Keyed on `sliding_window`, which is set before the pools (the profiling forward runs before they exist)."""
        if self.sliding_window is not None:
            for chunk in chunks:
                chunk.window_page_ids = list(chunk.page_ids)
        return chunks

    @torch.inference_mode()
    def warm_up(self, max_rows: int, max_model_len: int) -> int:
        """Run the warm-up steps (runtime/warmup.py) on the dummy page and slot, then zero both. Returns the steps."""
        self._tell_workers("warm_up", max_rows, max_model_len)
        steps = warmup_batches(self.config.max_num_batched_tokens, max_rows, max_model_len, self.config.page_size,
                               self.config.num_speculative_tokens)
        for chunks in steps:
            batch = build_forward_batch(self.with_window_pages(chunks), self.config.page_size, self.device,
                                        self.model.history_len)
            hidden = self.model(batch)
            self.model.compute_logits(hidden[batch.logits_indices])
            if self.drafter is not None:  # every row drafts from token 0s (the chain's KV on the dummy page)
                counts = [1 + c.num_drafts for c in chunks]
                drawn = torch.zeros(sum(counts), dtype=torch.long, device=self.device)
                verify = sum(1 for c in chunks if c.num_drafts)
                inputs = self.drafter.inputs(batch, chunks, [sum(counts[:i]) for i in range(len(chunks))], drawn,
                                             drawn[:verify] if verify else None, self.tables.full.pages)
                self.drafter.run(batch, hidden, inputs)
        self.kv_pool.clear_page(DUMMY_PAGE)
        if self.window_pool is not None:
            self.window_pool.clear_page(DUMMY_PAGE)
        self.state_pool.clear_slot(DUMMY_SLOT)
        if self.footer_pool is not None:
            self.footer_pool.clear_slot(DUMMY_PAGE)  # footers are indexed by page
        return len(steps)

    @property
    def memory_plan(self) -> MemoryPlan:
        return self.memory

    def bind_pools(self, kv: KVPool, window: KVPool | None, state: StatePool, footers: StatePool | None) -> None:
        """Bind every layer to its caches: a sliding-window layer's KV to the window group's pool."""
        layers = range(state.spec.num_layers)
        footer_layers = [footers.layer(i) for i in layers] if footers is not None else None
        kv_layers = [(window if in_window else kv).layer(i) for in_window, i in self.kv_spec.layer_groups()]
        self.model.bind_caches(kv_layers, [state.layer(i) for i in layers], footer_layers)

    def _before_forward(self, ops: CacheOps) -> None:
        """The cache manager's work that precedes the forward (its snapshots follow it): new and truncated table
        rows, page copies (both groups), then state restores from slots and from page footers."""
        self.tables.reset(ops.table_resets)
        self.tables.truncate(ops.table_truncations)
        for pool, copies in ((self.kv_pool, ops.page_copies), (self.window_pool, ops.window_page_copies)):
            if copies:
                src, dst = zip(*copies)
                pool.copy_pages(*upload([src, dst], self.device, torch.long))
        self._copy_slots(ops.restores, self.state_pool)
        self._copy_slots(ops.page_restores, self.footer_pool)

    def _copy_slots(self, pairs: list[tuple[int, int]], source: StatePool) -> None:
        if pairs:
            src, dst = zip(*pairs)
            self.state_pool.copy_from(source, *upload([src, dst], self.device, torch.long))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepHandle:
        """Queue one step on the device: copies and restores -> forward -> snapshots, then prompt logprobs and
        sampling. Returns before the device has finished (on CUDA): the sampled tokens stay on the device, where
        the next step's chunks with `future_token` read them, and `collect` brings them to the host."""
        if self.tables is None:
            raise RuntimeError("create_tables must be called before the first step")
        self._tell_workers("launch", plan)
        self._before_forward(plan.cache_ops)
        chunks = plan.chunks
        graphs = self._graphs_for(chunks)
        prefill = self.prefill_graphs if graphs is None and self.prefill_graphs is not None and \
            self.prefill_graphs.fits(chunks) else None
        previous = self._drawn_tokens
        if graphs is not None or prefill is not None:
            self.tables.upload_updates(chunks)
        else:
            batch = build_forward_batch(chunks, self.config.page_size, self.device, self.model.history_len,
                                        self.tables, previous)
        handle = StepHandle([ChunkResult() for _ in chunks])
        self._drawn_tokens = None
        # Logits rows come chunk by chunk: the scored prompt positions, then the positions that sample.
        if graphs is not None:
            logits = graphs.run(chunks, previous)  # every token's; keep those of positions that want logits
            n = graphs.row_tokens
            wanted = [i * n + j for i, c in enumerate(chunks) for j in c.logits_offsets]
            if len(wanted) != logits.shape[0]:
                logits = logits[upload(wanted, self.device, torch.long)]
        elif prefill is not None:
            logits = prefill.run(chunks, previous)  # the wanted rows
        else:
            hidden = self.model(batch)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
        # Snapshots: before a verify row's commit (at the draws) changes its working slot.
        self._copy_slots(plan.cache_ops.snapshots, self.state_pool)
        draws = self._score(plan, handle, logits)
        if self.drafter is not None:
            handle.draft_work = DraftWork(chunks, draws.first_draws, graphs=graphs) if graphs is not None else \
                DraftWork(chunks, draws.first_draws, batch, hidden)
        if not draws.chunks:
            self._draft(handle, None)
            if logits.shape[0]:
                self.sampler.end_step()
            return handle
        handle.pending = draws
        if any(row.params.structured_output is not None for entry in draws.chunks for row in entry.rows):
            self._awaiting_mask = handle  # the engine fills the masks while the forward runs: draw_masked
        else:
            self._draw(handle, None)
        return handle

    @torch.inference_mode()
    def draw_masked(self, mask: TokenMask | None) -> None:
        """Queue the draws of the launched step that waits for its grammar masks (`StepHandle.awaits_mask`).
        `mask` (host memory): the allowed tokens of its draws with a grammar, by draw index in plan order (None:
        no draw is constrained, e.g. every grammar request of the step finished meanwhile). Uploaded once."""
        self._tell_workers("draw_masked", mask)
        handle, self._awaiting_mask = self._awaiting_mask, None
        if handle is None:
            raise RuntimeError("draw_masked without a launched step that waits for grammar masks")
        self._draw(handle, mask.to(self.device) if mask is not None else None)

    def _draw(self, handle: StepHandle, mask: TokenMask | None) -> None:
        """The step's draws, then (speculative decoding) the verify rows' commit and the draft layer's drafts."""
        pending, handle.pending = handle.pending, None
        handle.draws = self._sample(pending.logits, pending.chunks, mask)
        handle.draw_counts = [(entry.result, len(entry.rows)) for entry in pending.chunks]
        tokens = [draws.tokens for draws in handle.draws]
        self._drawn_tokens = tokens[0] if len(tokens) == 1 else torch.cat(tokens)
        verify = pending.verify
        accepted = commit_states(self.state_pool, self._drawn_tokens, verify) if verify else None
        self._draft(handle, accepted)
        for draws in handle.draws:
            draws.start_copy()
        self.sampler.end_step()

    def _draft(self, handle: StepHandle, accepted: torch.Tensor | None) -> None:
        """The draft layer's work after the draws and the commit (MTP), on the device: its KV over the step, and
        the drafts of the rows that drew."""
        work, handle.draft_work = handle.draft_work, None
        if work is None:
            return
        drawn = self._drawn_tokens if self._drawn_tokens is not None else self._no_draws
        if work.graphs is not None:
            handle.drafts = work.graphs.draft(work.chunks, work.first_draws, drawn, accepted)
            handle.draft_results = [r if first is not None else None
                                    for r, first in zip(handle.results, work.first_draws)]
        else:
            inputs = self.drafter.inputs(work.batch, work.chunks, work.first_draws, drawn, accepted,
                                         self.tables.full.pages)
            handle.drafts = self.drafter.run(work.batch, work.hidden, inputs)
            handle.draft_results = [r for r, first in zip(handle.results, work.first_draws) if first is not None]

    def _graphs_for(self, chunks: list[ScheduledChunk]) -> DecodeGraphs | None:
        """The graphs a step replays: decode graphs when every row runs one token (no draft layer); verify graphs
        when some row verifies drafts (or a draft layer drafts) and every row fits them; else None (eager)."""
        if self.graphs is not None and all(len(c.token_ids) == 1 for c in chunks) and \
                self.graphs.size_for(len(chunks)) is not None:
            return self.graphs
        verify = self.verify_graphs
        if verify is not None and (self.drafter is not None or any(c.num_drafts for c in chunks)) and \
                verify.fits(chunks):
            return verify
        return None

    def _score(self, plan: StepPlan, handle: StepHandle, logits: torch.Tensor) -> StepDraws:
        """Prompt logprobs from `logits` (the wanted rows, in plan order), and the step's draws to make."""
        row, sampling, verify, first_draw, first_draws = 0, [], [], 0, []
        for chunk, result, targets, rows in zip(plan.chunks, handle.results, plan.prompt_logprobs, plan.samples):
            first_draws.append(first_draw if rows else None)
            if targets is not None:
                try:
                    rows_logits = logits[row:row + len(targets.token_ids)]
                    if targets.temperature != 1.0:
                        rows_logits = rows_logits.float() / targets.temperature
                    scored = torch.log_softmax(rows_logits, dim=-1)
                    result.prompt_logprobs = logprob_dicts(scored, targets.token_ids, targets.top_k)
                except Exception as err:  # stays with this request; the engine aborts it alone
                    result.error = err
                row += len(targets.token_ids)
            if rows:
                # Forks draw from the prompt's last logits row; a verify row draws at each of its positions.
                span = len(rows) if chunk.num_drafts else 1
                sampling.append(ChunkDraws(result, rows, list(range(row, row + span)) if span > 1 else
                                           [row] * len(rows)))
                if chunk.num_drafts:
                    verify.append((chunk, first_draw))
                row += span
                first_draw += len(rows)
        return StepDraws(logits, sampling, verify, first_draws)

    def collect(self, handle: StepHandle) -> list[ChunkResult]:
        """Wait for a launched step's sampled tokens and hand them to each chunk's result."""
        if handle.awaits_mask:
            raise RuntimeError("the step's draws wait for their grammar masks: call draw_masked first")
        tokens = iter([token for draws in handle.draws for token in draws.result()])
        for result, count in handle.draw_counts:
            result.sampled = [next(tokens) for _ in range(count)]
        if handle.drafts is not None:
            for result, drafts in zip(handle.draft_results, handle.drafts.tolist()):
                if result is not None:
                    result.drafts = drafts
        return handle.results

    def _sample(self, logits: torch.Tensor, sampling: list[ChunkDraws], mask: TokenMask | None) -> list[Draws]:
        """All draws of the step in one sampler call, in plan order (the order `future_token` indexes). If that
        fails, chunk by chunk: a failure then stays with the request that caused it (its result's `error`; its
        draws are placeholder tokens 0, which the engine discards) and every other request still gets its tokens
        (draws depend only on their own row, so they are the same either way)."""
        def draw(entries: list[ChunkDraws], entry_mask: TokenMask | None) -> list[Draws]:
            draw_rows = [row for entry in entries for row in entry.logits_rows]
            picked = logits[draw_rows[0]:draw_rows[0] + len(draw_rows)] if is_run(draw_rows) else \
                logits[upload(draw_rows, logits.device, torch.long)]
            return self.sampler.draw(picked, [r for entry in entries for r in entry.rows], entry_mask)

        try:
            return draw(sampling, mask)
        except Exception:
            out, first = [], 0
            for entry in sampling:
                count = len(entry.rows)
                try:
                    out += draw([entry], mask.restrict(first, first + count) if mask is not None else None)
                except Exception as err:
                    entry.result.error = err
                    out.append(Draws.placeholder(count, logits.device))
                first += count
            return out
