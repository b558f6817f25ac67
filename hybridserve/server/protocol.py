"""Request bodies of the OpenAI-compatible API (pydantic), and their translation into SamplingParams.

Validation is strict (no "5" -> 5, no 1.0 -> 1, no true -> 1, no Infinity) and every range is published in the
OpenAPI schema. Optional fields default to None so that an explicit JSON null (bench clients send
`"logprobs": null`) means "the default".

Fields the API does not declare are sorted three ways: those that would change the result but are not implemented
(`best_of` > 1, `use_beam_search`, `functions`, ...) are a 400 naming them unless they carry their neutral value; those
that change nothing (`user`, `metadata`, ...) are accepted; any other is accepted and named in a warning log line,
as vLLM does, so that real clients keep working.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from hybridserve.sampling import (
    INT64_MAX,
    INT64_MIN,
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROB_TOKEN_IDS,
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
from hybridserve.structured import StructuredOutputError, StructuredOutputParams

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]  # OpenAI's reasoning efforts

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
    "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "bad_words": (None, []), "logits_processors": (None,),
    "spaces_between_special_tokens": (None, True), "prompt_embeds": (None,),
    "guided_decoding_backend": (None, "xgrammar", "auto"), "guided_whitespace_pattern": (None,),
    "custom_logit_processor": (None,), "custom_params": (None,),
}
_REFUSED_COMPLETION = {"suffix": (None, "")}
_REFUSED_CHAT = {
    "functions": (None, []), "function_call": (None, "none", "auto"), "audio": (None,),
    "modalities": (None, ["text"]), "web_search_options": (None,), "echo": (None, False),
    "documents": (None,), "mm_processor_kwargs": (None,),
}
_REFUSED_MESSAGE = {"function_call": (None,), "audio": (None,), "tool_calls": (None, []), "tool_call_id": (None,)}
# Accepted, and they change nothing about the output.
_HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                       "request_id", "priority", "prediction"})
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
    continuous_usage_stats: bool | None = Field(None, description="with include_usage: usage so far on every chunk")


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="null or true: objects have only the declared properties unless "
                                                  "the schema allows more; false: JSON Schema's defaults")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's `structured_outputs` (exactly one constraint)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None


# Request fields that constrain the output (one at most per request): OpenAI's, vLLM's, SGLang's (regex, ebnf,
# json_schema).
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "regex", "ebnf", "json_schema")
# The StructuredOutputParams kind each single-value field gives.
_STRUCTURED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                     "guided_grammar": "grammar", "regex": "regex", "ebnf": "grammar", "json_schema": "json"}
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]],
                      Field(max_length=MAX_LOGIT_BIAS)]


@dataclass(frozen=True)
class Truncation:
    """vLLM's truncate_prompt_tokens: a prompt longer than `keep` tokens keeps `keep` of them, its last ones (side
    left, the default: the oldest are dropped, as a chat history is) or its first ones (side right)."""

    keep: int
    side: Literal["left", "right"] = "left"

    def apply(self, token_ids: list[int]) -> list[int]:
        if len(token_ids) <= self.keep:
            return token_ids
        return token_ids[len(token_ids) - self.keep:] if self.side == "left" else token_ids[:self.keep]


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=INT64_MAX, description="at most --max-n sequences per request (prompts x n)")] \
        | None = None
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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="a JSON schema the output matches")
    guided_regex: str | None = Field(None, description="a regular expression the whole output matches")
    guided_choice: list[str] | None = Field(None, description="the output is one of these strings")
    guided_grammar: str | None = Field(None, description="an EBNF grammar (xgrammar's dialect, start rule root)")
    regex: str | None = Field(None, description="SGLang's: a regular expression the whole output matches")
    ebnf: str | None = Field(None, description="SGLang's: an EBNF grammar (xgrammar's dialect, start rule root)")
    json_schema: dict[str, Any] | str | None = Field(None, description="SGLang's: a JSON schema (or its text) the "
                                                                       "output matches")
    logit_bias: LogitBias | None = Field(None, description="token id (as a string) -> a bias in [-100, 100] added "
                                                           "to its logit before penalties and sampling")
    allowed_token_ids: list[TokenId] | None = Field(None, description="vLLM's: only these tokens may be sampled")
    return_token_ids: bool | None = Field(None, description="token ids of the prompt and of each output")
    return_tokens_as_token_ids: bool | None = Field(None, description="vLLM's: logprobs name each token "
                                                                      "'token_id:{id}' instead of by its text")
    logprob_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LOGPROB_TOKEN_IDS)] | None = Field(
        None, description="vLLM's: with logprobs, these tokens' logprobs at every generated position (beside the "
                          "chosen token's, in place of the most likely ones)")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = Field(
        None, description="vLLM's: keep at most this many prompt tokens (-1: the context length less one); at most "
                          "the context length")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="with truncate_prompt_tokens: left (default) keeps the last tokens, right the first")
    prompt_logprobs_temperature: float | None = Field(
        None, description="vLLM's: prompt logprobs (and echo's) of the logits divided by it (default 1: the model's "
                          "own); the sampling temperature does not apply to them")

    SAMPLING_FIELDS: ClassVar[tuple[str, ...]] = (
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
        "include_stop_str_in_output", "allowed_token_ids", "prompt_logprobs_temperature")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk (vLLM: include_usage and continuous_usage_stats)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def structured_field(self) -> str | None:
        """The request field that constrains the output (None: free text)."""
        given = [name for name in _STRUCTURED_FIELDS if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise APIError(f"give at most one output constraint; this request has {', '.join(given)}",
                           param=given[1])
        return given[0] if given else None

    @property
    def wants_logprobs(self) -> bool:
        """Whether the outputs' logprobs were asked for (each route has its own switch)."""
        raise NotImplementedError

    def check_supported(self) -> list[str]:
        """Raise an APIError for what this server cannot honour; return the unknown fields (for a warning)."""
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream: true", param="stream_options")
        if self.logprob_token_ids and not self.wants_logprobs:
            raise APIError("logprob_token_ids needs logprobs (completions: an integer, chat: true): their logprobs "
                           "come beside the chosen token's", param="logprob_token_ids")
        unknown = self.unknown_fields()
        for name in ("stream_options", "response_format", "structured_outputs"):
            if getattr(self, name) is not None:
                unknown += getattr(self, name)._extras({}, f"{name}.")
        if self.response_format is not None and self.response_format.json_schema is not None:
            unknown += self.response_format.json_schema._extras({}, "response_format.json_schema.")
        return unknown

    def structured_output(self) -> StructuredOutputParams | None:
        """The output constraint, from whichever field gives it (its form is checked here; the grammar itself is
        compiled before the request is queued, `ServerState.compile_grammar`)."""
        field = self.structured_field
        if field is None:
            return None
        try:
            if field == "response_format":
                if self.response_format.type == "json_object":
                    return StructuredOutputParams(json_object=True)
                spec = self.response_format.json_schema
                if spec is None or spec.schema_ is None:
                    raise APIError("response_format of type json_schema needs json_schema.schema (a JSON Schema)",
                                   param="response_format")
                return StructuredOutputParams(json=spec.schema_, strict=spec.strict is not False)
            if field == "structured_outputs":
                given = self.structured_outputs
                return StructuredOutputParams(json=given.json_, json_object=bool(given.json_object),
                                              regex=given.regex, choice=given.choice, grammar=given.grammar,
                                              structural_tag=given.structural_tag)
            return StructuredOutputParams(**{_STRUCTURED_KINDS[field]: getattr(self, field)})
        except StructuredOutputError as err:
            raise structured_output_error(err, field) from None

    def sampling_params(self, defaults: Mapping[str, Any], *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, names: dict[str, str] | None = None) -> SamplingParams:
        """The engine's SamplingParams; fields left null take the model's `defaults` (the generation config), else
        SamplingParams' own. `names` maps a SamplingParams name to the request field it came from (for the
        error)."""
        given = sampling_fields(self, self.SAMPLING_FIELDS, defaults)
        listed = self.logprob_token_ids or []
        if listed and logprobs is not None:
            logprobs = 0  # as vLLM: the listed tokens take the place of the most likely ones
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  logprob_token_ids=listed, structured_output=self.structured_output(),
                                  logit_bias=self._token_biases(), **given)
        except SamplingParamError as err:
            raise invalid_field(err, names) from None

    def prompt_truncation(self, max_model_len: int) -> Truncation | None:
        """truncate_prompt_tokens as vLLM reads it (None: the prompt stays whole): -1 keeps the context length less
        one (a token is left to generate); more than the context length is a 400, as 0 is (it would leave no
        prompt)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return None
        if keep > max_model_len:
            raise APIError(f"truncate_prompt_tokens={keep} is more than this model's context length of "
                           f"{max_model_len} tokens; ask for at most {max_model_len} (or -1)",
                           param="truncate_prompt_tokens")
        if keep == 0:
            raise APIError("truncate_prompt_tokens=0 would leave an empty prompt; keep at least 1 token (or -1: as "
                           "many as fit)", param="truncate_prompt_tokens")
        return Truncation(max(1, max_model_len - 1) if keep == -1 else keep, self.truncation_side or "left")

    def _token_biases(self) -> dict[int, float]:
        """logit_bias with its keys as token ids (JSON object keys are strings)."""
        bias = self.logit_bias or {}
        bad = [key for key in bias if not key.isdigit() or not key.isascii()]
        if bad:
            raise APIError(f"invalid value for 'logit_bias': its keys must be token ids (digits), not {bad[:3]}",
                           param="logit_bias")
        return {int(key): value for key, value in bias.items()}


def sampling_fields(body: BaseModel, names: tuple[str, ...], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields `body` sets, over the model's `defaults` (--generation-config) for those it leaves null.
    max_tokens is not taken from the defaults here: `ServerState.default_max_tokens` gives it to requests without
    one, after the route's own default (completions' 16)."""
    given = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    return {**{name: value for name, value in defaults.items() if name != "max_tokens"}, **given}


