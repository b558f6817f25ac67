"""Reasoning (`--reasoning-parser`): the `<think>` ... `</think>` part of an output becomes `reasoning_content`.

The names are per model: `qwen3` (Qwen3's chat template, the demo checkpoint's: the model opens `<think>` itself,
and `enable_thinking=False` writes an empty block into the prompt), `zaya` (ZAYA1, which its serving recipes run
with Qwen3-style reasoning) and `ling` (Ling-2.6: thinking only when the system prompt says "detailed thinking
on"). All three write reasoning as `<think>` ... `</think>` today, so they share one splitter.

Reasoning is recognised only where it can be: from the start of the output when the rendered prompt ends with an
open `<think>` (templates that open it in the generation prompt), or when the output itself opens with `<think>`
(after whitespace). Nothing else assumes thinking is on: an output that opens no block is all content. (Assuming it
on is how SGLang's qwen3 parser put Ling-2.6's tool calls into reasoning_content.) Reasoning ends at `</think>`, or
where a tool call opens (`terminators`: the request's tool-call tag, which stays in the content for the tool
parser), so a model that goes from thinking straight into a call still has its call parsed. An output that ends
while reasoning is all reasoning. Whitespace just inside the block, and between `</think>` and the answer, is
dropped. As with tool calls, feeding a text in any number of pieces gives the same split as feeding it whole.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridserve.parsers.scan import first_tag, tag_prefix_start
from hybridserve.parsers.tool_calls import MAX_WHITESPACE


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"

    def prompt_opens_reasoning(self, prompt_text: str) -> bool:
        """Whether the rendered prompt leaves the output inside a reasoning block."""
        return prompt_text.rstrip().endswith(self.start)

    def prompt_closes_reasoning(self, prompt_text: str) -> bool:
        """Whether the rendered prompt ends with a closed reasoning block: thinking turned off (Qwen3's
        enable_thinking=False writes an empty one), so a constrained output starts its constrained part at once."""
        return prompt_text.rstrip().endswith(self.end)

    def lead(self, in_reasoning: bool) -> dict:
        """The structural-tag format of what a constrained output (a forced tool call, a JSON schema, ...) may
        write before its constrained part: the rest of an open reasoning block, or an optional whole one, then at
        most MAX_WHITESPACE whitespace characters (unbounded, a model with random weights spent every token on
        whitespace and never reached the constrained part)."""
        block = {"type": "tag", "begin": "" if in_reasoning else self.start, "content": {"type": "any_text"},
                 "end": self.end}
        gap = {"type": "regex", "pattern": rf"[ \n\r\t]{{0,{MAX_WHITESPACE}}}"}
        return {"type": "sequence", "elements": [block if in_reasoning else {"type": "optional", "content": block},
                                                 gap]}


REASONING_FORMATS = {f.name: f for f in (ReasoningFormat("qwen3"), ReasoningFormat("zaya"), ReasoningFormat("ling"))}

_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: Split) -> Split:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningSplitter:
    """Splits one output, as it streams, into reasoning and content."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool, terminators: tuple[str, ...] = ()):
        self.fmt, self.terminators = fmt, terminators
        self._state = _REASONING if in_reasoning else _OPENING
        self._pending = ""
        self._strip = in_reasoning  # drop whitespace at the start of the current part

    @property
    def reasoning(self) -> bool:
        """Still inside the reasoning block."""
        return self._state == _REASONING

    def feed(self, text: str) -> Split:
        self._pending += text
        out = Split()
        while True:
            if self._state == _OPENING:
                lead = self._pending.lstrip()
                if lead.startswith(self.fmt.start):
                    self._pending = lead[len(self.fmt.start):]
                    self._state, self._strip = _REASONING, True
                    continue
                if self.fmt.start.startswith(lead):  # still possibly the opening tag (or only whitespace)
                    return out
                self._state = _CONTENT
            if self._state == _CONTENT:
                out.content += self._take(len(self._pending))
                return out
            found = first_tag(self._pending, (self.fmt.end, *self.terminators))
            if found is None:
                held = tag_prefix_start(self._pending, (self.fmt.end, *self.terminators))
                out.reasoning += self._take(len(self._pending[:held].rstrip()))
                return out
            position, tag = found
            # the closing tag is consumed; a tool call's opening tag stays for the content
            rest = self._pending[position + (len(tag) if tag == self.fmt.end else 0):]
            out.reasoning += self._take(len(self._pending[:position].rstrip()))
            self._pending, self._state, self._strip = rest, _CONTENT, True

    def finish(self) -> Split:
        """The rest, once the output has ended (an open block's text is reasoning)."""
        rest = self._take(len(self._pending))
        return Split(reasoning=rest) if self._state == _REASONING else Split(content=rest)

    def _take(self, size: int) -> str:
        text, self._pending = self._pending[:size], self._pending[size:]
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return text
