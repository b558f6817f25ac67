"""The FastAPI app (routes) and `run_server`, which `hybridserve serve` calls.

The port opens at once; the model loads on the engine thread meanwhile (GET /health is 503 until it is ready).
If loading fails, or the engine fails later, the server shuts down and `run_server` returns non-zero.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from hybridserve.config import EngineConfig
from hybridserve.server.async_engine import AsyncEngine
from hybridserve.server.chat import create_chat_completion
from hybridserve.server.completions import create_completion
from hybridserve.server.errors import APIError, install_error_handlers
from hybridserve.server.generation import ClientDisconnected
from hybridserve.server.metrics import ServerMetrics
from hybridserve.server.prompts import chat_prompt
from hybridserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from hybridserve.server.state import ServerState

logger = logging.getLogger(__name__)


def build_app(state: ServerState, on_fatal: Callable[[], None]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.engine.start(asyncio.get_running_loop(), on_fatal)
        yield
        state.engine.stop()

    app = FastAPI(title="hybridserve", lifespan=lifespan)
    install_error_handlers(app)

    async def client_gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; the requests were aborted already

    app.add_exception_handler(ClientDisconnected, client_gone)

    @app.get("/health")
    async def health() -> Response:
        state.info()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        info = state.info()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "hybridserve", "root": info.model_dir,
                                            "max_model_len": info.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        return await create_completion(state, body, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        return await create_chat_completion(state, body, http)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        info = state.model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            tokens = chat_prompt(info.tokenizer, body.messages, body.chat_template_kwargs)
        else:
            tokens = info.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        info = state.model(body.model)
        size = len(info.tokenizer)
        bad = [token for token in body.tokens if not 0 <= token < size]
        if bad:
            raise APIError(f"token ids {bad[:5]} are outside the tokenizer's vocabulary [0, {size})", param="tokens")
        return {"prompt": info.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
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


def run_server(config: EngineConfig, model_name: str, host: str, port: int) -> int:
    """Serve until interrupted; 0 after a clean shutdown, 1 if the engine could not start or failed."""
    engine = AsyncEngine(config)
    state = ServerState(engine, ServerMetrics(engine.stats), model_name)
    app = build_app(state, on_fatal=lambda: setattr(server, "should_exit", True))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5))
    server.run()
    return 1 if engine.error is not None else 0