def structured_output_error(err: StructuredOutputError, field: str) -> APIError:
    """A structured-output error, named by the request field that gave the constraint."""
    return APIError(f"invalid value for '{field}': {err.why}", param=field)


def invalid_field(err: SamplingParamError, names: dict[str, str] | None = None) -> APIError:
    """A SamplingParams error, worded with the request's own field names."""
    names = names or {}
    why = re.sub(r"(?<![\w-])\w+(?![\w-])", lambda word: names.get(word[0], word[0]), err.why)
    param = names.get(err.param, err.param)
    return APIError(f"invalid value for '{param}': {why}", param=param)


class CompletionRequest(SamplingFields):
    REFUSED: ClassVar[dict[str, tuple]] = {**_REFUSED, **_REFUSED_COMPLETION}

    prompt: PromptInput
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=INT64_MAX, description="at most --max-logprobs")] | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True
    prompt_logprobs: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = Field(
        None, description="top logprobs per prompt token (at most --max-logprobs), in each choice's prompt_logprobs "
                          "(not with stream)")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def check_supported(self) -> list[str]:
        if self.prompt_logprobs is not None and self.stream:
            raise APIError("prompt_logprobs is not available with stream: true", param="prompt_logprobs")
        return super().check_supported()

    def to_sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs if self.prompt_logprobs is not None else \
            self.logprobs if self.echo else None
        return self.sampling_params(defaults, max_tokens=self.max_tokens, logprobs=self.logprobs,
                                    prompt_logprobs=prompt_logprobs)


