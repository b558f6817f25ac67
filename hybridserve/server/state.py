"""ServerState: what every route shares (the engine, metrics, the prompt worker, the API calls in flight, the
operator's ServerOptions), the readiness gate and the shutdown drain."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from hybridserve.parsers import ReasoningFormat, ToolFormat, model_tool_format, reasoning_format, tool_format
from hybridserve.sampling import SamplingParamError, SamplingParams
from hybridserve.server.async_engine import AsyncEngine, EngineInfo
from hybridserve.server.replicas import ReplicaSet
from hybridserve.server.errors import APIError, not_ready, shutting_down
from hybridserve.server.metrics import ServerMetrics
from hybridserve.server.prompts import PromptWorker
from hybridserve.server.response_store import ResponseStore
from hybridserve.server.settings import FALLBACK_MAX_TOKENS, ServerOptions
from hybridserve.server.protocol import invalid_field, structured_output_error
from hybridserve.structured import StructuredOutputError


class InFlight(Protocol):
    """An API call with requests in the engine (`server.generation.Generation`), as the shutdown drain sees it:
    the state names only this, so that the calls, which read the state, are not imported by it."""

    def interrupt(self, error: APIError) -> None:
        """End the call now with `error`."""


@dataclass
class ServerState:
    engine: AsyncEngine | ReplicaSet
    metrics: ServerMetrics
    options: ServerOptions
    prompts: PromptWorker = field(default_factory=PromptWorker)
    created: int = field(default_factory=lambda: int(time.time()))
    generations: set[InFlight] = field(default_factory=set)  # API calls with requests in the engine
    draining: bool = False  # shutting down: nothing new is admitted
    loop: asyncio.AbstractEventLoop | None = None  # the event loop serving the app, once it started
    responses: ResponseStore = field(init=False)  # finished Responses-API responses

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.options.response_store_size, self.options.response_store_ttl_s)
    _drain_task: asyncio.Task | None = None

    @property
    def model_name(self) -> str:
        return self.options.served_model_name

    def info(self) -> EngineInfo:
        """The loaded model, or a 503 while it loads, after the engine failed, or while shutting down."""
        if self.draining:
            raise shutting_down()
        if self.engine.error is not None:
            raise not_ready(f"the engine has failed ({self.engine.error}); restart the server")
        if self.engine.info is None:
            raise not_ready("the model is still loading; retry when GET /health returns 200")
        return self.engine.info

    def model(self, requested: str | None) -> EngineInfo:
        """`info()` for a request naming `requested` (None: the served model); unknown names are a 404."""
        info = self.info()
        names = self.options.served_model_names
        if requested is not None and requested not in names:
            raise APIError(f"the model '{requested}' does not exist; this server serves "
                           f"{' or '.join(repr(name) for name in names)}", status=404, type="not_found_error",
                           param="model", code="model_not_found")
        return info

    def tool_format(self) -> ToolFormat:
        """--tool-call-parser's format, or the loaded model type's own."""
        name = self.options.tool_call_parser
        return tool_format(name) if name is not None else model_tool_format(self.info().model_type)

    @property
    def reasoning_format(self) -> ReasoningFormat | None:
        return reasoning_format(self.options.reasoning_parser) if self.options.reasoning_parser else None

    def check_limits(self, num_prompts: int, params: SamplingParams, names: dict[str, str] | None = None) -> None:
        """The operator's bounds on one request: sequences (prompts x n, --max-n) and logprobs per token
        (--max-logprobs); `names` maps SamplingParams names to the request's fields."""
        n = params.n
        if num_prompts * n > self.options.max_n:
            raise APIError(f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; "
                           f"this server allows at most {self.options.max_n} per request (--max-n)", param="n")
        try:
            params.check_logprobs(self.info().max_logprobs)
        except SamplingParamError as err:
            raise invalid_field(err, names) from None

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """Whether logprobs name tokens "token_id:{id}": the request's return_tokens_as_token_ids, else the
        server's --return-tokens-as-token-ids."""
        return self.options.return_tokens_as_token_ids if requested is None else requested

    def default_max_tokens(self, params: SamplingParams) -> SamplingParams:
        """Requests without max_tokens get --default-max-tokens, else the generation config's max_new_tokens, else
        FALLBACK_MAX_TOKENS (the engine still stops at the context's end)."""
        if params.max_tokens is not None:
            return params
        limit = self.options.default_max_tokens or self.info().sampling_defaults.get("max_tokens") or \
            FALLBACK_MAX_TOKENS
        try:
            return replace(params, max_tokens=limit)
        except SamplingParamError as err:  # min_tokens above the default
            raise invalid_field(err) from None

    async def compile_grammar(self, params: SamplingParams, field: str | None) -> None:
        """Compile a request's grammar on a worker thread before it is queued (the engine's process is sent the
        compiled grammar instead of stalling every stream for a compile). One that cannot be compiled is a 400
        naming the request `field` that gave it."""
        if params.structured_output is None:
            return
        try:
            await asyncio.to_thread(self.engine.grammars.compile, params.structured_output)
        except StructuredOutputError as err:
            raise structured_output_error(err, field) from None

    def begin_shutdown(self) -> None:
        """Start `drain` on the event loop (callable from a signal handler)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Stop admitting; let the calls in flight finish for the grace period, then end them with a 503 (a
        final error event and [DONE] for streams)."""
        self.draining = True
        deadline = time.monotonic() + self.options.shutdown_grace_s
        while self.generations and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for generation in list(self.generations):
            generation.interrupt(shutting_down())
