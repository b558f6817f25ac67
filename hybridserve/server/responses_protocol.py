"""Request body of the Responses API (POST /v1/responses), and what it becomes: chat messages for the model's
template, the chat-shaped tool selection, and SamplingParams.

Input is a string (one user message) or a list of items: messages (`input_text` / `output_text` parts, or a
string), `function_call` items (an assistant's calls), `function_call_output` items (tool results) and `reasoning`
items (the reasoning before the next assistant turn). Items this server returns are valid input, so a client can
send a response's output back. Only function tools exist here; other tool types (web search, files, ...) are
refused by the schema.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag, TypeAdapter, ValidationError

from hybridserve.sampling import (
    INT64_MAX,
    INT64_MIN,
    MAX_TEMPERATURE,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    SamplingParamError,
    SamplingParams,
)
from hybridserve.server.errors import APIError
from hybridserve.server.protocol import (
    MAX_TOOLS,
    ChatMessage,
    ChatTool,
    Effort,
    FunctionName,
    FunctionRef,
    NamedToolChoice,
    _Body,
    check_parameters,
    _one_of,
    _Request,
    invalid_field,
    sampling_fields,
    structured_output_error,
)
from hybridserve.structured import StructuredOutputError, StructuredOutputParams

# Would change the result and are not implemented: refused unless neutral.
_REFUSED_RESPONSES = {
    "logit_bias": (None, {}), "background": (None, False), "conversation": (None,), "prompt": (None,),
    "include": (None, []), "truncation": (None, "disabled"), "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}


class TextPart(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


TextContent = Annotated[str | list[TextPart], _one_of(
    'must be a string or a list of {"type": "input_text" (or "output_text"), "text": ...} parts')]


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextContent


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: FunctionName
    arguments: str = Field(description="a JSON object, as text")


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: TextContent


class ReasoningText(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


def _item_type(item: Any) -> str:
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if kind is not None else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type)]


class FunctionTool(_Body):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, AfterValidator(check_parameters)] = None
    strict: bool | None = None

    def as_chat_tool(self) -> ChatTool:
        function = {key: value for key, value in self.model_dump(exclude={"type"}).items() if value is not None}
        return ChatTool.model_validate({"type": "function", "function": function})


class FunctionChoice(_Body):
    type: Literal["function"]
    name: FunctionName


ResponsesToolChoice = Annotated[Literal["none", "auto", "required"] | FunctionChoice, _one_of(
    'must be "none", "auto", "required" or {"type": "function", "name": ...}')]


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    effort: Effort | None = Field(None, description="none: thinking off; any other: on (the model's switch)")
    summary: Literal["auto"] | None = Field(None, description="auto only: the reasoning comes back whole, as a "
                                                              "reasoning item's reasoning_text")


class ResponsesRequest(_Request):
    REFUSED: ClassVar[dict[str, tuple]] = _REFUSED_RESPONSES

    model: str | None = None
    input: Annotated[Annotated[str, Tag("text")] | Annotated[list[InputItem], Field(min_length=1), Tag("items")],
                     Discriminator(lambda value: "text" if isinstance(value, str) else "items")] = Field(
        description="a string (one user message) or a list of input items")
    instructions: str | None = Field(None, description="a system message before the input (not carried over to "
                                                       "responses that continue this one)")
    previous_response_id: str | None = Field(None, description="continue a stored response: its input and output "
                                                               "come before this input")
    max_output_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool | None = False
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = Field(None, description="keep the response for previous_response_id and GET (default true)")
    metadata: dict[str, str] | None = None
    reasoning: ReasoningConfig | None = None
    # Beyond OpenAI's Responses API, as SGLang's accepts them:
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX, description="-1 or 0 = off")] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    presence_penalty: Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])] | None = None
    frequency_penalty: Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])] | None = None
    repetition_penalty: Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])] \
        | None = None

    SAMPLING_FIELDS: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                                                  "frequency_penalty", "repetition_penalty")

    @property
    def effort(self) -> Effort | None:
        return self.reasoning.effort if self.reasoning is not None else None

    def check_supported(self) -> list[str]:
        unknown = self.unknown_fields()
        if self.reasoning is not None:
            unknown += self.reasoning._extras({}, "reasoning.")
        if self.text is not None:
            unknown += self.text._extras({}, "text.")
            if self.text.format is not None:
                unknown += self.text.format._extras({}, "text.format.")
        return unknown

    def input_items(self) -> list[dict]:
        """The input as item dicts (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in self.input]

    def messages(self, earlier: list[dict]) -> list[ChatMessage]:
        """The conversation as chat messages: the instructions, the earlier turns' items, this input."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        try:
            items = [_parse_item(item) for item in earlier] + (
                [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input)
            return [_CHAT_MESSAGE.validate_python(m) for m in messages + items_to_messages(items)]
        except (ValidationError, ValueError) as err:
            raise APIError(f"invalid value for 'input': {_reason(err)}", param="input") from None

    def chat_tools(self) -> tuple[list[ChatTool] | None, str | NamedToolChoice | None]:
        """tools and tool_choice in the chat API's shape (one tool selection for both APIs)."""
        tools = [tool.as_chat_tool() for tool in self.tools] if self.tools is not None else None
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=FunctionRef(name=choice.name))
        return tools, choice

    def structured_output(self) -> StructuredOutputParams | None:
        text_format = self.text.format if self.text is not None else None
        if text_format is None or text_format.type == "text":
            return None
        try:
            if text_format.type == "json_object":
                return StructuredOutputParams(json_object=True)
            if text_format.schema_ is None:
                raise APIError("text.format of type json_schema needs a schema", param="text")
            return StructuredOutputParams(json=text_format.schema_, strict=text_format.strict is not False)
        except StructuredOutputError as err:
            raise structured_output_error(err, "text") from None

    def sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """The engine's SamplingParams; fields left null take the model's `defaults` (the generation config)."""
        given = sampling_fields(self, self.SAMPLING_FIELDS, defaults)
        try:
            return SamplingParams(max_tokens=self.max_output_tokens, structured_output=self.structured_output(),
                                  **given)
        except SamplingParamError as err:
            raise invalid_field(err, {"max_tokens": "max_output_tokens"}) from None


_CHAT_MESSAGE = TypeAdapter(ChatMessage)


def _parse_item(item: dict) -> MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem:
    return {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
            "reasoning": ReasoningItem}[_item_type(item)].model_validate(item)


def _reason(err: Exception) -> str:
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        return f"{first['msg']} (at {'.'.join(str(part) for part in first['loc']) or 'the message'})"
    return str(err)


def items_to_messages(items: list) -> list[dict]:
    """Chat messages from items: an assistant's text, the function calls after it and the reasoning before it form
    one assistant message; each function call output is a tool message."""
    messages: list[dict] = []
    reasoning: list[str] = []

    def assistant() -> dict:
        """The assistant message the next assistant item joins (a new one after anything else)."""
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or reasoning:
            last = {"role": "assistant", "content": None}
            if reasoning:
                last["reasoning_content"] = "\n".join(reasoning)
                reasoning.clear()
            messages.append(last)
        return last

    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning.extend(part.text for part in (item.content or item.summary))
        elif isinstance(item, MessageItem) and item.role == "assistant":
            message = assistant()
            message["content"] = (message["content"] or "") + _text(item.content)
        elif isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            assistant().setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages
