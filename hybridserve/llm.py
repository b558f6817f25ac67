"""Offline API: LLM(model).generate(prompts, params) -> list[RequestOutput], in the shape vLLM users know."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from tqdm import tqdm

from hybridserve.config import EngineConfig
from hybridserve.demo import ensure_demo_checkpoint
from hybridserve.engine.engine import LLMEngine
from hybridserve.hub import local_checkpoint
from hybridserve.outputs import RequestOutput, RequestOutputKind
from hybridserve.sampling import SamplingParams
from hybridserve.tokenizer import chat_prompt_ids

Prompt = str | dict


class LLM:
    def __init__(self, model: str | None = None, use_tqdm: bool = True, **options):
        """`model`: a Hugging Face Hub id (downloaded, or found in the cache when HF_HUB_OFFLINE is set; `revision`
        and `download_dir` apply) or an HF-layout directory; None = the built-in demo checkpoint. `use_tqdm`:
        progress bars (download, weight loading, and generate()'s default); `options`: EngineConfig fields."""
        self.use_tqdm = use_tqdm
        config = EngineConfig(model=model or str(ensure_demo_checkpoint()), use_tqdm=use_tqdm, **options)
        self.engine = LLMEngine(local_checkpoint(config))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (before building another multi-rank LLM in this process)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use when given no SamplingParams: the model's generation-config defaults
        (`generation_config`: auto, vllm or a directory), else SamplingParams' own."""
        return self.engine.default_sampling_params()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Prompts are strings or {"prompt_token_ids": [...]} / {"prompt": "..."}; results keep their order.

        Every prompt is checked before any is queued, so a bad one (ValueError) leaves nothing behind; an
        interrupted call aborts what it queued."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        inputs = [_prompt_input(prompt) for prompt in prompts]
        for i, (prompt, p) in enumerate(zip(inputs, params)):
            try:
                self.engine.validate_prompt(self.engine.tokenize_prompt(prompt))
                self.engine.validate_params(p)
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from None
        ids = [f"offline-{next(self._ids)}" for _ in inputs]
        finished: dict[str, RequestOutput] = {}
        try:
            for request_id, prompt, p in zip(ids, inputs, params):
                # The engine folds each step's delta in and hands back only the finished output.
                self.engine.add_request(request_id, prompt, replace(p, output_kind=RequestOutputKind.FINAL_ONLY))
            with tqdm(total=len(ids), desc="generating", unit="request",
                      disable=not (self.use_tqdm if use_tqdm is None else use_tqdm)) as progress:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            progress.update()
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return [finished[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             chat_template_kwargs: dict | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, conv, chat_template_kwargs)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
