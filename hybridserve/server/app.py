"""The FastAPI app (routes) and `run_server`, which `hybridserve serve` calls.

The port is bound before anything loads (the CLI does it, so a port in use fails at once); it opens when the app
starts, and the model loads in the engine's process meanwhile (GET /health is 503 until it is ready). SIGTERM and
Ctrl+C stop admitting, give the calls in flight a short grace period, end the rest with an error (streams: an error
event and [DONE]) and exit. If loading fails, or the engine fails later, the server shuts down and `run_server`
returns non-zero.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import signal
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from hybridserve.config import EngineConfig
from hybridserve.engine.stats_log import StatsLine
from hybridserve.sampling import SamplingParams, out_of_vocabulary
from hybridserve.server.async_engine import AsyncEngine
from hybridserve.server.replicas import ReplicaSet
from hybridserve.server.chat import create_chat_completion
from hybridserve.server.responses import create_response, stored_response
from hybridserve.server.responses_protocol import ResponsesRequest
from hybridserve.server.completions import create_completion
from hybridserve.server.errors import APIError, install_error_handlers
from hybridserve.server.generation import ClientDisconnected, Generation
from hybridserve.server.guard import Guard
from hybridserve.server.metrics import ServerMetrics
from hybridserve.server.openapi import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelInfo,
    ModelList,
    ResponseObject,
    TokenizeResponse,
    TokenizerInfo,
    VersionInfo,
    install_openapi,
    responses,
)
from hybridserve.server.prompts import chat_prompt
from hybridserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    warn_unknown,
)
from hybridserve.server.settings import ServerOptions
from hybridserve.server.state import ServerState

logger = logging.getLogger(__name__)

_ENGINE_STOP_WAIT_S = 1.5  # a step in progress may finish; the engine's process is terminated after that
_VERSION = importlib.metadata.version("hybridserve")


_PROBES = frozenset({"/health", "/ping", "/metrics"})  # polled by load balancers and scrapers: no access-log line


class _QuietProbes(logging.Filter):
    """Drops uvicorn's access-log lines of health checks and metric scrapes (its record's args: client, method,
    path, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) > 2 and str(args[2]).split("?")[0] in _PROBES)


async def _log_stats(state: ServerState, interval_s: float) -> None:
    """The stats line every `interval_s` while the server is busy (hybridserve/engine/stats_log.py)."""
    stats = StatsLine()
    while True:
        text = stats.line(state.engine.stats(), time.monotonic())
        if text is not None:
            logger.info("%s", text)
        await asyncio.sleep(interval_s)


