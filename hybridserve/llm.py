"""Offline API: LLM(model).generate(prompts, params) -> list[RequestOutput], in the shape vLLM users know."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from hybridserve.config import EngineConfig
from hybridserve.demo import ensure_demo_checkpoint
from hybridserve.engine.engine import LLMEngine
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams
from hybridserve.tokenizer import chat_prompt_ids

Prompt = str | dict


class LLM:
    def __init__(self, model: str | None = None, **options):
        """`model`: a HF-layout directory (None = the built-in demo checkpoint); `options`: EngineConfig fields."""
        self.engine = LLMEngine(EngineConfig(model=model or str(ensure_demo_checkpoint()), **options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Prompts are strings or {"prompt_token_ids": [...]} / {"prompt": "..."}; results keep their order."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, _prompt_input(prompt), p)
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, conv, chat_template_kwargs)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params)


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
