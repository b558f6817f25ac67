"""Generation: one API call's engine requests, the outputs they send back, and what is new in each.

A call becomes one engine request per prompt (the engine computes the prompt once and forks the n sequences),
submitted as one group, with outputs in the call's own mailbox. Choice `index` = prompt index * n + sequence
index, as vLLM numbers them.

Deltas: the engine hands out only what is new per step (output kind DELTA), and its text is already safe to show
(text that could still become a stop string is held back). A choice's tokens whose text is still held back wait
here until their text comes; each call's outputs are also folded into `final` (for the non-streaming body, usage
and echo), all in time proportional to what is new.

Client disconnects: a watcher task waits for the ASGI disconnect message and aborts whatever is unfinished, at any
point, even when a streaming response never got to start its body; the engine then frees pages and state.

Errors after the response started (a request the engine aborted after a failure, the engine failing, the server
shutting down) end a stream with an OpenAI-shaped error event and `data: [DONE]`; a non-streaming call gets them as
its error response.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hybridserve.outputs import RequestOutput, RequestOutputKind, TopLogprobs
from hybridserve.sampling import SamplingParamError, SamplingParams
from hybridserve.server.async_engine import EngineDead, EngineRequest, OutputMailbox
from hybridserve.server.errors import APIError, shutting_down
from hybridserve.server.metrics import RequestTimer
from hybridserve.server.protocol import invalid_field
from hybridserve.server.state import ServerState

logger = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    pass


@dataclass
class Delta:
    """What is new for one choice since its previous delta (everything, for the first)."""

    index: int
    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[TopLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool


@dataclass
class _Unsent:
    """A choice's tokens (and logprobs) received but not sent yet (their text is still held back)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TopLogprobs] = field(default_factory=list)
    started: bool = False  # the choice's first delta went out


