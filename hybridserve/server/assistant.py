"""What one choice's generated text becomes for the API, as it streams: reasoning, content and tool calls.

`OutputParsing` is decided once per request (the server's parsers, the request's tools and tool_choice, whether
the prompt leaves the model inside a reasoning block); each choice gets its own `AssistantParser`. Reasoning is
split off first, then tool calls are extracted from the content. The non-streaming body parses the whole text the
same way, so a stream's pieces add up to the non-streamed message.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridserve.parsers.reasoning import ReasoningFormat, ReasoningSplitter, Split
from hybridserve.parsers.tool_calls import Extracted, ToolCall, ToolCallExtractor, ToolFormat


@dataclass
class AssistantDelta:
    """Reasoning (always first), then content text and tool calls in output order."""

    reasoning: str = ""
    parts: Extracted = field(default_factory=Extracted)

    @property
    def content(self) -> str:
        return self.parts.content

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.parts.calls

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.parts.parts)

    def __iadd__(self, other: AssistantDelta) -> AssistantDelta:
        self.reasoning += other.reasoning
        self.parts += other.parts
        return self


@dataclass(frozen=True)
class OutputParsing:
    """How every choice of one request is parsed."""

    reasoning: ReasoningFormat | None = None
    in_reasoning: bool = False  # the prompt ends inside a reasoning block
    tool_format: ToolFormat | None = None  # None: the request offers no tools (or tool_choice "none")
    tools: Mapping[str, dict] = field(default_factory=dict)  # offered function name -> parameters schema
    max_calls: int | None = None  # 1 with parallel_tool_calls false

    def parser(self) -> AssistantParser:
        splitter = None
        if self.reasoning is not None:
            terminators = (self.tool_format.start,) if self.tool_format is not None else ()
            splitter = ReasoningSplitter(self.reasoning, self.in_reasoning, terminators)
        extractor = ToolCallExtractor(self.tool_format, self.tools, self.max_calls) \
            if self.tool_format is not None else None
        return AssistantParser(splitter, extractor)


class AssistantParser:
    def __init__(self, splitter: ReasoningSplitter | None, extractor: ToolCallExtractor | None):
        self.splitter, self.extractor = splitter, extractor
        self.reasoning_tokens = 0  # tokens of the reasoning block: the one that opens it to the one that ends it

    @property
    def called(self) -> bool:
        return self.extractor is not None and bool(self.extractor.calls)

    def feed(self, text: str, num_tokens: int = 0) -> AssistantDelta:
        """The new text of `num_tokens` tokens; what of it (and of text held back before) can be shown now."""
        if self.splitter is None:
            split = Split(content=text)
        else:
            was_reasoning = self.splitter.reasoning
            split = self.splitter.feed(text)
            if was_reasoning or self.splitter.reasoning:
                self.reasoning_tokens += num_tokens
        return self._extract(split, self.extractor.feed(split.content) if self.extractor is not None else None)

    def finish(self) -> AssistantDelta:
        """The rest, once the choice has ended."""
        split = self.splitter.finish() if self.splitter is not None else Split()
        if self.extractor is None:
            return self._extract(split, None)
        extracted = self.extractor.feed(split.content)
        extracted += self.extractor.finish()
        return self._extract(split, extracted)

    def parse(self, text: str, num_tokens: int = 0) -> AssistantDelta:
        """A whole output at once."""
        out = self.feed(text, num_tokens)
        out += self.finish()
        return out

    @staticmethod
    def _extract(split: Split, extracted: Extracted | None) -> AssistantDelta:
        if extracted is None:
            extracted = Extracted()
            extracted.add(split.content)
        return AssistantDelta(split.reasoning, extracted)
