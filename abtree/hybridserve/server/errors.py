"""OpenAI-style errors: one exception type for the handlers, and converters for every other failure.

Clients (the openai package, lm-eval, bench tools) parse `{"error": {"message", "type", "param", "code"}}`;
FastAPI's own 422 and 404 bodies have another shape, so they are converted here too.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def not_ready(message: str) -> APIError:
    return APIError(message, status=503, type="service_unavailable", code="service_unavailable")


def shutting_down() -> APIError:
    return not_ready("the server is shutting down; retry on another instance or after it restarts")


def unauthorized() -> APIError:
    return APIError("missing or incorrect API key; send it as 'Authorization: Bearer <key>'", status=401,
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def body_too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than this server's limit of {limit} bytes "
                    "(--max-request-body-bytes)", status=413, code="request_too_large")


def bad_host(host: str) -> APIError:
    return APIError(f"the Host header {host!r} is not one this server answers to (--allowed-hosts)",
                    code="invalid_host")


def _describe(error: dict) -> tuple[str | None, str]:
    """The top-level field and a message for one pydantic error of the request body."""
    loc = [str(part) for part in error["loc"]]
    if error["type"] == "json_invalid":
        return None, f"the request body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')})"
    fields = loc[1:] if loc and loc[0] == "body" else loc
    if not fields:
        return None, "the request body must be a JSON object"
    path = fields[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in fields[1:])
    return fields[0], f"invalid value for '{path}': {error['msg']}"


async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    param, message = _describe(exc.errors()[0])
    return APIError(message, param=param).response()


async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(str(exc.detail), status=exc.status_code, type=kind).response()


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error while serving a request")
    return APIError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                    type="internal_server_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
