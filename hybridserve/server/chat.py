"""POST /v1/chat/completions: messages (and tools) rendered with the model's chat template, chat logprobs, SSE
streaming; each choice's text parsed into reasoning_content, content and tool_calls (server/assistant.py)."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response
from transformers import PreTrainedTokenizerBase

from hybridserve.parsers.tool_calls import ToolCall
from hybridserve.server.assistant import AssistantDelta, AssistantParser, OutputParsing
from hybridserve.server.generation import Delta, Generation, respond
from hybridserve.server.logprobs import TokenText, chat_logprobs, prompt_logprobs
from hybridserve.server.protocol import ChatCompletionRequest, warn_unknown
from hybridserve.server.state import ServerState
from hybridserve.server.thinking import apply_effort
from hybridserve.server.tool_choice import select_tools


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    """A call as chat messages carry it (with its `index` in streamed deltas)."""
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return entry if index is None else {"index": index, **entry}


class _ChatView:
    def __init__(self, body: ChatCompletionRequest, tokenizer: PreTrainedTokenizerBase, call_id: str, model: str,
                 parsing: OutputParsing, tokens_as_ids: bool):
        self.body, self.parsing = body, parsing
        self.token_text = TokenText(tokenizer, tokens_as_ids)
        self.created = int(time.time())
        self.call_id, self.model = call_id, model
        self.parsers: dict[int, AssistantParser] = {}  # streamed choices' parsers, by choice index
        self.calls_sent: dict[int, int] = {}  # streamed choices' tool calls so far

    def _header(self, obj: str) -> dict:
        return {"id": self.call_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _logprobs(self, delta: Delta) -> dict | None:
        if not self.body.logprobs:
            return None
        # with logprob_token_ids every scored token is shown (the listed ones), as vLLM does
        top_k = None if self.body.logprob_token_ids else self.body.top_logprobs or 0
        return {"content": chat_logprobs(self.token_text, delta.token_ids, delta.logprobs, top_k)}

    def _chunk(self, choice: dict, generation: Generation, **extra) -> dict:
        chunk = {**self._header("chat.completion.chunk"), **extra, "choices": [choice]}
        if self.body.continuous_usage:
            chunk["usage"] = generation.usage()
        return chunk

    def _choice(self, delta: Delta, content: dict, parser: AssistantParser) -> dict:
        finish_reason = "tool_calls" if delta.finish_reason == "stop" and parser.called else delta.finish_reason
        choice = {"index": delta.index, **content, "logprobs": self._logprobs(delta), "finish_reason": finish_reason,
                  "stop_reason": delta.stop_reason}
        if self.body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return choice

    def _prompt_extras(self, generation: Generation) -> dict:
        """vLLM's top-level prompt_token_ids (return_token_ids) and prompt_logprobs (never streamed)."""
        extras = {}
        if self.body.return_token_ids:
            extras["prompt_token_ids"] = generation.requests[0].prompt_token_ids
        if self.body.prompt_logprobs is not None:
            output = generation.final[0]
            extras["prompt_logprobs"] = prompt_logprobs(self.token_text, output.prompt_token_ids,
                                                        output.prompt_logprobs, self.body.prompt_logprobs)
        return extras

    def _stream_delta(self, delta: Delta) -> tuple[dict, AssistantParser]:
        parser = self.parsers.get(delta.index)
        if parser is None:  # one per choice, made at its first delta
            parser = self.parsers[delta.index] = self.parsing.parser()
        parsed = parser.feed(delta.text, len(delta.token_ids))
        if delta.finish_reason is not None:
            parsed += parser.finish()
        message = {"content": parsed.content}  # content is always a string, possibly ""
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            first = self.calls_sent.get(delta.index, 0)
            message["tool_calls"] = [tool_call_json(call, first + i) for i, call in enumerate(parsed.tool_calls)]
            self.calls_sent[delta.index] = first + len(parsed.tool_calls)
        return message, parser

    async def chunks(self, generation: Generation) -> AsyncIterator[dict]:
        for index in range(len(generation.requests) * generation.n):  # the role comes first, before any token
            yield self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}, generation, **self._prompt_extras(generation))
        async for prompt_index, output in generation:
            for delta in generation.deltas(prompt_index, output):
                message, parser = self._stream_delta(delta)
                yield self._chunk(self._choice(delta, {"delta": message}, parser), generation)
        if self.body.include_usage:
            yield {**self._header("chat.completion.chunk"), "choices": [], "usage": generation.usage()}

    def _message(self, parsed: AssistantDelta) -> dict:
        message = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.tool_calls else None}
        if self.parsing.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning or None
        if parsed.tool_calls:
            message["tool_calls"] = [tool_call_json(call) for call in parsed.tool_calls]
        return message

    def response(self, generation: Generation) -> dict:
        choices = []
        for delta in generation.final_deltas():
            parser = self.parsing.parser()
            parsed = parser.parse(delta.text, len(delta.token_ids))
            choices.append(self._choice(delta, {"message": self._message(parsed)}, parser))
        return {**self._header("chat.completion"), "prompt_logprobs": None, **self._prompt_extras(generation),
                "choices": choices, "usage": generation.usage()}


async def create_chat_completion(server: ServerState, body: ChatCompletionRequest, http: Request) -> Response:
    info = server.model(body.model)
    warn_unknown("/v1/chat/completions", body.check_supported())
    params = body.to_sampling_params(info.sampling_defaults)
    server.check_limits(1, params, body.field_names)
    tools = select_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    options = body.template_options(server.options.trust_request_chat_template, body.messages)
    messages = apply_effort(body.reasoning_effort, "reasoning_effort",
                            options.get("chat_template", info.tokenizer.chat_template), info.model_type,
                            body.messages, options)
    prompt, params, parsing = await tools.prepare_chat(
        server, info.tokenizer, info.max_model_len, messages, params, options, body.add_special_tokens is True,
        body.structured_field, body.field_names, body.prompt_truncation(info.max_model_len))
    call_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = Generation(server, http, call_id, [prompt], server.default_max_tokens(params),
                            prompt_param="messages")
    view = _ChatView(body, info.tokenizer, call_id, server.model_name, parsing,
                     server.tokens_as_ids(body.return_tokens_as_token_ids))
    return await respond(generation, view, bool(body.stream))
