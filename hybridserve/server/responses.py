"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API on the chat machinery (the chat
template, the tool selection, structured output, reasoning and tool-call parsing).

One generator of stream events serves both modes: a streaming call sends each event (`event: <type>`, then
`data: {...}`; no [DONE]), a non-streaming call runs the same events and answers with the final response object,
so the two give the same output items. The items follow the output's order: a reasoning item (its text as
`reasoning_text` content), message items (`output_text`) and one function_call item per tool call (arguments sent
whole, when the call's closing tag has arrived). A response cut by max_output_tokens is `incomplete`.
A finished response is stored (unless `store` is false) with the conversation so far as input items, so
`previous_response_id` continues it; instructions are not carried over.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from hybridserve.parsers.tool_calls import ToolCall
from hybridserve.server.assistant import AssistantDelta, OutputParsing
from hybridserve.server.errors import APIError
from hybridserve.server.generation import Generation, stream_response
from hybridserve.server.protocol import warn_unknown
from hybridserve.server.responses_protocol import FunctionChoice, ResponsesRequest
from hybridserve.server.state import ServerState
from hybridserve.server.thinking import apply_effort
from hybridserve.server.tool_choice import select_tools


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _ResponseEvents:
    """The stream events of one response, and the response object they build."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str, parsing: OutputParsing,
                 earlier: list[dict], on_done: Callable[[dict, list[dict]], None]):
        """`earlier`: the stored turns this response continues; `on_done(response, items)` gets the finished
        response and the conversation so far (earlier turns, this input, this output) as input items."""
        self.body, self.parsing, self.earlier, self.on_done = body, parsing, earlier, on_done
        self.head = {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model}
        self.output: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item that text goes into
        self._sequence = 0
        self.response: dict | None = None  # the final response object, once the events are done

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return event

    def error_event(self, err: APIError) -> dict:
        return self._event("error", code=err.code or err.type, message=err.message, param=err.param)

    def snapshot(self, status: str, params_echo: dict, usage: dict | None = None) -> dict:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self.head, "status": status, "output": list(self.output), "error": None,
                "incomplete_details": incomplete, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
                "previous_response_id": body.previous_response_id, **params_echo, "store": body.store is not False,
                "usage": usage}

    # --- output items -------------------------------------------------------------------------------------------
    def _add(self, item: dict) -> list[dict]:
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _text(self, kind: str, text: str) -> list[dict]:
        """`text` into the open item of `kind` ("reasoning" or "message"), opened first if needed."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            item = {"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": []} if kind == "reasoning" \
                else {"type": "message", "id": _item_id("msg"), "status": "in_progress", "role": "assistant",
                      "content": []}
            events += self._add(item)
            self._open = {**item, "text": ""}
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.output) - 1, content_index=0, part=self._part(kind, "")))
        self._open["text"] += text
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(kind_event, item_id=self._open["id"], output_index=len(self.output) - 1,
                                  content_index=0, delta=text, **extra))
        return events

    @staticmethod
    def _part(kind: str, text: str) -> dict:
        return {"type": "reasoning_text", "text": text} if kind == "reasoning" else \
            {"type": "output_text", "text": text, "annotations": []}

    def _close(self, status: str) -> list[dict]:
        if self._open is None:
            return []
        item, self._open = self._open, None
        kind, text, index = item["type"], item.pop("text"), len(self.output) - 1
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        part = self._part(kind, text)
        final = {**item, "content": [part]} if kind == "reasoning" else {**item, "status": status, "content": [part]}
        self.output[index] = final
        return [self._event(done, item_id=item["id"], output_index=index, content_index=0, text=text, **extra),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=final)]

    def _call(self, call: ToolCall) -> list[dict]:
        events = self._close("completed")
        item = {"type": "function_call", "id": _item_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        events += self._add(item)
        index = len(self.output) - 1
        final = {**item, "arguments": call.arguments, "status": "completed"}
        self.output[index] = final
        return events + [
            self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=call.arguments),
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=call.name, arguments=call.arguments),
            self._event("response.output_item.done", output_index=index, item=final)]

    def _parsed(self, parsed: AssistantDelta) -> list[dict]:
        events = self._text("reasoning", parsed.reasoning) if parsed.reasoning else []
        for part in parsed.parts.parts:
            events += self._text("message", part) if isinstance(part, str) else self._call(part)
        return events

    # --- the stream ---------------------------------------------------------------------------------------------
    async def events(self, generation: Generation, params_echo: dict) -> AsyncIterator[dict]:
        yield self._event("response.created", response=self.snapshot("in_progress", params_echo))
        yield self._event("response.in_progress", response=self.snapshot("in_progress", params_echo))
        parser = self.parsing.parser()
        finish_reason = None
        async for _, output in generation:
            for delta in generation.deltas(0, output):
                parsed = parser.feed(delta.text, len(delta.token_ids))
                if delta.finish_reason is not None:
                    parsed += parser.finish()
                    finish_reason = delta.finish_reason
                for event in self._parsed(parsed):
                    yield event
        status = "incomplete" if finish_reason == "length" else "completed"
        for event in self._close(status):
            yield event
        usage = generation.usage()
        self.response = self.snapshot(status, params_echo, {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": generation.cached_tokens()},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": parser.reasoning_tokens},
            "total_tokens": usage["total_tokens"],
            # the chat API's names too, as SGLang's Responses usage has them
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]})
        self.on_done(self.response, self.earlier + self.body.input_items() + self.output)
        yield self._event(f"response.{status}", response=self.response)


