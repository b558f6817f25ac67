"""Request bodies of the OpenAI-compatible API (pydantic), and their translation into SamplingParams.

Validation is strict (no "5" -> 5, no 1.0 -> 1, no true -> 1, no Infinity) and every range is published in the
OpenAPI schema. Optional fields default to None so that an explicit JSON null (bench clients send
`"logprobs": null`) means "the default".

Fields the API does not declare are sorted three ways: those that would change the result but are not implemented
(`best_of` > 1, `guided_json`, `tools`, ...) are a 400 naming them unless they carry their neutral value; those
that change nothing (`user`, `metadata`, ...) are accepted; any other is accepted and named in a warning log line,
as vLLM does, so that real clients keep working.
"""
from __future__ import annotations

import logging
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from hybridserve.sampling import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    SamplingParamError,
    SamplingParams,
)
from hybridserve.server.errors import APIError

logger = logging.getLogger(__name__)


def _one_of(message: str) -> WrapValidator:
    """One clear error for a union-typed field instead of pydantic's error per union member."""
    def validate(value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", message) from None
    return WrapValidator(validate)


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
PromptInput = Annotated[str | list[str] | list[TokenId] | list[list[TokenId]], _one_of(
    "must be a string, a list of strings, a list of token ids (integers >= 0) or a list of token-id lists")]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopInput = Annotated[StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], _one_of(
    f"must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings, each of at most "
    f"{MAX_STOP_STRING_CHARS} characters")]

# Not implemented, and they would change the result: refused unless they carry one of these neutral values.
_REFUSED = {
    "best_of": (None, 1), "logit_bias": (None, {}), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "allowed_token_ids": (None,), "bad_words": (None, []), "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,), "logits_processors": (None,), "return_tokens_as_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True), "prompt_embeds": (None,), "structured_outputs": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "response_format": (None, {"type": "text"}),
}
_REFUSED_COMPLETION = {"suffix": (None, "")}
_REFUSED_CHAT = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "reasoning_effort": (None,), "audio": (None,),
    "modalities": (None, ["text"]), "web_search_options": (None,), "echo": (None, False),
    "continue_final_message": (None, False), "documents": (None,), "mm_processor_kwargs": (None,),
}
_REFUSED_MESSAGE = {"tool_calls": (None, []), "function_call": (None,), "tool_call_id": (None,), "audio": (None,)}
# Accepted, and they change nothing about the output.
_HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                       "request_id", "priority", "parallel_tool_calls", "prediction"})
# apply_chat_template's own parameters: never template variables from a request.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _is_neutral(value: Any, neutral: tuple) -> bool:
    return any(value is None if n is None else (type(value) is type(n) and value == n) for n in neutral)


def _check_text(value: Any, path: str) -> None:
    """Reject lone UTF-16 surrogates (JSON can carry "\\ud800"; no tokenizer or response encoder takes them)."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(f"'{path}' contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid "
                               "Unicode text", param=path.split(".")[0].split("[")[0]) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path)
            _check_text(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if type(item) is not int:
                _check_text(item, f"{path}[{i}]")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    def _extras(self, refused: dict[str, tuple], path: str) -> list[str]:
        """Refuse the unsupported extras that would matter; return the unknown ones (by path) for the warning."""
        unknown = []
        for name, value in (self.model_extra or {}).items():
            where = f"{path}{name}"
            if name in refused:
                if not _is_neutral(value, refused[name]):
                    raise APIError(f"'{where}' is not supported by this server and would change the result; remove "
                                   "it", param=where.split(".")[0].split("[")[0], code="unsupported_parameter")
            elif name not in _HARMLESS:
                unknown.append(where)
        return unknown


class _Request(_Body):
    """A top-level body: its strings are checked once, recursively, before the fields are parsed."""

    REFUSED: ClassVar[dict[str, tuple]] = _REFUSED

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        _check_text(data, "")
        return data

    def unknown_fields(self) -> list[str]:
        """Refuse what would change the result unimplemented; the other unknown fields (to log)."""
        return self._extras(self.REFUSED, "")


class StreamOptions(_Body):
    include_usage: bool | None = None


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, description="0 (or below 1e-5) = greedy")] | None \
        = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX, description="-1 or 0 = off")] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Int64 | None = None
    stop: StopInput | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])] | None = None
    frequency_penalty: Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])] | None = None
    repetition_penalty: Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                               description="1 = no penalty")] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    SAMPLING_FIELDS: ClassVar[tuple[str, ...]] = (
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
        "include_stop_str_in_output")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> list[str]:
        """Raise an APIError for what this server cannot honour; return the unknown fields (for a warning)."""
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream: true", param="stream_options")
        return self.unknown_fields()

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        names: dict[str, str] | None = None) -> SamplingParams:
        """The engine's SamplingParams; fields left null take SamplingParams' defaults. `names` maps a
        SamplingParams name to the request field it came from (for the error)."""
        given = {name: getattr(self, name) for name in self.SAMPLING_FIELDS if getattr(self, name) is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **given)
        except SamplingParamError as err:
            raise invalid_field(err, names) from None


def invalid_field(err: SamplingParamError, names: dict[str, str] | None = None) -> APIError:
    """A SamplingParams error, worded with the request's own field names."""
    names = names or {}
    why = re.sub(r"\b\w+\b", lambda word: names.get(word[0], word[0]), err.why)
    param = names.get(err.param, err.param)
    return APIError(f"invalid value for '{param}': {why}", param=param)


