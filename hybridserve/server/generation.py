"""Generation: one API call's engine requests, the outputs they send back, and what is new in each.

A call becomes one engine request per prompt (the engine computes the prompt once and forks the n sequences),
submitted as one group, with outputs in the call's own mailbox. Choice `index` = prompt index * n + sequence
index, as vLLM numbers them.

Deltas: the engine reports cumulative state, and its `text` is already safe to show (text that could still become
a stop string is held back), so what is new is simply the text and tokens past what was already sent.

Client disconnects: a watcher task waits for the ASGI disconnect message and aborts whatever is unfinished, at any
point, even when a streaming response never got to start its body; the engine then frees pages and state.

Errors after the response started (a request the engine aborted after a failure, the engine failing, the server
shutting down) end a stream with an OpenAI-shaped error event and `data: [DONE]`; a non-streaming call gets them as
its error response.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hybridserve.outputs import RequestOutput, TopLogprobs
from hybridserve.sampling import SamplingParamError, SamplingParams
from hybridserve.server.async_engine import EngineDead, EngineRequest, OutputMailbox
from hybridserve.server.errors import APIError, shutting_down
from hybridserve.server.metrics import RequestTimer
from hybridserve.server.protocol import invalid_field

if TYPE_CHECKING:
    from hybridserve.server.state import ServerState


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
class _Sent:
    chars: int = 0
    tokens: int = 0
    started: bool = False
    finished: bool = False


class Generation:
    def __init__(self, server: ServerState, http: Request, call_id: str, prompts: list[list[int]],
                 params: SamplingParams, prompt_param: str):
        self.server, self.engine, self.metrics, self.http = server, server.engine, server.metrics, http
        self.n = params.n
        self.prompt_param = prompt_param
        self.requests = [EngineRequest(f"{call_id}-{i}", ids, params) for i, ids in enumerate(prompts)]
        self.final: list[RequestOutput | None] = [None] * len(prompts)  # latest output per prompt
        self._index = {request.request_id: i for i, request in enumerate(self.requests)}
        self._unfinished = set(self._index)
        self._aborted = False
        self._sent = [_Sent() for _ in range(len(prompts) * self.n)]
        self._mailbox = OutputMailbox()
        self._timers: dict[str, RequestTimer] = {}
        self._watcher: asyncio.Task | None = None

    async def start(self) -> None:
        """Submit the requests; a prompt the engine rejects becomes a 400 (and nothing runs)."""
        if self.server.draining:
            raise shutting_down()
        arrival = time.monotonic()
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
        self._abort_unfinished()
        self.server.generations.discard(self)

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
        """(prompt index, cumulative output) as the engine reports progress, until every prompt is finished.

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
                self.final[prompt_index] = output
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
        """What is new in `output` for each of its choices; a choice with nothing visible yet gives none."""
        found = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            sent = self._sent[index]
            text = completion.text[sent.chars:]
            if sent.finished or (not text and completion.finish_reason is None):
                continue
            logprobs = completion.logprobs[sent.tokens:] if completion.logprobs is not None else None
            found.append(Delta(index, prompt_index, text, completion.token_ids[sent.tokens:], logprobs,
                               completion.finish_reason, completion.stop_reason, first=not sent.started))
            sent.chars, sent.tokens = len(completion.text), len(completion.token_ids)
            sent.started, sent.finished = True, completion.finish_reason is not None
        return found

    def final_deltas(self) -> list[Delta]:
        """Every choice in full, in index order (the body of a non-streaming response)."""
        found = [delta for i, output in enumerate(self.final) for delta in self.deltas(i, output)]
        return sorted(found, key=lambda delta: delta.index)

    def usage(self) -> dict:
        prompt = sum(len(request.prompt_token_ids) for request in self.requests)
        outputs = [output for output in self.final if output is not None]
        completion = sum(len(c.token_ids) for output in outputs for c in output.outputs)
        cached = sum(output.num_cached_tokens for output in outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _engine_failed(err: EngineDead) -> APIError:
    return APIError(str(err), status=500, type="internal_server_error")


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"


class View(Protocol):
    """How one endpoint shapes a generation: SSE chunks, or one JSON body."""

    def chunks(self, generation: Generation) -> AsyncIterator[dict]: ...

    def response(self, generation: Generation) -> dict: ...


async def respond(generation: Generation, view: View, stream: bool) -> Response:
    """Start the generation (a rejected prompt fails here, before any byte is sent), then stream it or wait."""
    await generation.start()
    if stream:
        return _stream_response(generation, view.chunks(generation))
    await generation.wait()
    return JSONResponse(view.response(generation))


def _stream_response(generation: Generation, events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`; the generation is closed however the
    stream ends (finished, client gone, or cancelled by the server)."""
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield _sse(event)
        except ClientDisconnected:
            return
        except APIError as err:
            yield _sse(err.body())
        finally:
            generation.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