def _params_echo(body: ResponsesRequest, temperature: float, top_p: float, parallel: bool) -> dict:
    """The request settings a response object repeats."""
    text_format = body.text.format if body.text is not None and body.text.format is not None else None
    return {"temperature": temperature, "top_p": top_p, "parallel_tool_calls": parallel,
            "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice)
            else body.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format is not None
                     else {"type": "text"}}}


async def create_response(server: ServerState, body: ResponsesRequest, http: Request) -> Response:
    info = server.model(body.model)
    warn_unknown("/v1/responses", body.check_supported())
    earlier = []
    if body.previous_response_id is not None:
        stored = server.responses.get(body.previous_response_id)
        if stored is None:
            raise APIError(f"no stored response has the id {body.previous_response_id!r} (responses are kept "
                           f"in memory for {server.options.response_store_ttl_s:g} s, at most "
                           f"{server.options.response_store_size} of them)", param="previous_response_id",
                           code="previous_response_not_found")
        earlier = stored.items
    options = {"add_generation_prompt": True}
    messages = apply_effort(body.effort, "reasoning.effort", info.tokenizer.chat_template, info.model_type,
                            body.messages(earlier), options)
    params = body.sampling_params(info.sampling_defaults)
    tools = select_tools(*body.chat_tools(), body.parallel_tool_calls)
    prompt, params, parsing = await tools.prepare_chat(
        server, info.tokenizer, info.max_model_len, messages, params, options, False, "text",
        {"max_tokens": "max_output_tokens"})
    response_id = _item_id("resp")
    generation = Generation(server, http, response_id, [prompt], server.default_max_tokens(params),
                            prompt_param="input")

    def store(response: dict, items: list[dict]) -> None:
        if body.store is not False:
            server.responses.put(response, items)

    view = _ResponseEvents(body, response_id, server.model_name, parsing, earlier, store)
    events = view.events(generation, _params_echo(body, params.temperature, params.top_p, tools.parallel))
    await generation.start()
    if body.stream:
        return stream_response(generation, events, view.error_event, named=True)
    try:
        async for _ in events:
            pass
    finally:
        generation.close()
    return JSONResponse(view.response)


def stored_response(server: ServerState, response_id: str) -> dict:
    stored = server.responses.get(response_id)
    if stored is None:
        raise APIError(f"no stored response has the id {response_id!r}", status=404, type="not_found_error",
                       param="response_id", code="response_not_found")
    return stored.response