class CompletionRequest(SamplingFields):
    REFUSED: ClassVar[dict[str, tuple]] = {**_REFUSED, **_REFUSED_COMPLETION}

    prompt: PromptInput
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(max_tokens=self.max_tokens, logprobs=self.logprobs,
                                    prompt_logprobs=self.logprobs if self.echo else None)


class ContentPart(_Body):
    type: Literal["text"]
    text: str


Role = Literal["system", "developer", "user", "assistant"]


class ChatMessage(_Body):
    role: Role = Field(description="developer is rendered as system; tool messages are not supported")
    content: Annotated[str | list[ContentPart], _one_of(
        'must be a string or a list of {"type": "text", "text": ...} parts')]
    name: str | None = None
    reasoning_content: str | None = None

    def as_template_input(self) -> dict:
        """The message as chat templates expect it: text parts joined by newlines, developer as system."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message

    def unknown_fields(self, index: int) -> list[str]:
        path = f"messages[{index}]."
        parts = self.content if isinstance(self.content, list) else []
        return self._extras(_REFUSED_MESSAGE, path) + [
            name for j, part in enumerate(parts) for name in part._extras({}, f"{path}content[{j}].")]


class ChatTemplateFields(_Request):
    """How messages become a prompt: shared by chat completions and /tokenize."""

    add_generation_prompt: bool | None = True
    chat_template: str | None = Field(None, description="refused unless the server runs with "
                                                        "--trust-request-chat-template")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra template variables")

    def template_options(self, trust_request_template: bool) -> dict:
        """Keyword arguments for apply_chat_template beyond the messages (a refused option is a 400)."""
        kwargs = dict(self.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS - {"chat_template"})
        if reserved:
            raise APIError(f"chat_template_kwargs may not set {reserved}: they are parameters of the template "
                           "call, not template variables", param="chat_template_kwargs")
        template = kwargs.pop("chat_template", None)
        if template is not None and self.chat_template is not None:
            raise APIError("give chat_template once, not also in chat_template_kwargs", param="chat_template")
        template = template if template is not None else self.chat_template
        if template is not None and not trust_request_template:
            raise APIError("this server does not accept chat templates in requests (the operator can allow them "
                           "with --trust-request-chat-template, or set one with --chat-template)",
                           param="chat_template", code="chat_template_not_allowed")
        if template is not None:
            kwargs["chat_template"] = template
        kwargs["add_generation_prompt"] = self.add_generation_prompt is not False
        return kwargs


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    REFUSED: ClassVar[dict[str, tuple]] = {**_REFUSED, **_REFUSED_CHAT}

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_special_tokens: bool | None = False

    def check_supported(self) -> list[str]:
        unknown = super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return unknown + [name for i, message in enumerate(self.messages) for name in message.unknown_fields(i)]

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens=max_tokens, logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                                    names={"logprobs": "top_logprobs", "max_tokens": self.max_tokens_param})


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None

    def check_supported(self) -> list[str]:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        messages = self.messages or []
        return self.unknown_fields() + [name for i, m in enumerate(messages) for name in m.unknown_fields(i)]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]

    def check_supported(self) -> list[str]:
        return self.unknown_fields()


def warn_unknown(route: str, unknown: list[str]) -> None:
    if unknown:
        logger.warning("%s: ignoring fields this server does not know: %s", route, ", ".join(unknown))
