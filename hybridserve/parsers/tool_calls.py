"""Tool calls in generated text: the call, what a model's format must provide, the extractor that splits a
streamed output into content and calls, and the grammar that forces calls.

Every format wraps one call in an opening and a closing tag. The extractor returns a call only when its closing
tag has arrived and its body parses, so a stream never sends a call it must take back: a block that does not
parse (malformed JSON, a function the request did not offer) stays in the content as it was generated, and so
does a block the output ends inside. Content is held back while it may still be the start of an opening tag; the
whitespace around calls is dropped, except one gap that separates text before a call from text after it. Feeding
a text in any number of pieces gives the same content and calls as feeding it whole (the non-streaming parse is
`feed(text)` + `finish()`).
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hybridserve.parsers.scan import tag_prefix_start


# Whitespace characters a forced call may put between two tokens of its arguments: room for some indentation, but
# a bound, so that a model cannot spend its token budget on whitespace inside a call.
MAX_WHITESPACE = 16


_SIZED_STRING_KEYS = ("minLength", "maxLength", "pattern", "format")


def excluding(tags: list[str], schema: object) -> dict:
    """xgrammar's `excludes` for a JSON-schema format: strings may not contain the format's own closing `tags`
    (a call's parser would take the first as the call's end), where xgrammar can enforce it. It cannot beside a
    string's length, pattern or format (it would drop them), so a schema with any of those keeps its strings as
    they are: there the ambiguity is the format's own."""
    def sized(node: object) -> bool:
        if isinstance(node, dict):
            return any(key in node for key in _SIZED_STRING_KEYS) or any(map(sized, node.values()))
        return isinstance(node, list) and any(map(sized, node))

    return {} if sized(schema) else {"excludes": tags}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=new_call_id)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str) -> Any:
    """json.loads without NaN / Infinity (they are not JSON, and no client can read them back), and with control
    characters (a tab, ...) taken inside strings: xgrammar's JSON grammars let a length-bounded or tag-excluding
    string hold them raw, and the arguments go back out re-encoded (`dumps_arguments`), valid JSON either way."""
    return json.loads(text, parse_constant=_reject_constant, strict=False)


def dumps_arguments(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)


class ToolFormat(ABC):
    """One model family's way of writing a tool call: `start` BODY `end`."""

    name: ClassVar[str]  # the --tool-call-parser name
    start: ClassVar[str]
    end: ClassVar[str]

    @abstractmethod
    def parse(self, body: str, tools: Mapping[str, dict]) -> ToolCall | None:
        """The call written in one block's body, or None when it is malformed or names a function not in `tools`
        (function name -> its parameters' JSON schema)."""

    @abstractmethod
    def call_tag(self, name: str, parameters: dict) -> dict:
        """An xgrammar structural-tag `tag` format: exactly one call of `name`, arguments valid for `parameters`."""


def forced_calls_format(fmt: ToolFormat, tools: Mapping[str, dict], parallel: bool) -> dict:
    """The structural-tag format of an output that is only tool calls of `tools` (one of them, or, with
    `parallel`, one or more separated by newlines): tool_choice "required", or a named function (one tool)."""
    tags = [fmt.call_tag(name, parameters) for name, parameters in tools.items()]
    return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
            "stop_after_first": not parallel}


@dataclass
class Extracted:
    """Content text and calls, in the order the output has them."""

    parts: list[str | ToolCall] = field(default_factory=list)

    @property
    def content(self) -> str:
        return "".join(part for part in self.parts if isinstance(part, str))

    @property
    def calls(self) -> list[ToolCall]:
        return [part for part in self.parts if isinstance(part, ToolCall)]

    def add(self, part: str | ToolCall) -> None:
        if part != "":
            self.parts.append(part)

    def __iadd__(self, other: Extracted) -> Extracted:
        for part in other.parts:
            self.add(part)
        return self


class ToolCallExtractor:
    """Splits one output, as it streams, into content and tool calls (at most `max_calls`; later blocks stay
    content). Without a call the content is the output exactly."""

    def __init__(self, fmt: ToolFormat, tools: Mapping[str, dict], max_calls: int | None = None):
        self.fmt, self.tools, self.max_calls = fmt, tools, max_calls
        self.calls: list[ToolCall] = []  # every call so far
        self._pending = ""  # text not judged yet: a possible opening tag, held whitespace, or an open block's body
        self._in_block = False
        self._gap = ""  # the whitespace before the open block: content if it is not a call
        self._separator: str | None = None  # after a call: the gap that joins the text before it to the text after
        self._released = False  # some content was released

    def feed(self, text: str) -> Extracted:
        self._pending += text
        out = Extracted()
        while True:
            if self._in_block:
                end = self._pending.find(self.fmt.end)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(self.fmt.end):]
                call = self.fmt.parse(body, self.tools)
                if call is not None and (self.max_calls is None or len(self.calls) < self.max_calls):
                    self.calls.append(call)
                    out.add(call)
                    if self._separator is None:
                        self._separator = self._gap
                else:
                    out.add(self._release(self._gap + self.fmt.start + body + self.fmt.end))
                self._in_block, self._gap = False, ""
                continue
            start = self._pending.find(self.fmt.start)
            if start >= 0:
                before = self._pending[:start]
                text_end = len(before.rstrip())
                out.add(self._release(before[:text_end]))
                self._gap, self._in_block = before[text_end:], True
                self._pending = self._pending[start + len(self.fmt.start):]
                continue
            held = tag_prefix_start(self._pending, (self.fmt.start,))
            held = len(self._pending[:held].rstrip())  # and the whitespace before it
            out.add(self._release(self._pending[:held]))
            self._pending = self._pending[held:]
            return out

    def finish(self) -> Extracted:
        """The rest, once the output has ended: an unclosed block as content; held whitespace only if no call
        was made."""
        if self._in_block:
            rest = self._gap + self.fmt.start + self._pending
        else:
            rest = self._pending.rstrip() if self.calls else self._pending
        self._pending, self._in_block, self._gap = "", False, ""
        out = Extracted()
        out.add(self._release(rest))
        return out

    def _release(self, text: str) -> str:
        if self._separator is not None:  # the first text after a call
            text = text.lstrip()
            if not text:
                return ""
            text = (self._separator if self._released else "") + text
            self._separator = None
        self._released = self._released or bool(text)
        return text
