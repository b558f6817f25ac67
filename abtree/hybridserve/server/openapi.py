"""The published OpenAPI schema: response bodies, the error responses of each route, and the API key scheme.

The routes build their JSON by hand (streaming and non-streaming share the code), so these models only document
what they send; the schemathesis test checks every response against them.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

FinishReason = Literal["stop", "length", "abort"] | None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: str | None
    eos_token_id: int | None
    bos_token: str | None
    bos_token_id: int | None
    pad_token: str | None
    pad_token_id: int | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


_ERRORS = {
    400: "invalid request (the message says what to change; `param` names the field)",
    401: "missing or wrong API key (only when the server runs with --api-key)",
    404: "unknown model",
    413: "request body over --max-request-body-bytes",
    500: "the request failed inside the engine and was aborted (other requests are unaffected)",
    503: "the model is still loading, the engine failed, or the server is shutting down",
}
_STREAM = ("with `stream: true`: server-sent events, one `data: {chunk}` per chunk, an error event `data: "
           '{"error": ...}` if the request fails after the stream started, then `data: [DONE]`')


def responses(model: type[BaseModel] | None, *errors: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """The `responses` argument of a route: its 200 body (and SSE when it streams) and its error responses."""
    documented: dict[int | str, dict[str, Any]] = {}
    if model is not None:
        documented[200] = {"model": model, "description": "success"}
        if stream:  # before OpenAPI 3.2 the schema of an event stream describes one event
            event = {"type": "object", "required": ["data"], "properties": {"data": {
                "type": "string", "description": "a JSON chunk, an error object, or [DONE]"}}}
            documented[200]["content"] = {"text/event-stream": {"schema": event}}
            documented[200]["description"] = "without `stream`: one JSON body; " + _STREAM
    for status in errors:
        documented[status] = {"model": ErrorResponse, "description": _ERRORS[status]}
    return documented


def install_openapi(app: FastAPI, api_key: bool) -> None:
    """FastAPI's schema, minus its 422 responses (validation errors are 400s here), plus the bearer scheme on the
    protected routes when an API key is set."""
    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description,
                                   routes=app.routes)
            for operations in document["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
                    if api_key and "401" in operation["responses"]:
                        operation["security"] = [{"bearer": []}]
            components = document.setdefault("components", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.get("schemas", {}).pop(name, None)
            if api_key:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = schema
