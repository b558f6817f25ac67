"""Request bodies of the OpenAI-compatible API (pydantic), and their translation into SamplingParams.

Validation is strict (no "5" -> 5, no 1.0 -> 1, no true -> 1) and unknown fields are ignored, as OpenAI clients
send extras such as `user`. Optional fields default to None so that an explicit JSON null (bench clients send
`"logprobs": null`) means "the default", which SamplingParams supplies.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from hybridserve.sampling import SamplingParams
from hybridserve.server.errors import APIError, invalid_sampling


def _one_of(message: str) -> WrapValidator:
    """One clear error for a union-typed field instead of pydantic's error per union member."""
    def validate(value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", message) from None
    return WrapValidator(validate)


PromptInput = Annotated[str | list[str] | list[int] | list[list[int]], _one_of(
    "must be a string, a list of strings, a list of token ids or a list of token-id lists")]
StopInput = Annotated[str | list[str], _one_of("must be a string or a list of strings")]




class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = None


class SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: StopInput | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None

    SAMPLING_FIELDS: ClassVar[tuple[str, ...]] = (
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
        "include_stop_str_in_output")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Features that would change the result if silently ignored are refused."""
        if self.logit_bias:
            raise APIError("logit_bias is not supported; remove it", param="logit_bias")

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        rename: dict[str, str] | None = None) -> SamplingParams:
        """The engine's SamplingParams; fields left null take SamplingParams' defaults."""
        given = {name: getattr(self, name) for name in self.SAMPLING_FIELDS if getattr(self, name) is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **given)
        except ValueError as err:
            error = invalid_sampling(err)
            error.param = (rename or {}).get(error.param, error.param)
            raise error from None


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError("suffix is not supported; remove it", param="suffix")

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(max_tokens=self.max_tokens, logprobs=self.logprobs,
                                    prompt_logprobs=self.logprobs if self.echo else None)


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: Annotated[str | list[ContentPart], _one_of(
        'must be a string or a list of {"type": "text", "text": ...} parts')] | None = None
    name: str | None = None

    def as_template_input(self, index: int) -> dict:
        """The message as the chat template expects it: text parts joined by newlines."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise APIError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                               param=f"messages[{index}].content")
            content = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    return [message.as_template_input(i) for i, message in enumerate(messages)]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError("tools are not supported yet; remove them", param="tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError("response_format other than {\"type\": \"text\"} is not supported yet",
                           param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens=max_tokens, logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                                    rename={"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"
                                            if self.max_completion_tokens is not None else "max_tokens"})


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