def build_app(state: ServerState, on_fatal: Callable[[], None], url: str = "") -> FastAPI:
    options = state.options

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.engine.start(state.loop, on_fatal)
        stats = None if options.disable_log_stats else \
            asyncio.create_task(_log_stats(state, options.log_stats_interval_s))
        logger.info("serving %s at %s/v1 (GET /health turns 200 once the model is loaded)",
                    " / ".join(f"'{name}'" for name in options.served_model_names), url)
        yield
        if stats is not None:
            stats.cancel()
        state.prompts.close()
        state.engine.stop(_ENGINE_STOP_WAIT_S)

    app = FastAPI(title="hybridserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API of hybridserve (completions, chat, responses, tokenizer, "
                              "metrics).")
    install_error_handlers(app)
    install_openapi(app, api_key=state.options.api_key is not None)
    app.add_middleware(Guard, state=state)

    async def client_gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; the requests were aborted already

    app.add_exception_handler(ClientDisconnected, client_gone)

    @app.api_route("/health", methods=["GET"], response_class=Response,
                   responses={200: {"description": "ready (empty body)"}, **responses(None, 503)})
    @app.api_route("/ping", methods=["GET", "POST"], response_class=Response,
                   responses={200: {"description": "ready (empty body): /health, as SageMaker probes it"},
                              **responses(None, 503)})
    async def health() -> Response:
        state.info()
        return Response(status_code=200)

    @app.get("/health_generate", response_class=Response,
             responses={200: {"description": "one token was generated (empty body)"}, **responses(None, 500, 503)})
    async def health_generate(http: Request) -> Response:
        """SGLang's deep health check: a one-token greedy generation through the engine."""
        info = state.info()
        generation = Generation(state, http, f"health-{uuid.uuid4().hex}", [[info.eos_token_ids[0]]],
                                SamplingParams(max_tokens=1, temperature=0.0), prompt_param="prompt")
        await generation.start()
        await generation.wait()
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"], response_model=None,
                   responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                    "description": "the prefix cache was emptied"}, **responses(None, 400, 503)})
    async def flush_cache() -> Response:
        """SGLang's: drop every prefix-cache entry; refused while requests are queued or running."""
        state.info()
        if not await state.engine.flush_cache():
            raise APIError("the prefix cache was not flushed: requests are queued or running; retry when idle",
                           code="requests_in_flight")
        return Response("Cache flushed.\n", media_type="text/plain")

    @app.get("/version", response_model=None, responses=responses(VersionInfo))
    async def version() -> dict:
        return {"version": _VERSION}

    @app.get("/get_model_info", response_model=None, responses=responses(ModelInfo, 503))
    async def get_model_info() -> dict:
        """SGLang's model description."""
        info = state.info()
        return {"model_path": options.model_path, "tokenizer_path": info.tokenizer_path, "is_generation": True,
                "model_type": info.model_type, "max_model_len": info.max_model_len,
                "served_model_names": list(options.served_model_names)}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        info = state.info()
        return {"id": name, "object": "model", "created": state.created, "owned_by": "hybridserve",
                "root": options.model_path, "max_model_len": info.max_model_len}

    @app.get("/v1/models", response_model=None, responses=responses(ModelList, 401, 503))
    async def models() -> dict:
        return {"object": "list", "data": [model_card(name) for name in options.served_model_names]}

    @app.get("/v1/models/{model:path}", response_model=None, responses=responses(ModelCard, 401, 404, 503))
    async def model(model: str) -> dict:
        state.model(model)
        return model_card(model)

    @app.post("/v1/completions", responses=responses(CompletionResponse, 400, 401, 404, 413, 500, 503, stream=True))
    async def completions(body: CompletionRequest, http: Request) -> Response:
        return await create_completion(state, body, http)

    @app.post("/v1/chat/completions",
              responses=responses(ChatCompletionResponse, 400, 401, 404, 413, 500, 503, stream=True))
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        return await create_chat_completion(state, body, http)

    @app.post("/invocations", response_model=None,
              responses=responses(CompletionResponse, 400, 401, 404, 413, 500, 503, stream=True))
    async def invocations(body: dict[str, Any], http: Request) -> Response:
        """SageMaker's inference route (vLLM serves it): a chat-completions body (one with messages) or a
        completions body, answered as that route answers it."""
        kind, handler = (ChatCompletionRequest, create_chat_completion) if "messages" in body else \
            (CompletionRequest, create_completion)
        try:
            request = kind.model_validate(body)
        except ValidationError as err:
            raise RequestValidationError(err.errors()) from None
        return await handler(state, request, http)

    @app.post("/v1/responses", responses=responses(ResponseObject, 400, 401, 404, 413, 500, 503, stream=True))
    async def create_responses(body: ResponsesRequest, http: Request) -> Response:
        return await create_response(state, body, http)

    @app.get("/v1/responses/{response_id}", response_model=None, responses=responses(ResponseObject, 401, 404, 503))
    async def get_response(response_id: str) -> dict:
        state.info()
        return stored_response(state, response_id)

    @app.post("/tokenize", response_model=None, responses=responses(TokenizeResponse, 400, 401, 404, 413, 503))
    async def tokenize(body: TokenizeRequest) -> dict:
        info = state.model(body.model)
        warn_unknown("/tokenize", body.check_supported())
        if body.messages is not None:
            options = body.template_options(state.options.trust_request_chat_template, body.messages)
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
            tokens, _ = await state.prompts.run(chat_prompt, info.tokenizer, body.messages, options,
                                                body.add_special_tokens is True, tools)
        else:
            tokens = await state.prompts.run(partial(info.tokenizer.encode, add_special_tokens=body.add_special_tokens
                                                     is not False), body.prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": info.max_model_len}

    @app.post("/detokenize", response_model=None, responses=responses(DetokenizeResponse, 400, 401, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest) -> dict:
        info = state.model(body.model)
        warn_unknown("/detokenize", body.check_supported())
        why = out_of_vocabulary(body.tokens, info.vocab_size)
        if why is not None:  # the ids a prompt may hold: the model's vocabulary (ids past the tokenizer's decode to "")
            raise APIError(why, param="tokens")
        return {"prompt": await state.prompts.run(info.tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info", response_model=None, responses=responses(TokenizerInfo, 401, 503))
    async def tokenizer_info() -> dict:
        info = state.info()
        tokenizer = info.tokenizer
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                "eos_token_id": tokenizer.eos_token_id, "bos_token": tokenizer.bos_token,
                "bos_token_id": tokenizer.bos_token_id, "pad_token": tokenizer.pad_token,
                "pad_token_id": tokenizer.pad_token_id, "unk_token": tokenizer.unk_token,
                "chat_template": tokenizer.chat_template, "model_max_length": info.max_model_len,
                "vocab_size": len(tokenizer)}

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, bound now (before anything loads) so that a port in use fails at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}; stop what uses it or choose "
                         "another --port / --host") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, with SIGTERM / Ctrl+C starting our drain before uvicorn's own graceful shutdown."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]):
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self._on_signal()
        super().handle_exit(sig, frame)


def uvicorn_config(app: FastAPI, options: ServerOptions) -> uvicorn.Config:
    """uvicorn's settings: our logging (log_config=None keeps the root logger's format), at uvicorn's own level
    (--uvicorn-log-level), and a graceful-shutdown bound past our drain's grace period."""
    return uvicorn.Config(app, log_config=None, log_level=options.uvicorn_log_level,
                          timeout_graceful_shutdown=options.shutdown_grace_s + 1,
                          access_log=not options.disable_uvicorn_access_log)


def run_server(config: EngineConfig, options: ServerOptions, sock: socket.socket) -> int:
    """Serve until interrupted; 0 after a clean shutdown, 1 if the engine could not start or failed."""
    engine = AsyncEngine(config, chat_template=options.chat_template) if options.data_parallel_size == 1 else \
        ReplicaSet(config, options.data_parallel_size, chat_template=options.chat_template)
    state = ServerState(engine, ServerMetrics(engine.stats, options.served_model_name), options)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def on_fatal() -> None:
        server.should_exit = True

    app = build_app(state, on_fatal, url)
    logging.getLogger("uvicorn.access").addFilter(_QuietProbes())
    server = _Server(uvicorn_config(app, options), state.begin_shutdown)
    # uvicorn re-raises a caught signal once it is done; with these no-op handlers in place then, a clean shutdown
    # ends here instead of in a KeyboardInterrupt traceback or a kill by SIGTERM.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if engine.error is not None else 0