class ContentPart(_Body):
    type: Literal["text"]
    text: str


MAX_TOOLS = 128  # functions one request may offer (OpenAI's limit)
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$",
                                    description="letters, digits, _ and -, at most 64 characters")]


def check_parameters(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A function's `parameters`: a JSON Schema of an object (what a tool call's arguments are)."""
    if schema is None:
        return None
    if schema.get("type", "object") != "object":
        raise ValueError(f"must be a JSON Schema of an object (type 'object'), not of type {schema['type']!r}")
    if not isinstance(schema.get("properties", {}), dict) or not all(
            isinstance(value, dict) for value in schema.get("properties", {}).values()):
        raise ValueError("'properties' must map each parameter name to its JSON Schema")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise ValueError("'required' must be a list of parameter names")
    return schema


class FunctionDefinition(_Body):
    name: FunctionName
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, AfterValidator(check_parameters)] = Field(
        None, description="a JSON Schema of the arguments object (absent: no parameters)")
    strict: bool | None = None

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionRef


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice, _one_of(
    'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')]


class CalledFunction(_Body):
    name: Annotated[str, Field(min_length=1)]
    arguments: str = Field(description="a JSON object, as text")

    def parsed_arguments(self) -> dict[str, Any]:
        try:
            arguments = json.loads(self.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ValueError(f"the arguments of the call to {self.name!r} must be a JSON object (as text)")
        return arguments


class MessageToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


MessageContent = Annotated[str | list[ContentPart], _one_of(
    'must be a string or a list of {"type": "text", "text": ...} parts')]


class _Message(_Body):
    name: str | None = None

    def as_template_input(self) -> dict:
        """The message as chat templates expect it: text parts joined by newlines, developer as system."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message

    def unknown_fields(self, index: int) -> list[str]:
        path = f"messages[{index}]."
        parts = self.content if isinstance(self.content, list) else []
        return self._extras(_REFUSED_MESSAGE, path) + [
            name for j, part in enumerate(parts) for name in part._extras({}, f"{path}content[{j}].")]


