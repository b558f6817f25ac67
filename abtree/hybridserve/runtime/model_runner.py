"""ModelRunner: owns the model and the cache pools on one device, and executes StepPlans."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from hybridserve.cache.kv_pool import KVPool
from hybridserve.cache.memory import GiB, MemoryPlan, plan_memory
from hybridserve.cache.state_pool import StatePool
from hybridserve.config import EngineConfig
from hybridserve.core.batch import PageTables, ScheduledChunk, build_forward_batch
from hybridserve.core.parallel import tp_rank
from hybridserve.core.step import ChunkResult, StepPlan
from hybridserve.layers.sampler import Draws, Sampler, logprob_dicts, penalty_rows
from hybridserve.loader import read_config
from hybridserve.ops.backends import all_triton, select_kernels
from hybridserve.runtime.cuda_graphs import DecodeGraphs, capture_sizes
from hybridserve.runtime.model_loader import build_model, resolve_dtype
from hybridserve.runtime.tensor_parallel import ControlChannel
from hybridserve.runtime.warmup import DUMMY_PAGE, DUMMY_SLOT, warmup_batches

logger = logging.getLogger(__name__)


@dataclass
class StepHandle:
    """A launched step: its chunks' results (filled by `collect`), the draws still on their way to the host, and
    how many of them (in plan order) each result takes."""

    results: list[ChunkResult]
    draws: list[Draws] = field(default_factory=list)
    draw_counts: list[tuple[ChunkResult, int]] = field(default_factory=list)

_CPU_CACHE_BYTES = 1 * GiB
_GRAPH_POOL_HEADROOM = 64 << 20
_NON_TORCH_HEADROOM = 1 * GiB  # the CUDA context, cuBLAS workspaces and the like, outside torch's allocator


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
                                                    config.use_tqdm, config.load_format, config.seed)
        caching = config.enable_prefix_caching
        self.page_footers = caching and self.model.state_checkpoints == "per_page"
        self.sparse_checkpoints = caching and self.model.state_checkpoints == "sparse"
        self.kv_spec, state_spec = self.model.kv_cache_spec(self.dtype), self.model.state_spec(self.dtype)
        full_spec, window_spec = self.kv_spec.groups()
        self.sliding_window = self.kv_spec.sliding_window if window_spec is not None else None
        page_bytes = full_spec.bytes_per_token() * config.page_size
        if self.page_footers:
            page_bytes += state_spec.bytes_per_slot()
        self.memory = plan_memory(
            self._agreed(self._cache_budget()), page_bytes, state_spec.bytes_per_slot(),
            max_running_requests=config.max_running_requests, state_to_kv_ratio=config.state_to_kv_ratio,
            slots_per_request=1 + config.checkpoint_slots_per_request if self.sparse_checkpoints else 1,
            num_speculative_tokens=config.num_speculative_tokens, max_state_slots=config.max_state_slots,
            slots_hold_checkpoints=self.sparse_checkpoints,
            window_page_bytes=window_spec.bytes_per_token() * config.page_size if window_spec else 0,
            sliding_window=self.sliding_window, page_size=config.page_size,
            max_num_batched_tokens=config.max_num_batched_tokens)
        logger.info("memory plan: %s", self.memory.describe(config.page_size))
        self.kv_pool = KVPool(full_spec, self.memory.num_pages + 1, config.page_size, self.device)
        self.window_pool = KVPool(window_spec, self.memory.num_window_pages + 1, config.page_size, self.device) \
            if window_spec is not None else None
        self.state_pool = StatePool(state_spec, self.memory.num_state_slots, self.device)
        self.footer_pool = StatePool(state_spec, self.memory.num_pages, self.device) if self.page_footers else None
        self._bind(self.kv_pool, self.window_pool, self.state_pool, self.footer_pool)
        self.sampler = Sampler(config.max_running_requests)
        self.tables: PageTables | None = None
        self.graphs: DecodeGraphs | None = None
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
        self.tables = PageTables(max_rows, -(-max_model_len // self.config.page_size) + 1, self.device,
                                 window=self.window_pool is not None)

    def capture_graphs(self, max_rows: int, max_model_len: int) -> None:
        """Capture the decode graphs (after `create_tables`; the caches are bound for good by then)."""
        self._tell_workers("capture_graphs", max_rows, max_model_len)
        if self.use_graphs:
            sizes = capture_sizes(min(self.graph_rows(), max_rows))
            self.graphs = DecodeGraphs(self.model, self.tables, self.config.page_size, max_model_len, sizes,
                                       self.device, capture=True)

    def _with_window_pages(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
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
        steps = warmup_batches(self.config.max_num_batched_tokens, max_rows, max_model_len, self.config.page_size)
        for chunks in steps:
            batch = build_forward_batch(self._with_window_pages(chunks), self.config.page_size, self.device,
                                        self.model.history_len)
            hidden = self.model(batch)
            self.model.compute_logits(hidden[batch.logits_indices])
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

    def _bind(self, kv: KVPool, window: KVPool | None, state: StatePool, footers: StatePool | None) -> None:
        """Bind every layer to its caches: a sliding-window layer's KV to the window group's pool."""
        layers = range(state.spec.num_layers)
        footer_layers = [footers.layer(i) for i in layers] if footers is not None else None
        kv_layers = [(window if in_window else kv).layer(i) for in_window, i in self.kv_spec.layer_groups()]
        self.model.bind_caches(kv_layers, [state.layer(i) for i in layers], footer_layers)

    def _cache_budget(self) -> int:
        """Bytes for the caches: the CPU budget, or on CUDA this engine's share of the device minus what it holds,
        the activation peak of a profiling forward at the largest batch, the sampler's penalty counts and, with
        CUDA graphs, the peak of the largest decode graph's forward (its memory pool stays held beside the
        activations of eager steps)."""
        self.graph_reserve = 0
        if self.device.type == "cpu":
            return self.config.kv_cache_memory_bytes or _CPU_CACHE_BYTES
        tokens = self.config.max_num_batched_tokens
        peak = self._profile_activations([ScheduledChunk([0] * tokens, 0, [], 1, False, [tokens - 1])],
                                         min(tokens, self.config.max_running_requests))
        if self.use_graphs:
            rows = self.graph_rows()
            # The pool's segments are whole allocator blocks (2 MiB for small tensors, 20 MiB and up for large
            # ones), hence the headroom over the peak of live tensors.
            self.graph_reserve = _GRAPH_POOL_HEADROOM + self._profile_activations(
                [ScheduledChunk([0], 0, [], 1, True, [0]) for _ in range(rows)], rows)
            logger.info("memory plan: %.0f MiB reserved for the CUDA graphs' pool (the forward of %d decode rows)",
                        self.graph_reserve / 2**20, rows)
            peak += self.graph_reserve
        # The sampler's penalty counts (fp32 count + bool flag per vocabulary entry and penalty row), allocated
        # when a request first uses a penalty.
        peak += penalty_rows(self.config.max_running_requests) * self.model_config.vocab_size * 5
        # Per instance: gpu_memory_utilization caps what this engine holds (its tensors, the headroom for what is
        # not torch's), whatever other processes on the device use; the caches never take more than is free.
        free, total = torch.cuda.mem_get_info(self.device)
        held = torch.cuda.memory_reserved(self.device) + _NON_TORCH_HEADROOM
        return int(min(total * self.config.gpu_memory_utilization - held, free - _NON_TORCH_HEADROOM) - peak)

    @torch.inference_mode()
    def _profile_activations(self, chunks: list[ScheduledChunk], logits_rows: int) -> int:
        """Peak extra memory of one forward over `chunks` (given pages here, on temporary caches) plus the logits
        of `logits_rows` rows."""
        size = self.config.page_size
        pages = 1
        for chunk in chunks:
            chunk.page_ids = list(range(pages, pages + -(-len(chunk.token_ids) // size)))
            pages += len(chunk.page_ids)
        full_spec, window_spec = self.kv_spec.groups()
        kv = KVPool(full_spec, pages, size, self.device)
        window = KVPool(window_spec, pages, size, self.device) if window_spec is not None else None
        state = StatePool(self.model.state_spec(self.dtype), 2, self.device)
        self._bind(kv, window, state, None)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        batch = build_forward_batch(self._with_window_pages(chunks), size, self.device, self.model.history_len)
        hidden = self.model(batch)
        self.model.compute_logits(hidden[:logits_rows])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del kv, window, state, batch, hidden
        torch.cuda.empty_cache()
        return peak

    def _copy_slots(self, pairs: list[tuple[int, int]], source: StatePool) -> None:
        if pairs:
            src, dst = zip(*pairs)
            self.state_pool.copy_from(source, torch.tensor(src, device=self.device),
                                      torch.tensor(dst, device=self.device))

    def execute(self, plan: StepPlan) -> list[ChunkResult]:
        """Run one step and wait for its results."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepHandle:
        """Queue one step on the device: copies and restores -> forward -> snapshots, then prompt logprobs and
        sampling. Returns before the device has finished (on CUDA): the sampled tokens stay on the device, where
        the next step's chunks with `future_token` read them, and `collect` brings them to the host."""
        if self.tables is None:
            raise RuntimeError("create_tables must be called before the first step")
        self._tell_workers("launch", plan)
        self.tables.reset(plan.table_resets)
        chunks = plan.chunks
        replay = self.graphs is not None and all(len(c.token_ids) == 1 for c in chunks) and \
            self.graphs.size_for(len(chunks)) is not None
        previous = self._drawn_tokens
        if replay:
            self.tables.upload_updates(chunks)
        else:
            batch = build_forward_batch(chunks, self.config.page_size, self.device, self.model.history_len,
                                        self.tables, previous)
        for pool, copies in ((self.kv_pool, plan.page_copies), (self.window_pool, plan.window_page_copies)):
            if copies:
                src, dst = zip(*copies)
                pool.copy_pages(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
        self._copy_slots(plan.restores, self.state_pool)
        self._copy_slots(plan.page_restores, self.footer_pool)
        handle = StepHandle([ChunkResult() for _ in chunks])
        self._drawn_tokens = None
        # Logits rows come chunk by chunk: the scored prompt positions, then the last token when it samples.
        if replay:
            logits = self.graphs.run(chunks, previous)  # every row's; keep those of chunks that want logits
            wanted = [i for i, c in enumerate(chunks) if c.logits_offsets]
            logits = logits if len(wanted) == len(chunks) else logits[torch.tensor(wanted, device=self.device)]
            self._copy_slots(plan.snapshots, self.state_pool)
        else:
            hidden = self.model(batch)
            self._copy_slots(plan.snapshots, self.state_pool)
            if batch.logits_indices.numel() == 0:
                return handle
            logits = self.model.compute_logits(hidden[batch.logits_indices])
        if logits.shape[0] == 0:
            return handle
        row, sampling = 0, []
        for result, targets, rows in zip(handle.results, plan.prompt_logprobs, plan.samples):
            if targets is not None:
                try:
                    scored = torch.log_softmax(logits[row:row + len(targets.token_ids)], dim=-1)
                    result.prompt_logprobs = logprob_dicts(scored, targets.token_ids, targets.top_k)
                except Exception as err:  # stays with this request; the engine aborts it alone
                    result.error = err
                row += len(targets.token_ids)
            if rows:
                sampling.append((result, rows, row))
                row += 1
        if sampling:
            handle.draws = self._sample(logits, sampling)
            handle.draw_counts = [(result, len(rows)) for result, rows, _ in sampling]
            tokens = [draws.tokens for draws in handle.draws]
            self._drawn_tokens = tokens[0] if len(tokens) == 1 else torch.cat(tokens)
            for draws in handle.draws:
                draws.start_copy()
        self.sampler.end_step()
        return handle

    def collect(self, handle: StepHandle) -> list[ChunkResult]:
        """Wait for a launched step's sampled tokens and hand them to each chunk's result."""
        tokens = iter([token for draws in handle.draws for token in draws.result()])
        for result, count in handle.draw_counts:
            result.sampled = [next(tokens) for _ in range(count)]
        return handle.results

    def _sample(self, logits: torch.Tensor, sampling: list[tuple[ChunkResult, list, int]]) -> list[Draws]:
        """All draws of the step in one sampler call, in plan order (the order `future_token` indexes). If that
        fails, chunk by chunk: a failure then stays with the request that caused it (its result's `error`; its
        draws are placeholder tokens 0, which the engine discards) and every other request still gets its tokens
        (draws depend only on their own row, so they are the same either way)."""
        def draw(entries: list[tuple[ChunkResult, list, int]]) -> list[Draws]:
            draw_rows = [row for _, rows, row in entries for _ in rows]
            contiguous = draw_rows == list(range(draw_rows[0], draw_rows[0] + len(draw_rows)))
            picked = logits[draw_rows[0]:draw_rows[0] + len(draw_rows)] if contiguous else \
                logits[torch.tensor(draw_rows, device=logits.device)]
            return self.sampler.draw(picked, [r for _, rows, _ in entries for r in rows])

        try:
            return draw(sampling)
        except Exception:
            out = []
            for entry in sampling:
                try:
                    out += draw([entry])
                except Exception as err:
                    entry[0].error = err
                    out.append(Draws.placeholder(len(entry[1]), logits.device))
            return out
