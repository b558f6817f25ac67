"""POST /v1/completions: every OpenAI prompt form, echo with prompt logprobs, legacy logprobs, SSE streaming."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response
from transformers import PreTrainedTokenizerBase

from hybridserve.server.generation import Delta, Generation, respond
from hybridserve.server.logprobs import TokenText, legacy_logprobs, prompt_logprobs
from hybridserve.server.prompts import check_context, completion_prompts, count_prompts
from hybridserve.server.protocol import CompletionRequest, warn_unknown
from hybridserve.server.state import ServerState


class _CompletionView:
    """Turns deltas into completion choices; with echo, a choice's first delta carries the prompt too."""

    def __init__(self, body: CompletionRequest, tokenizer: PreTrainedTokenizerBase,
                 prompts: list[tuple[list[int], str | None]], call_id: str, model: str, tokens_as_ids: bool):
        self.body, self.tokenizer, self.prompts = body, tokenizer, prompts
        self.header = {"id": call_id, "object": "text_completion", "created": int(time.time()), "model": model,
                       "system_fingerprint": None}
        self.token_text = TokenText(tokenizer, tokens_as_ids)
        self.chars_sent: dict[int, int] = {}  # choice index -> characters sent (text_offset continues there)

    def _prompt_text(self, prompt_index: int) -> str:
        ids, text = self.prompts[prompt_index]
        return text if text is not None else self.tokenizer.decode(ids)

    def choice(self, delta: Delta, generation: Generation) -> dict:
        echo = bool(self.body.echo) and delta.first
        text = (self._prompt_text(delta.prompt_index) if echo else "") + delta.text
        logprobs = None
        if self.body.logprobs is not None:
            token_ids, entries = delta.token_ids, delta.logprobs
            if echo:
                output = generation.final[delta.prompt_index]
                token_ids, entries = output.prompt_token_ids + token_ids, output.prompt_logprobs + entries
            logprobs = legacy_logprobs(self.token_text, token_ids, entries, self.chars_sent.get(delta.index, 0))
        self.chars_sent[delta.index] = self.chars_sent.get(delta.index, 0) + len(text)
        choice = {"index": delta.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                  "stop_reason": delta.stop_reason}
        if self.body.return_token_ids:  # vLLM: the prompt's ids with a choice's first delta, then each delta's
            if delta.first:
                choice["prompt_token_ids"] = self.prompts[delta.prompt_index][0]
            choice["token_ids"] = delta.token_ids
        if self.body.prompt_logprobs is not None:  # never streamed: every delta is a first one
            output = generation.final[delta.prompt_index]
            choice["prompt_logprobs"] = prompt_logprobs(self.token_text, output.prompt_token_ids,
                                                        output.prompt_logprobs, self.body.prompt_logprobs)
        return choice

    async def chunks(self, generation: Generation) -> AsyncIterator[dict]:
        async for prompt_index, output in generation:
            for delta in generation.deltas(prompt_index, output):
                chunk = {**self.header, "choices": [self.choice(delta, generation)]}
                if self.body.continuous_usage:
                    chunk["usage"] = generation.usage()
                yield chunk
        if self.body.include_usage:
            yield {**self.header, "choices": [], "usage": generation.usage()}

    def response(self, generation: Generation) -> dict:
        # prompt_logprobs is always there (null when not asked for), as vLLM's clients expect
        choices = [{"prompt_logprobs": None} | self.choice(delta, generation) for delta in generation.final_deltas()]
        return {**self.header, "choices": choices, "usage": generation.usage()}


async def create_completion(server: ServerState, body: CompletionRequest, http: Request) -> Response:
    info = server.model(body.model)
    warn_unknown("/v1/completions", body.check_supported())
    params = body.to_sampling_params(info.sampling_defaults)
    await server.compile_grammar(params, body.structured_field)
    server.check_limits(count_prompts(body.prompt), params)
    prompts = await server.prompts.run(completion_prompts, info.tokenizer, body.prompt,
                                       body.add_special_tokens is not False, body.prompt_truncation(info.max_model_len))
    for ids, _ in prompts:
        check_context(len(ids), params.max_tokens, info.max_model_len, "max_tokens")
    call_id = f"cmpl-{uuid.uuid4().hex}"
    generation = Generation(server, http, call_id, [ids for ids, _ in prompts], server.default_max_tokens(params),
                            prompt_param="prompt")
    view = _CompletionView(body, info.tokenizer, prompts, call_id, server.model_name,
                           server.tokens_as_ids(body.return_tokens_as_token_ids))
    return await respond(generation, view, bool(body.stream))
