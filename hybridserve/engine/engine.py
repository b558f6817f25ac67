"""LLMEngine: the step loop (schedule -> run -> sample -> postprocess, overlapped) and request lifecycle."""
from __future__ import annotations

import itertools
import logging
import random
import time

from hybridserve.checkpoint import read_config
from hybridserve.config import EngineConfig
from hybridserve.core.step import ChunkResult
from hybridserve.engine.cache_manager import HybridCacheManager
from hybridserve.engine.drafts import DraftSource, Speculation, draft_source
from hybridserve.engine.output_processor import Group, OutputProcessor
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import ScheduledStep, Scheduler
from hybridserve.generation_config import load_generation_config
from hybridserve.models.registry import check_speculative, check_tensor_parallel
from hybridserve.ops.backends import any_triton
from hybridserve.outputs import RequestOutput
from hybridserve.runtime.model_runner import ModelRunner, StepHandle
from hybridserve.runtime.tensor_parallel import rank_config, start_workers, stop_workers
from hybridserve.sampling import SamplingParams, out_of_vocabulary
from hybridserve.spec.verify import accepted_length
from hybridserve.structured.bitmask import TokenMask
from hybridserve.structured.compiler import shared_compiler
from hybridserve.structured.matcher import GrammarState, MaskFiller
from hybridserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = config.model
        self.model_dir = model_dir
        raw = read_config(model_dir, config.hf_overrides)
        # Read before the weights load: a bad --generation-config fails at once.
        self.generation_config = load_generation_config(config.generation_config, model_dir)
        check_tensor_parallel(raw, config.tensor_parallel_size)
        check_speculative(raw, config.speculative_config)
        self.model_type: str = raw["model_type"]
        self.workers, channel = start_workers(config) if config.tensor_parallel_size > 1 else ([], None)
        self.runner = ModelRunner(rank_config(config, 0), model_dir, channel)
        self.tokenizer = load_tokenizer(config.tokenizer or model_dir)
        self.model_config = self.runner.model_config
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = self._eos_token_ids()
        if self.generation_config.sampling_defaults:
            logger.info("sampling defaults from %s: %s (for the fields a request leaves unset; --generation-config "
                        "vllm ignores them)", self.generation_config.source, self.generation_config.describe())
        # Structured output: compiled once per spec, shared with the server (which compiles before queueing).
        self.grammars = shared_compiler(config.tokenizer or model_dir, self.vocab_size, sorted(self.eos_token_ids))
        plan = self.runner.memory_plan
        kv_tokens = plan.num_pages * config.page_size  # the full group's capacity (the window group's is no limit)
        self.max_model_len = self._max_model_len(kv_tokens)
        self.runner.create_tables(plan.max_running_requests, self.max_model_len)
        if any_triton() and not config.skip_warmup:
            start = time.perf_counter()
            steps = self.runner.warm_up(plan.max_running_requests, self.max_model_len)
            logger.info("warm-up: %d steps compiled the kernels in %.1f s", steps, time.perf_counter() - start)
        self.runner.capture_graphs(plan.max_running_requests, self.max_model_len)
        self.cache_manager = HybridCacheManager(plan, config.page_size, config.enable_prefix_caching,
                                                per_page_state=self.runner.page_footers,
                                                sliding_window=self.runner.sliding_window)
        speculation = None
        if config.speculative_config is not None:
            speculation = Speculation(draft_source(config.speculative_config), self.runner.intermediate_slots,
                                      self.runner.draft_lookahead)
        self.scheduler = Scheduler(self.cache_manager, config.max_num_batched_tokens, config.chunked_prefill_size,
                                   config.state_checkpoint_interval, self.max_model_len, speculation)
        self._seeds = random.Random(config.seed)
        self.output_processor = OutputProcessor(self.scheduler, self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.num_prompt_tokens = 0
        self.num_verify_rows = 0  # speculative decoding: rows that verified drafts, drafts proposed, accepted
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Speculative steps run serially: the next step's drafts depend on this step's acceptance.
        self.overlap = not config.disable_overlap_schedule and config.speculative_config is None
        if config.speculative_config is not None and not config.disable_overlap_schedule:
            logger.info("overlapped scheduling is off with speculative decoding (each step's drafts depend on the "
                        "step before's accepted tokens)")
        self._in_flight: tuple[ScheduledStep, StepHandle] | None = None  # the launched step not yet processed
        self._filler: MaskFiller | None = None

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks: this node's worker processes (daemons, which die with this process
        anyway) and the other nodes' ranks."""
        if self.runner.channel is not None:
            stop_workers(self.workers, self.runner.channel)
            self.workers, self.runner.channel = [], None

    # --- setup helpers ---------------------------------------------------------------------------------------
    def _eos_token_ids(self) -> frozenset[int]:
        """The ids that end a sequence: config.json's, the generation config's and the tokenizer's."""
        ids = set(self.model_config.eos_token_ids) | set(self.generation_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(i for i in ids if 0 <= i < self.vocab_size)  # ids the model cannot emit never stop it

    def _max_model_len(self, kv_tokens: int) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is not None:
            if self.config.max_model_len > kv_tokens:
                more = "raise max_total_tokens" if self.config.max_total_tokens is not None else \
                    "give the cache more memory"
                raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the {kv_tokens} tokens the KV "
                                 f"cache can hold; lower max_model_len or {more}")
            return self.config.max_model_len
        if kv_tokens < limit:
            logger.info("max_model_len lowered from %d to the KV cache capacity %d", limit, kv_tokens)
        return min(limit, kv_tokens)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the generation config's defaults (--generation-config), for requests that bring
        none."""
        return SamplingParams(**self.generation_config.sampling_defaults)

    # --- requests --------------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request; bad prompts raise ValueError (nothing is queued then)."""
        if request_id in self.output_processor.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        self.validate_params(params)
        grammar = self.grammars.compile(params.structured_output) if params.structured_output is not None else None
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = Request(request_id=request_id, prompt_token_ids=token_ids, params=params, seed=seed,
                          eos_token_ids=self.eos_token_ids, num_forks=params.n - 1)
        self.output_processor.add(request, prompt if isinstance(prompt, str) else None, grammar)
        self.num_prompt_tokens += len(token_ids)
        self.scheduler.add(request)

    def validate_params(self, params: SamplingParams) -> None:
        """The checks of a request's parameters that depend on the model and this engine's limits."""
        params.check_vocabulary(self.vocab_size, self.eos_token_ids)
        params.check_logprobs(self.config.max_logprobs)

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        others = [t for t in token_ids if not isinstance(t, int)]
        if others:
            raise ValueError(f"prompt token ids must be integers, not {others[:5]}")
        why = out_of_vocabulary(token_ids, self.vocab_size)
        if why is not None:
            raise ValueError(why)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but the context length is "
                             f"{self.max_model_len}; shorten the prompt")

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is; its pages and state slots are freed at once."""
        if self.output_processor.abort(request_id):
            self._settle_discarded()

    def set_draft_source(self, source: DraftSource, force_acceptance: bool = False) -> None:
        """Replace where drafts come from (speculative decoding must be on): benchmarks and tests feed chosen drafts
        (`engine.drafts.ReplayDrafts`) to measure verification alone or pin acceptance. `force_acceptance`: every
        draft is accepted whatever the target draws (the output is then the drafts', not the model's): the cost of
        verification at full acceptance, for benchmarks, where bf16 verify rows need not draw what a plain run
        drew."""
        if self.scheduler.speculation is None:
            raise ValueError("speculative decoding is off; start the engine with a speculative_config")
        self.scheduler.speculation.drafts = source
        self.scheduler.speculation.force_acceptance = force_acceptance

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def flush_prefix_cache(self) -> bool:
        """Drop every prefix-cache entry (SGLang's /flush_cache), giving its pages and state slots back; only while
        no request is queued or running (their entries are in use): False then, and nothing is dropped."""
        if self.has_unfinished_requests():
            return False
        if self.cache_manager.prefix_cache is not None:
            self.cache_manager.prefix_cache.clear()
        return True

    def stats(self) -> dict[str, int]:
        """Gauges (now) and counters (since start) for metrics."""
        counts, cache = self.cache_manager.counts(), self.cache_manager
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "kv_pages_used": counts["pages_protected"], "kv_pages_cached": counts["pages_evictable"],
            "kv_pages_total": counts["pages_total"], "state_slots_used": counts["slots_protected"],
            "state_slots_cached": counts["slots_evictable"], "state_slots_total": counts["slots_total"],
            "prefix_cache_query_tokens": cache.prefix_query_tokens, "prefix_cache_hit_tokens": cache.prefix_hit_tokens,
            "prefix_cache_kv_match_tokens": cache.prefix_kv_match_tokens,
            "prompt_tokens": self.num_prompt_tokens, "generation_tokens": self.output_processor.num_generation_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "spec_verify_rows": self.num_verify_rows, "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
        } | {f"kv_{key}": counts[key] for key in ("window_pages_total", "window_pages_free", "window_pages_cached")
             if key in counts}  # the window group's pool (models with sliding-window layers)

    # --- the step loop ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward over the scheduled batch; return outputs of the requests that made progress, each as its
        SamplingParams.output_kind asks (what is new, everything so far, or only the finished result).

        Overlapped (the default): schedule and launch step N+1, then collect and process step N while the device
        runs N+1, so the host's scheduling, stop checks and detokenization hide behind the forward. N+1 counts
        N's tokens before their values reach the host (the runner reads them on the device); work of a request
        that N's token finished is discarded. A step whose prompt forks into n > 1 sequences is processed before
        the next is scheduled (the forks copy the state the prompt left). Outputs are the same either way.

        Structured output: a step with grammar rows launches its forward, then (after N is processed, so every
        grammar has taken its request's latest token) the host fills the allowed-token masks while the forward
        runs, and the draws are queued with them (`ModelRunner.draw_masked`)."""
        if not self.overlap:
            scheduled = self.scheduler.schedule()
            if scheduled is None:
                return []
            handle = self.runner.launch(scheduled.plan)
            failed = self._draw_masked(scheduled, handle)
            return failed + self._process(scheduled, self.runner.collect(handle))
        previous, self._in_flight = self._in_flight, None
        outputs = []
        if previous is not None and previous[0].forks:
            outputs, previous = self._process(previous[0], self.runner.collect(previous[1])), None
        scheduled = self.scheduler.schedule()
        if scheduled is not None:
            self._in_flight = (scheduled, self.runner.launch(scheduled.plan))
        if previous is not None:
            outputs += self._process(previous[0], self.runner.collect(previous[1]))
        if scheduled is not None:
            outputs += self._draw_masked(*self._in_flight)
        self._settle_discarded()
        return outputs

    def _draw_masked(self, scheduled: ScheduledStep, handle: StepHandle) -> list[RequestOutput]:
        """Queue the draws of a launched step with grammar rows, with each such row's allowed tokens (steps
        without grammar rows drew at launch). Called once every earlier step is processed, so each grammar has
        taken its request's tokens so far. Rows of requests that finished meanwhile are left unconstrained (their
        draws are discarded); a request whose grammar fails here fails alone (its output is returned)."""
        if not handle.awaits_mask:
            return []
        constrained: list[tuple[Group, GrammarState, int]] = []  # (group, state, draws), a row per draw
        draw_rows: list[int] = []
        draw = 0
        for request, rows in zip(scheduled.requests, scheduled.plan.samples):
            sequence = self.output_processor.sequences.get(request.request_id)
            if rows and sequence is not None and sequence.grammar is not None and not request.finished:
                constrained.append((sequence.group, sequence.grammar, len(rows)))
                draw_rows += range(draw, draw + len(rows))
            draw += len(rows)
        mask = TokenMask.allocate(draw_rows, self.vocab_size) if draw_rows else None
        failed = []
        if constrained:
            firsts = list(itertools.accumulate([count for _, _, count in constrained[:-1]], initial=0))
            errors = self._mask_filler().fill([state for _, state, _ in constrained], mask.bits, firsts)
            for i, ((group, _, count), row) in enumerate(zip(constrained, firsts)):
                if i in errors:  # its draws are discarded: leave them unconstrained
                    if group.error is None:
                        self.output_processor.fail(group, errors[i])
                        failed.append(group)
                    mask.bits[row] = -1
                if count > 1:  # a prompt's forks draw from the same (initial) state
                    mask.bits[row + 1:row + count] = mask.bits[row]
        self.runner.draw_masked(mask)
        return self.output_processor.outputs(failed)

    def _mask_filler(self) -> MaskFiller:
        """Created on first use: xgrammar is imported only by engines that serve a grammar."""
        if self._filler is None:
            self._filler = MaskFiller()
        return self._filler

    def _settle_discarded(self) -> None:
        """Process the step in flight now if every request in it has finished (its work is all discarded), so an
        engine without requests holds nothing: no checkpoint slot of that step, no step to wait for."""
        if self._in_flight is not None and all(r.finished for r in self._in_flight[0].requests):
            scheduled, handle = self._in_flight
            self._in_flight = None
            self._process(scheduled, self.runner.collect(handle))

    def _process(self, scheduled: ScheduledStep, results: list[ChunkResult]) -> list[RequestOutput]:
        """Settle a finished step in the caches and turn its tokens into outputs."""
        accepted = self._accept_drafts(scheduled, results)
        self.cache_manager.settle(scheduled.cache, scheduled.requests)
        return self.output_processor.process(scheduled, results, accepted)

    def _accept_drafts(self, scheduled: ScheduledStep, results: list[ChunkResult]) -> dict[int, int]:
        """Count each live verify row's accepted drafts (the same count the runner committed its state by) and roll
        its computed length and pages back to them, before the step's pages are cached. {request serial: count}

        The acceptance counters take every draft verification accepted, also those a stop inside the run then drops
        from the output (as vLLM's spec-decode counters do): they measure the drafter against the target, not where
        a request happened to end. Rows of requests finished or aborted meanwhile, or failed, are not counted."""
        accepted = {}
        for request, result, chunk in zip(scheduled.requests, results, scheduled.plan.chunks):
            if not chunk.num_drafts or request.finished or result.error is not None:
                continue
            drafts = chunk.token_ids[1:]
            accepted[request.serial] = n = accepted_length([s.token_id for s in result.sampled], drafts)
            self.cache_manager.accept(request, chunk.prefix_len + 1 + n)
            self.num_verify_rows += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += n
        return accepted