class Generation:
    def __init__(self, server: ServerState, http: Request, call_id: str, prompts: list[list[int]],
                 params: SamplingParams, prompt_param: str):
        self.server, self.engine, self.metrics, self.http = server, server.engine, server.metrics, http
        self.n = params.n
        self.prompt_param = prompt_param
        params = replace(params, output_kind=RequestOutputKind.DELTA)
        self.requests = [EngineRequest(f"{call_id}-{i}", ids, params) for i, ids in enumerate(prompts)]
        self.final: list[RequestOutput | None] = [None] * len(prompts)  # each prompt's deltas so far, folded
        self._index = {request.request_id: i for i, request in enumerate(self.requests)}
        self._unfinished = set(self._index)
        self._aborted = False
        self._unsent = [_Unsent() for _ in range(len(prompts) * self.n)]
        self._mailbox = OutputMailbox()
        self._timers: dict[str, RequestTimer] = {}
        self._watcher: asyncio.Task | None = None
        self.call_id = call_id
        self._arrival: float | None = None  # when it was submitted (None: not yet, or its end was logged)

    async def start(self) -> None:
        """Submit the requests; a prompt the engine rejects becomes a 400 (and nothing runs)."""
        if self.server.draining:
            raise shutting_down()
        self._arrival = arrival = time.monotonic()
        if self.server.options.log_requests:
            logger.info("request %s: %d prompt(s), %s prompt tokens; %s", self.call_id, len(self.requests),
                        "+".join(str(len(r.prompt_token_ids)) for r in self.requests),
                        self.requests[0].params.describe())
        self._timers = {request_id: RequestTimer(self.metrics, arrival) for request_id in self._index}
        self._watcher = asyncio.create_task(self._watch_disconnect())
        self.server.generations.add(self)
        try:
            await self.engine.add(self.requests, self._mailbox)
        except BaseException as err:
            self.close()
            if isinstance(err, EngineDead):
                raise _engine_failed(err) from None
            if isinstance(err, SamplingParamError):
                raise invalid_field(err) from None
            if isinstance(err, ValueError):
                raise APIError(str(err), param=self.prompt_param) from None
            if isinstance(err, Exception):  # the engine failed on this call's requests alone
                raise APIError(f"the engine could not add this request ({type(err).__name__}: {err})", status=500,
                               type="internal_server_error", code="request_failed") from None
            raise

    def close(self) -> None:
        """Stop watching the client and abort what has not finished (idempotent)."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self.server.options.log_requests and self._arrival is not None:
            self._log_end()
        self._abort_unfinished()
        self.server.generations.discard(self)

    def _log_end(self) -> None:
        reasons = Counter(str(c.finish_reason) for output in self.final if output is not None for c in output.outputs)
        logger.info("request %s %s: %d completion tokens, finish reasons %s, %.2f s", self.call_id,
                    "aborted" if self._unfinished else "finished", self.usage()["completion_tokens"], dict(reasons),
                    time.monotonic() - self._arrival)
        self._arrival = None

    def interrupt(self, error: APIError) -> None:
        """End the call now with `error` (the server is shutting down): abort its requests, wake its reader."""
        self._abort_unfinished()
        self._mailbox.interrupt(error)

    def _abort_unfinished(self) -> None:
        if self._unfinished and not self._aborted:
            self._aborted = True
            self.engine.abort(sorted(self._unfinished))

    async def _watch_disconnect(self) -> None:
        while (await self.http.receive())["type"] != "http.disconnect":
            pass
        self._abort_unfinished()
        self._mailbox.interrupt(ClientDisconnected())

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, its delta) as the engine reports progress, until every prompt is finished.

        Raises ClientDisconnected when the client goes away, an APIError (500) when the engine fails."""
        while self._unfinished:
            try:
                outputs = await self._mailbox.get()
            except EngineDead as err:
                raise _engine_failed(err) from None
            for output in outputs:
                if output.error is not None:
                    raise APIError(f"the request failed in the engine and was aborted ({output.error}); other "
                                   "requests are not affected", status=500, type="internal_server_error",
                                   code="request_failed")
                self._timers[output.request_id].observe(output)
                prompt_index = self._index[output.request_id]
                if self.final[prompt_index] is None:
                    self.final[prompt_index] = output.copy()
                else:
                    self.final[prompt_index].add(output)
                if output.finished:
                    self._unfinished.discard(output.request_id)
                yield prompt_index, output

    async def wait(self) -> None:
        """Run to the end (non-streaming calls); then `final` holds every prompt's finished output."""
        try:
            async for _ in self:
                pass
        finally:
            self.close()

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        """The choices' deltas for one delta output; a choice with no new visible text (and not finished) gives
        none yet: its tokens wait for their text."""
        found = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            unsent = self._unsent[index]
            unsent.token_ids += completion.token_ids
            if completion.logprobs is not None:
                unsent.logprobs += completion.logprobs
            if not completion.text and completion.finish_reason is None:
                continue
            found.append(Delta(index, prompt_index, completion.text, unsent.token_ids,
                               unsent.logprobs if completion.logprobs is not None else None,
                               completion.finish_reason, completion.stop_reason, first=not unsent.started))
            self._unsent[index] = _Unsent(started=True)
        return found

    def final_deltas(self) -> list[Delta]:
        """Every choice in full, in index order (the body of a non-streaming response)."""
        found = [Delta(prompt_index * self.n + c.index, prompt_index, c.text, c.token_ids, c.logprobs,
                       c.finish_reason, c.stop_reason, first=True)
                 for prompt_index, output in enumerate(self.final) for c in output.outputs]
        return sorted(found, key=lambda delta: delta.index)

    def cached_tokens(self) -> int:
        """The prompt tokens the prefix cache served, over the finished prompts."""
        return sum(output.num_cached_tokens for output in self.final if output is not None)

    def usage(self) -> dict:
        prompt = sum(len(request.prompt_token_ids) for request in self.requests)
        completion = sum(len(c.token_ids) for output in self.final if output is not None for c in output.outputs)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.server.options.prompt_tokens_details:  # as vLLM's: on every response with the flag, else never
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens()}
        return usage


def _engine_failed(err: EngineDead) -> APIError:
    return APIError(str(err), status=500, type="internal_server_error")


def _sse(event: dict, named: bool = False) -> str:
    data = f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
    return f"event: {event['type']}\n{data}" if named else data


class View(Protocol):
    """How one endpoint shapes a generation: SSE chunks, or one JSON body."""

    def chunks(self, generation: Generation) -> AsyncIterator[dict]: ...

    def response(self, generation: Generation) -> dict: ...


async def respond(generation: Generation, view: View, stream: bool) -> Response:
    """Start the generation (a rejected prompt fails here, before any byte is sent), then stream it or wait."""
    await generation.start()
    if stream:
        return stream_response(generation, view.chunks(generation))
    await generation.wait()
    return JSONResponse(view.response(generation))


def stream_response(generation: Generation, events: AsyncIterator[dict],
                    error_event: Callable[[APIError], dict] = APIError.body, named: bool = False) -> StreamingResponse:
    """Server-sent events: one `data:` line per event, then `data: [DONE]`; with `named` (the Responses API's
    framing) an `event: <type>` line before each and no [DONE]. A failure after the stream started is sent as
    `error_event(err)`. The generation is closed however the stream ends (finished, client gone, or cancelled by
    the server)."""
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield _sse(event, named)
        except ClientDisconnected:
            return
        except APIError as err:
            yield _sse(error_event(err), named)
        finally:
            generation.close()
        if not named:
            yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
