"""Reasoning split on crafted outputs, for every reasoning parser name: whole and streamed at every position give
the same split; a tool call that opens inside the reasoning ends it (Ling-2.6's failure in SGLang);
nothing is taken for reasoning unless the output or the prompt opens a block."""
from __future__ import annotations

import pytest

from hybridserve.parsers import REASONING_FORMATS, ZAYA, LING, reasoning_format
from hybridserve.parsers.reasoning import ReasoningSplitter, Split
from hybridserve.server.assistant import OutputParsing

TOOLS = {"ping": {"type": "object", "properties": {}}}


def split(name: str, pieces: list[str], in_reasoning: bool = False, terminators: tuple[str, ...] = ()) -> Split:
    splitter = ReasoningSplitter(reasoning_format(name), in_reasoning, terminators)
    out = Split()
    for piece in pieces:
        out += splitter.feed(piece)
    out += splitter.finish()
    return out


# (output, prompt leaves a block open, tool-call tag that ends reasoning, reasoning, content)
CASES = [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", False, (), "Let me think.", "The answer is 4."),
    ("  <think>plan</think>answer", False, (), "plan", "answer"),
    ("No thinking here. <think>not at the start</think>", False, (), "", "No thinking here. <think>not at the start"
                                                                       "</think>"),
    ("Thinking off: <tool_call>\n{}\n</tool_call>", False, ("<tool_call>",), "",
     "Thinking off: <tool_call>\n{}\n</tool_call>"),
    ("<think>I should call ping.\n<tool_call>\n{}\n</tool_call>", False, ("<tool_call>",), "I should call ping.",
     "<tool_call>\n{}\n</tool_call>"),
    ("opened by the prompt\n</think>\n\nanswer", True, (), "opened by the prompt", "answer"),
    ("still thinking when cut", True, (), "still thinking when cut", ""),
    ("<think>cut inside the block </thi", False, (), "cut inside the block </thi", ""),
    ("<think></think>", False, (), "", ""),
    ("<thin", False, (), "", "<thin"),
    ("  \n ", False, (), "", "  \n "),
    ("plan <zyphra_tool_call>\n<function=ping>\n</function>\n</zyphra_tool_call>", True, ("<zyphra_tool_call>",),
     "plan", "<zyphra_tool_call>\n<function=ping>\n</function>\n</zyphra_tool_call>"),
]


@pytest.mark.parametrize("name", sorted(REASONING_FORMATS))
@pytest.mark.parametrize("case", CASES, ids=[c[0][:30] for c in CASES])
def test_split_whole_and_streamed_at_every_position(name, case):
    text, in_reasoning, terminators, reasoning, content = case
    whole = split(name, [text], in_reasoning, terminators)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    assert split(name, list(text), in_reasoning, terminators) == whole
    for cut in range(len(text) + 1):
        assert split(name, [text[:cut], text[cut:]], in_reasoning, terminators) == whole, cut


def test_the_prompt_decides_whether_the_output_starts_inside_reasoning():
    qwen3 = reasoning_format("qwen3")
    assert qwen3.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not qwen3.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking off
    assert not qwen3.prompt_opens_reasoning("<|im_start|>user\nsay <think><|im_end|>\n<|im_start|>assistant\n")
    assert qwen3.prompt_closes_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking off
    assert not qwen3.prompt_closes_reasoning("<|im_start|>assistant\n<think>\n")
    assert not qwen3.prompt_closes_reasoning("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="choose one of ling, qwen3, zaya"):
        reasoning_format("deepseek_r1")


@pytest.mark.parametrize("fmt", [LING, ZAYA])
def test_ling_thinking_off_keeps_its_tool_calls(fmt):
    """With thinking off (no "detailed thinking on"), a Ling-2.6 answer is a tool call and no <think>: the call
    must be parsed, not swallowed into reasoning_content; with thinking on it still ends the reasoning."""
    call = ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>' if fmt is LING else
            "<zyphra_tool_call>\n<function=ping>\n</function>\n</zyphra_tool_call>")
    parsing = OutputParsing(reasoning_format("ling"), False, fmt, TOOLS)
    off = parsing.parser().parse(call)
    assert (off.reasoning, off.content, [c.name for c in off.tool_calls]) == ("", "", ["ping"])
    on = parsing.parser().parse("<think>The user wants a ping.\n" + call)
    assert (on.reasoning, on.content, [c.name for c in on.tool_calls]) == ("The user wants a ping.", "", ["ping"])
    parser = parsing.parser()  # streamed as the tokenizer would: the tags are single tokens
    tokens = ["<think>", "The", " user", " wants", " a", " ping", ".\n", fmt.start, call[len(fmt.start):]]
    pieces = [parser.feed(token, 1) for token in tokens]
    pieces.append(parser.finish())
    assert "".join(p.reasoning for p in pieces) == on.reasoning and sum(len(p.tool_calls) for p in pieces) == 1
    assert parser.reasoning_tokens == 8  # <think> to the token that ended the reasoning
