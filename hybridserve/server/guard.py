"""The ASGI middleware in front of every route: the Host check, the API key, the request-body limit, and the 503
of a server that is shutting down. It answers in OpenAI's error shape before any route (or JSON parsing) runs.

- Host: a server bound to a loopback address answers only loopback names by default, so a web page cannot reach
  it through DNS rebinding (`--allowed-hosts` to change).
- API key (`--api-key` / HYBRIDSERVE_API_KEY): `Authorization: Bearer <key>` on /v1/*, /invocations, the
  tokenizer routes, /flush_cache and /get_model_info; the probes (/health, /health_generate, /ping, /metrics,
  /version) stay open.
- Body: a Content-Length over the limit is refused before reading; a chunked body is refused once it passes it.
  The body is read here and handed to the route unchanged.
"""
from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridserve.server.errors import (
    APIError,
    bad_host,
    body_too_large,
    shutting_down,
    unauthorized,
)
from hybridserve.server.state import ServerState

# With an API key: every route but the probes (/health, /health_generate, /ping, /metrics, /version).
_PROTECTED_PREFIXES = ("/v1/", "/invocations", "/tokenize", "/detokenize", "/tokenizer_info", "/flush_cache",
                       "/get_model_info")
_OPEN_WHILE_DRAINING = ("/metrics",)


def host_name(host_header: str) -> str:
    """The name part of a Host header: "[::1]:8000" -> "::1", "Example.com:80" -> "example.com"."""
    if host_header.startswith("["):
        return host_header[1:host_header.find("]")].lower()
    return host_header.rsplit(":", 1)[0].lower() if host_header.count(":") == 1 else host_header.lower()


class Guard:
    def __init__(self, app: ASGIApp, state: ServerState):
        self.app, self.state = app, state
        options = state.options
        self.api_key = options.api_key.encode() if options.api_key else None
        self.allowed_hosts = {name.lower() for name in options.allowed_hosts} if options.allowed_hosts else None
        self.limit = options.max_request_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        error = self._refusal(scope["path"], headers)
        if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
            receive, error = await self._read_body(headers, receive)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, path: str, headers: Headers) -> APIError | None:
        host = headers.get("host")
        if self.allowed_hosts is not None and host is not None and host_name(host) not in self.allowed_hosts:
            return bad_host(host)
        if self.state.draining and path not in _OPEN_WHILE_DRAINING:
            return shutting_down()
        if self.api_key is not None and path.startswith(_PROTECTED_PREFIXES):
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key):
                return unauthorized()
        return None

    async def _read_body(self, headers: Headers, receive: Receive) -> tuple[Receive, APIError | None]:
        """The whole body (or a 413), and a `receive` that hands it to the app and then passes through (the app
        keeps listening on it for the client's disconnect)."""
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return receive, body_too_large(self.limit)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return _replay([message], receive), None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return receive, body_too_large(self.limit)
            more = message.get("more_body", False)
        return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive), None


def _replay(messages: list[Message], receive: Receive) -> Callable[[], Awaitable[Message]]:
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
