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
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # vLLM's shape: null for the first prompt token


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs
    prompt_token_ids: list[int] | None = None  # with return_token_ids (streamed: a choice's first chunk)
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: None  # OpenAI's field; always null here
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


class CalledFunction(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null when the message is only tool calls
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | Literal["tool_calls"]
    stop_reason: int | str | None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None  # OpenAI's field; always null here
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputReasoning(BaseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int
    prompt_tokens: int  # = input_tokens (SGLang's name)
    completion_tokens: int  # = output_tokens (SGLang's name)


class ResponseObject(BaseModel):
    """A Responses-API response (POST /v1/responses without stream, GET /v1/responses/{id})."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "in_progress"]
    output: list[OutputMessage | OutputReasoning | OutputFunctionCall]
    error: None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    previous_response_id: str | None
    temperature: float
    top_p: float
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    store: bool
    usage: ResponseUsage | None


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


class VersionInfo(BaseModel):
    version: str


class ModelInfo(BaseModel):
    """GET /get_model_info (SGLang's)."""

    model_path: str
    tokenizer_path: str
    is_generation: bool
    model_type: str
    max_model_len: int
    served_model_names: list[str]


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
    404: "unknown model (or, for GET /v1/responses/{id}, a response that is not stored)",
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
