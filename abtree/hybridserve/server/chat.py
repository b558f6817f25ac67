"""POST /v1/chat/completions: messages rendered with the model's chat template, chat logprobs, SSE streaming."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response
from transformers import PreTrainedTokenizerBase

from hybridserve.server.generation import Delta, Generation, respond
from hybridserve.server.logprobs import TokenText, chat_logprobs
from hybridserve.server.prompts import chat_prompt, check_context
from hybridserve.server.protocol import ChatCompletionRequest, warn_unknown
from hybridserve.server.state import ServerState


class _ChatView:
    def __init__(self, body: ChatCompletionRequest, tokenizer: PreTrainedTokenizerBase, call_id: str, model: str):
        self.body = body
        self.token_text = TokenText(tokenizer)
        self.created = int(time.time())
        self.call_id, self.model = call_id, model

    def _header(self, obj: str) -> dict:
        return {"id": self.call_id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, delta: Delta) -> dict | None:
        if not self.body.logprobs:
            return None
        return {"content": chat_logprobs(self.token_text, delta.token_ids, delta.logprobs, self.body.top_logprobs or 0)}

    def _chunk(self, choice: dict) -> dict:
        return {**self._header("chat.completion.chunk"), "choices": [choice]}

    async def chunks(self, generation: Generation) -> AsyncIterator[dict]:
        for index in range(len(generation.requests) * generation.n):  # the role comes first, before any token
            yield self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None})
        async for prompt_index, output in generation:
            for delta in generation.deltas(prompt_index, output):  # content is always a string, possibly ""
                yield self._chunk({"index": delta.index, "delta": {"content": delta.text},
                                   "logprobs": self._logprobs(delta), "finish_reason": delta.finish_reason,
                                   "stop_reason": delta.stop_reason})
        if self.body.include_usage:
            yield {**self._header("chat.completion.chunk"), "choices": [], "usage": generation.usage()}

    def response(self, generation: Generation) -> dict:
        choices = [{"index": delta.index, "message": {"role": "assistant", "content": delta.text},
                    "logprobs": self._logprobs(delta), "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason} for delta in generation.final_deltas()]
        return {**self._header("chat.completion"), "choices": choices, "usage": generation.usage()}


async def create_chat_completion(server: ServerState, body: ChatCompletionRequest, http: Request) -> Response:
    info = server.model(body.model)
    warn_unknown("/v1/chat/completions", body.check_supported())
    params = body.to_sampling_params()
    server.check_choices(1, params.n)
    options = body.template_options(server.options.trust_request_chat_template)
    prompt = await server.prompts.run(chat_prompt, info.tokenizer, body.messages, options,
                                      body.add_special_tokens is True)
    check_context(len(prompt), params.max_tokens, info.max_model_len, body.max_tokens_param)
    call_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = Generation(server, http, call_id, [prompt], server.default_max_tokens(params),
                            prompt_param="messages")
    return await respond(generation, _ChatView(body, info.tokenizer, call_id, server.model_name), bool(body.stream))