class TextMessage(_Message):
    role: Literal["system", "developer", "user"] = Field(description="developer is rendered as system")
    content: MessageContent


class AssistantTurn(_Message):
    role: Literal["assistant"]
    content: MessageContent | None = Field(None, description="may be null beside tool_calls")
    reasoning_content: str | None = None
    tool_calls: list[MessageToolCall] | None = None

    @model_validator(mode="after")
    def _says_something(self) -> AssistantTurn:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content (a string or a list of text parts) or tool_calls")
        for call in self.tool_calls or []:
            call.function.parsed_arguments()
        return self

    def as_template_input(self) -> dict:
        """... with its reasoning, and tool call arguments as objects."""
        message = super().as_template_input()
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.parsed_arguments()}}
                for call in self.tool_calls]
        return message


class ToolResult(_Message):
    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str = Field(description="the id of the tool call this message answers")

    def as_template_input(self) -> dict:
        return {**super().as_template_input(), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[TextMessage | AssistantTurn | ToolResult, Discriminator("role")]


class ChatTemplateFields(_Request):
    """How messages become a prompt: shared by chat completions and /tokenize."""

    add_generation_prompt: bool | None = Field(None, description="default true (false with "
                                                                 "continue_final_message)")
    continue_final_message: bool | None = Field(None, description="the last message, an assistant's, is continued "
                                                                  "rather than closed (a prefilled answer)")
    chat_template: str | None = Field(None, description="refused unless the server runs with "
                                                        "--trust-request-chat-template")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra template variables")

    def template_options(self, trust_request_template: bool, messages: list[ChatMessage]) -> dict:
        """Keyword arguments for apply_chat_template beyond the `messages` (a refused option is a 400)."""
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
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise APIError("continue_final_message continues the last message, so add_generation_prompt "
                               "cannot also be true", param="add_generation_prompt")
            if messages[-1].role != "assistant":
                raise APIError("continue_final_message needs an assistant message last (the answer to continue)",
                               param="continue_final_message")
            return kwargs | {"add_generation_prompt": False, "continue_final_message": True}
        return kwargs | {"add_generation_prompt": self.add_generation_prompt is not False}


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    REFUSED: ClassVar[dict[str, tuple]] = {**_REFUSED, **_REFUSED_CHAT}

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, none without")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true)")
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=INT64_MAX, description="at most --max-logprobs")] | None = None
    add_special_tokens: bool | None = False
    prompt_logprobs: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = Field(
        None, description="top logprobs per prompt token (at most --max-logprobs), in the response's "
                          "prompt_logprobs (not with stream)")
    reasoning_effort: Effort | None = Field(None, description="none: thinking off; any other: on (the model's "
                                                              "thinking switch)")

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def check_supported(self) -> list[str]:
        unknown = super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError("prompt_logprobs is not available with stream: true", param="prompt_logprobs")
        return unknown + [name for i, message in enumerate(self.messages) for name in message.unknown_fields(i)]

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def field_names(self) -> dict[str, str]:
        """SamplingParams names -> this request's own fields (errors name the request's)."""
        return {"logprobs": "top_logprobs", "max_tokens": self.max_tokens_param}

    def to_sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(defaults, max_tokens=max_tokens,
                                    logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                                    prompt_logprobs=self.prompt_logprobs, names=self.field_names)


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="with messages: the tools the chat template lists")
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
