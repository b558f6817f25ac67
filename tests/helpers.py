"""Shared test helpers: tokenizer files for tiny checkpoints, running a model on a hand-built batch, and an engine
to completion."""
from __future__ import annotations

from pathlib import Path

import torch

from hybridserve.cache.kv_pool import KVPool
from hybridserve.cache.state_pool import StatePool
from hybridserve.core.batch import ForwardBatch, build_forward_batch
from hybridserve.core.chunk import ScheduledChunk
from hybridserve.demo import copy_bundled_tokenizer


def add_tokenizer(directory: Path) -> None:
    """Copy the real Qwen3 tokenizer next to a tiny checkpoint (its ids < vocab_size decode fine)."""
    copy_bundled_tokenizer(Path(directory))


class CacheHarness:
    """A model with its own KV and state pools, run on explicitly described chunks (no scheduler)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.float32, num_pages: int = 256,
                 page_size: int = 4, num_slots: int = 16, device: str = "cpu"):
        self.model, self.page_size, self.device = model, page_size, torch.device(device)
        kv_spec, state_spec = model.kv_cache_spec(dtype), model.state_spec(dtype)
        self.kv = KVPool(kv_spec, num_pages, page_size, self.device)
        self.state = StatePool(state_spec, num_slots, self.device)
        model.bind_caches([self.kv.layer(i) for i in range(kv_spec.num_layers)],
                          [self.state.layer(i) for i in range(state_spec.num_layers)])
        self._next_page = 1
        self.pages: dict[int, list[int]] = {}  # slot -> pages

    def chunk(self, slot: int, token_ids: list[int], prefix_len: int, all_logits: bool = True) -> ScheduledChunk:
        """A chunk for the sequence living in `slot`, growing its page list as needed."""
        pages = self.pages.setdefault(slot, [])
        while len(pages) * self.page_size < prefix_len + len(token_ids):
            pages.append(self._next_page)
            self._next_page += 1
        offsets = list(range(len(token_ids))) if all_logits else [len(token_ids) - 1]
        return ScheduledChunk(token_ids, prefix_len, list(pages), slot, prefix_len > 0, offsets)

    def batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        return build_forward_batch(chunks, self.page_size, self.device, self.model.history_len)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [N, V] for the chunks' requested offsets, in order."""
        batch = self.batch(chunks)
        hidden = self.model(batch)
        return self.model.compute_logits(hidden[batch.logits_indices])


def finish_all(engine, check_resources: bool = False) -> dict:
    """Step `engine` until it has no work; {request id: its finished RequestOutput} (resources recounted after every
    step when asked)."""
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
        if check_resources:
            engine.cache_manager.check()
    return done
