"""ModelRunner: owns the model and both cache pools on one device, and executes StepPlans."""
from __future__ import annotations

import logging

import torch

from hybridserve.cache.kv_pool import KVPool
from hybridserve.cache.memory import GiB, MemoryPlan, plan_memory
from hybridserve.cache.state_pool import StatePool
from hybridserve.config import EngineConfig
from hybridserve.layers.sampler import SampledToken, Sampler
from hybridserve.loader import read_config
from hybridserve.runtime.batch import build_forward_batch
from hybridserve.runtime.model_loader import build_model, resolve_dtype
from hybridserve.runtime.step import StepPlan

logger = logging.getLogger(__name__)

_CPU_CACHE_BYTES = 1 * GiB


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str):
        self.config = config
        self.device = config.torch_device()
        raw = read_config(model_dir, config.hf_overrides)
        self.dtype = resolve_dtype(config.dtype, raw.get("torch_dtype") or raw.get("dtype"))
        self.model, self.model_config = build_model(model_dir, self.dtype, self.device, config.hf_overrides)
        kv_spec, state_spec = self.model.kv_cache_spec(self.dtype), self.model.state_spec(self.dtype)
        self.memory = plan_memory(self._cache_budget(), kv_spec.bytes_per_token() * config.page_size,
                                  state_spec.bytes_per_slot(), max_running_requests=config.max_running_requests,
                                  max_state_slots=config.max_state_slots)
        logger.info("memory plan: %s", self.memory.describe(config.page_size))
        self.kv_pool = KVPool(kv_spec, self.memory.num_pages + 1, config.page_size, self.device)
        self.state_pool = StatePool(state_spec, self.memory.num_state_slots, self.device)
        self.model.bind_caches([self.kv_pool.layer(i) for i in range(kv_spec.num_layers)],
                               [self.state_pool.layer(i) for i in range(state_spec.num_layers)])
        self.sampler = Sampler()

    @property
    def memory_plan(self) -> MemoryPlan:
        return self.memory

    def _cache_budget(self) -> int:
        if self.device.type == "cpu":
            return self.config.kv_cache_memory_bytes or _CPU_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free - (1.0 - self.config.gpu_memory_utilization) * total)

    def _copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = zip(*pairs)
            self.state_pool.copy_slots(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[SampledToken | None]:
        """Run one step: restores -> forward -> snapshots, then sample where asked."""
        batch = build_forward_batch(plan.chunks, self.config.page_size, self.device, self.model.history_len)
        self._copy_slots(plan.restores)
        hidden = self.model(batch)
        self._copy_slots(plan.snapshots)
        sampled_rows = [i for i, row in enumerate(plan.samples) if row is not None]
        if not sampled_rows:
            return [None] * len(plan.chunks)
        # Each sampled chunk asks for exactly one logits row: its last token.
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        tokens = self.sampler(logits, [plan.samples[i] for i in sampled_rows])
        results: list[SampledToken | None] = [None] * len(plan.chunks)
        for row, token in zip(sampled_rows, tokens):
            results[row] = token
        return results
