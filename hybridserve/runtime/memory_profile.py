"""Memory profiling: the bytes the caches may take, measured on the device before they exist.

On CUDA the caches get this engine's share of the device (`gpu_memory_utilization`) less what it holds already
(weights, torch's reserve, the CUDA context), the activation peak of a profiling forward at the largest step, the
sampler's penalty counts and, with CUDA graphs, what a trial capture of them took (their pool stays held beside the
activations of eager steps). On CPU the budget is configured (`kv_cache_memory_bytes`). Everything here runs on
temporary caches bound to the model, which the runner's own pools replace afterwards.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridserve.cache.kv_pool import KVCacheSpec, KVPool
from hybridserve.cache.memory import GiB
from hybridserve.cache.state_pool import StatePool
from hybridserve.config import EngineConfig
from hybridserve.core.batch import PageTables, build_forward_batch
from hybridserve.core.chunk import ScheduledChunk
from hybridserve.layers.sampler import penalty_rows
from hybridserve.models.base import CausalLM

logger = logging.getLogger(__name__)

_CPU_CACHE_BYTES = 1 * GiB
_GRAPH_POOL_HEADROOM = 64 << 20
_NON_TORCH_HEADROOM = 1 * GiB  # the CUDA context, cuBLAS workspaces and the like, outside torch's allocator


class ProfiledRunner(Protocol):
    """What profiling needs of the model runner (runtime/model_runner.py)."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    model: CausalLM
    model_config: object
    kv_spec: KVCacheSpec
    page_footers: bool
    use_graphs: bool

    def bind_pools(self, kv: KVPool, window: KVPool | None, state: StatePool, footers: StatePool | None) -> None: ...
    def page_tables(self, rows: int, max_model_len: int, window: bool) -> PageTables: ...
    def build_graphs(self, tables: PageTables, rows: int, max_model_len: int) -> tuple: ...
    def graph_rows(self) -> int: ...
    def with_window_pages(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]: ...


@dataclass(frozen=True)
class CacheBudget:
    bytes: int  # for the caches, on this rank
    graph_reserve: int  # of what is not theirs, kept for the CUDA graphs' pool (0 without graphs)


def _available_cpu_bytes() -> int | None:
    """The memory the OS can give without swapping (Linux's MemAvailable), None where it does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_budget(nbytes: int) -> int:
    """The configured CPU budget, refused here where the machine cannot hold it: the CPU pools take their pages
    only when first written (cache/buffers.py), so an oversized budget would otherwise fail mid-run."""
    available = _available_cpu_bytes()
    if available is not None and nbytes > available:
        raise ValueError(f"kv_cache_memory_bytes: the CPU cache budget ({nbytes / GiB:.2f} GiB) is more than the "
                         f"machine has available ({available / GiB:.2f} GiB); lower it")
    return nbytes


def cache_budget(runner: ProfiledRunner) -> CacheBudget:
    """The bytes for the caches (module docstring); per instance, so engines sharing a GPU each take their own
    fraction, and never more than the device has free."""
    config, device = runner.config, runner.device
    if device.type == "cpu":
        return CacheBudget(_cpu_budget(config.kv_cache_memory_bytes or _CPU_CACHE_BYTES), 0)
    tokens = config.max_num_batched_tokens
    peak = activation_peak(runner, [ScheduledChunk([0] * tokens, 0, [], 1, False, [tokens - 1])],
                           min(tokens, config.max_running_requests))
    reserve = 0
    if runner.use_graphs:
        reserve = _GRAPH_POOL_HEADROOM + graph_pool_bytes(runner)
        logger.info("memory plan: %.0f MiB reserved for the CUDA graphs (what a trial capture of them took)",
                    reserve / 2**20)
        peak += reserve
    # The sampler's penalty counts (fp32 count + bool flag per vocabulary entry and penalty row), allocated when a
    # request first uses a penalty.
    peak += penalty_rows(config.max_running_requests) * runner.model_config.vocab_size * 5
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device) + _NON_TORCH_HEADROOM
    return CacheBudget(int(min(total * config.gpu_memory_utilization - held, free - _NON_TORCH_HEADROOM) - peak),
                       reserve)


def bind_temporary(runner: ProfiledRunner, pages: int, state_slots: int, footers: bool) -> tuple:
    """Caches of `pages` pages and `state_slots` state slots (and as many footer slots as pages, if asked), bound to
    the layers for a forward outside the engine's own caches; -> (kv, window, state, footers), to be dropped by the
    caller."""
    full_spec, window_spec = runner.kv_spec.groups()
    size = runner.config.page_size
    kv = KVPool(full_spec, pages, size, runner.device)
    window = KVPool(window_spec, pages, size, runner.device) if window_spec is not None else None
    state_spec = runner.model.state_spec(runner.dtype)
    state = StatePool(state_spec, state_slots, runner.device)
    footer_pool = StatePool(state_spec, pages, runner.device) if footers else None
    runner.bind_pools(kv, window, state, footer_pool)
    return kv, window, state, footer_pool


@torch.inference_mode()
def graph_pool_bytes(runner: ProfiledRunner) -> int:
    """Device memory that capturing every graph takes, measured by capturing them once on temporary one-page caches
    (their padding touches only the dummy page and slot) with the largest row counts and context the engine may
    get, then releasing them. A profiled peak of live tensors undercounts the pool: the graphs of all sizes share
    its blocks only in part (the pool's segments split and fragment), by a fifth to a half of it."""
    device = runner.device
    caches = bind_temporary(runner, 1, 1, runner.page_footers)
    rows = runner.graph_rows()
    max_model_len = runner.config.max_model_len or runner.model_config.max_position_embeddings
    tables = runner.page_tables(rows, max_model_len, window=caches[1] is not None)  # [1]: the window pool
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    graphs = runner.build_graphs(tables, rows, max_model_len)
    torch.cuda.synchronize(device)
    taken = torch.cuda.memory_reserved(device) - before
    del graphs, tables, caches
    gc.collect()  # the graphs (and their pool) go with their last reference
    torch.cuda.empty_cache()
    return taken


@torch.inference_mode()
def activation_peak(runner: ProfiledRunner, chunks: list[ScheduledChunk], logits_rows: int) -> int:
    """Peak extra memory of one forward over `chunks` (given pages here, on temporary caches) plus the logits of
    `logits_rows` rows."""
    device, size, model = runner.device, runner.config.page_size, runner.model
    pages = 1
    for chunk in chunks:
        chunk.page_ids = list(range(pages, pages + -(-len(chunk.token_ids) // size)))
        pages += len(chunk.page_ids)
    caches = bind_temporary(runner, pages, 2, footers=False)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    batch = build_forward_batch(runner.with_window_pages(chunks), size, device, model.history_len)
    hidden = model(batch)
    model.compute_logits(hidden[:logits_rows])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches, batch, hidden
    torch.cuda.empty_cache()
    return peak
