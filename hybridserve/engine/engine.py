"""LLMEngine: the step loop (schedule -> run -> sample -> postprocess) and request lifecycle."""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

from hybridserve.cache.kv_pool import PageAllocator
from hybridserve.cache.prefix_cache import HybridPrefixCache
from hybridserve.cache.state_pool import SlotAllocator
from hybridserve.config import EngineConfig
from hybridserve.demo import ensure_demo_checkpoint
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import Scheduler
from hybridserve.layers.sampler import SampledToken
from hybridserve.outputs import CompletionOutput, RequestOutput
from hybridserve.runtime.model_runner import ModelRunner
from hybridserve.sampling import SamplingParams
from hybridserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Tracked:
    """A request plus what turns its tokens into user-facing output."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    text: StopStringMatcher
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    streamed: dict = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = config.model or str(ensure_demo_checkpoint())
        self.model_dir = model_dir
        self.runner = ModelRunner(config, model_dir)
        self.tokenizer = load_tokenizer(config.tokenizer or model_dir)
        self.model_config = self.runner.model_config
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = self._eos_token_ids(model_dir)
        plan = self.runner.memory_plan
        kv_tokens = plan.num_pages * config.page_size
        self.max_model_len = self._max_model_len(kv_tokens)
        pages, slots = PageAllocator(plan.num_pages + 1), SlotAllocator(plan.num_state_slots)
        cache = None
        if config.enable_prefix_caching:
            cache = HybridPrefixCache(config.page_size, pages, slots, per_page_state=self.runner.page_footers)
        self.scheduler = Scheduler(pages, slots, config.page_size, plan.max_running_requests,
                                   config.max_num_batched_tokens, config.chunked_prefill_size, cache,
                                   config.state_checkpoint_interval)
        self._seeds = random.Random(config.seed)
        self._requests: dict[str, _Tracked] = {}

    # --- setup helpers ---------------------------------------------------------------------------------------
    def _eos_token_ids(self, model_dir: str) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        generation = Path(model_dir) / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(i for i in ids if 0 <= i < self.vocab_size)  # ids the model cannot emit never stop it

    def _max_model_len(self, kv_tokens: int) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is not None:
            if self.config.max_model_len > kv_tokens:
                raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the {kv_tokens} tokens the KV "
                                 "cache can hold; lower max_model_len or give the cache more memory")
            return self.config.max_model_len
        if kv_tokens < limit:
            logger.info("max_model_len lowered from %d to the KV cache capacity %d", limit, kv_tokens)
        return min(limit, kv_tokens)

    # --- requests --------------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError("n > 1 is not supported by the engine yet; submit n requests")
        token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, params=params,
            seed=params.seed if params.seed is not None else self._seeds.getrandbits(63),
            eos_token_ids=self.eos_token_ids,
        )
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
        tracked = _Tracked(request, prompt if isinstance(prompt, str) else None, detok,
                           StopStringMatcher(params.stop, params.include_stop_str_in_output),
                           logprobs=[] if params.logprobs is not None else None,
                           cumulative_logprob=0.0 if params.logprobs is not None else None)
        self._requests[request_id] = tracked
        self.scheduler.add(request)

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but the context length is "
                             f"{self.max_model_len}; shorten the prompt")

    def abort_request(self, request_id: str) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is not None and not tracked.request.finished:
            self.scheduler.finish(tracked.request, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # --- the step loop ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward over the scheduled batch; return outputs of the requests that produced a token."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        results = self.runner.execute(scheduled.plan)
        self.scheduler.after_step(scheduled)
        outputs = []
        for request, sampled in zip(scheduled.requests, results):
            if sampled is not None:
                tracked = self._requests[request.request_id]
                self._append_token(tracked, sampled)
                outputs.append(self._output(tracked))
                if request.finished:
                    del self._requests[request.request_id]
        return outputs

    def _append_token(self, tracked: _Tracked, sampled: SampledToken) -> None:
        request, params = tracked.request, tracked.request.params
        stops = request.stop_token_hit(sampled.token_id)
        request.output_token_ids.append(sampled.token_id)
        if tracked.logprobs is not None:
            entry = dict(sampled.top_logprobs or [])
            entry[sampled.token_id] = sampled.logprob
            tracked.logprobs.append(entry)
            tracked.cumulative_logprob += sampled.logprob
        if tracked.text.add(tracked.detokenizer.add(sampled.token_id)):
            request.stop_reason = tracked.text.matched
            self.scheduler.finish(request, "stop")
        elif stops:
            request.stop_reason = None if sampled.token_id in self.eos_token_ids and \
                sampled.token_id not in params.stop_token_ids else sampled.token_id
            self.scheduler.finish(request, "stop")
        elif (params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens) \
                or request.num_tokens >= self.max_model_len:
            self.scheduler.finish(request, "length")

    def _output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        completion = CompletionOutput(
            index=0, text=tracked.text.visible(request.finished), token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            cumulative_logprob=tracked.cumulative_logprob, logprobs=tracked.logprobs,
        )
        return RequestOutput(request_id=request.request_id, prompt=tracked.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=[completion],
                             finished=request.finished, num_cached_tokens=request.num_cached_tokens or 0)
