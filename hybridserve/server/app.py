"""The FastAPI app (routes) and `run_server`, which `hybridserve serve` calls.

The port is bound before anything loads (the CLI does it, so a port in use fails at once); it opens when the app
starts, and the model loads in the engine's process meanwhile (GET /health is 503 until it is ready). SIGTERM and
Ctrl+C stop admitting, give the calls in flight a short grace period, end the rest with an error (streams: an error
event and [DONE]) and exit. If loading fails, or the engine fails later, the server shuts down and `run_server`
returns non-zero.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from hybridserve.config import EngineConfig
from hybridserve.server.async_engine import AsyncEngine
from hybridserve.server.replicas import ReplicaSet
from hybridserve.server.chat import create_chat_completion
from hybridserve.server.responses import create_response, stored_response
from hybridserve.server.responses_protocol import ResponsesRequest
from hybridserve.server.completions import create_completion
from hybridserve.server.errors import APIError, install_error_handlers
from hybridserve.server.generation import ClientDisconnected
from hybridserve.server.guard import Guard
from hybridserve.server.metrics import ServerMetrics
from hybridserve.server.openapi import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ResponseObject,
    TokenizeResponse,
    TokenizerInfo,
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
from hybridserve.server.state import ServerOptions, ServerState

logger = logging.getLogger(__name__)

_ENGINE_STOP_WAIT_S = 1.5  # a step in progress may finish; the engine's process is terminated after that


def build_app(state: ServerState, on_fatal: Callable[[], None], url: str = "") -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.engine.start(state.loop, on_fatal)
        logger.info("serving '%s' at %s/v1 (GET /health turns 200 once the model is loaded)", state.model_name, url)
        yield
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

    @app.get("/health", response_class=Response, responses={200: {"description": "ready (empty body)"},
                                                           **responses(None, 503)})
    async def health() -> Response:
        state.info()
        return Response(status_code=200)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        info = state.info()
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "hybridserve",
                "root": info.model_dir, "max_model_len": info.max_model_len}

    @app.get("/v1/models", response_model=None, responses=responses(ModelList, 401, 503))
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", response_model=None, responses=responses(ModelCard, 401, 404, 503))
    async def model(model: str) -> dict:
        state.model(model)
        return model_card()

    @app.post("/v1/completions", responses=responses(CompletionResponse, 400, 401, 404, 413, 500, 503, stream=True))
    async def completions(body: CompletionRequest, http: Request) -> Response:
        return await create_completion(state, body, http)

    @app.post("/v1/chat/completions",
              responses=responses(ChatCompletionResponse, 400, 401, 404, 413, 500, 503, stream=True))
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        return await create_chat_completion(state, body, http)

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
            options = body.template_options(state.options.trust_request_chat_template)
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
        bad = [token for token in body.tokens if token >= info.vocab_size]
        if bad:  # the ids a prompt may hold: the model's vocabulary (ids past the tokenizer's decode to "")
            raise APIError(f"token ids {bad[:5]} are outside the vocabulary [0, {info.vocab_size})", param="tokens")
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


def run_server(config: EngineConfig, options: ServerOptions, sock: socket.socket) -> int:
    """Serve until interrupted; 0 after a clean shutdown, 1 if the engine could not start or failed."""
    engine = AsyncEngine(config, chat_template=options.chat_template) if options.data_parallel_size == 1 else \
        ReplicaSet(config, options.data_parallel_size, chat_template=options.chat_template)
    state = ServerState(engine, ServerMetrics(engine.stats), options)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def on_fatal() -> None:
        server.should_exit = True

    app = build_app(state, on_fatal, url)
    server = _Server(uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=options.shutdown_grace_s + 1),
                     state.begin_shutdown)
    # uvicorn re-raises a caught signal once it is done; with these no-op handlers in place then, a clean shutdown
    # ends here instead of in a KeyboardInterrupt traceback or a kill by SIGTERM.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if engine.error is not None else 0
