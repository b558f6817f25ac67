"""Tool-call parsers on crafted model text: both formats, several calls, text around them, malformed blocks left
as content, and the streamed parse (the text split at every position, and into single characters) equal to the
whole-text parse. The forcing grammars accept what the formats write and what the parsers read back."""
from __future__ import annotations

import json

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from hybridserve.parsers import LING, TOOL_FORMATS, ZAYA, model_tool_format, reasoning_format, tool_format
from hybridserve.parsers.tool_calls import MAX_WHITESPACE, Extracted, ToolCallExtractor, forced_calls_format
from hybridserve.server.protocol import ChatTool
from hybridserve.server.tool_choice import select_tools

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "unit": {"enum": ["c", "f"]}, "exact": {"type": "boolean"},
                                                     "where": {"type": "object"}, "tags": {"type": "array"}},
                    "required": ["city"]},
    "ping": {"type": "object", "properties": {}},
}


def zaya_call(name: str, **arguments) -> str:
    parameters = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
                         for key, value in arguments.items())
    return f"<zyphra_tool_call>\n<function={name}>\n{parameters}</function>\n</zyphra_tool_call>"


def ling_call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


WRITERS = {"zaya": zaya_call, "ling": ling_call}
WEATHER = dict(city="Paris", days=3, unit="c", exact=True, where={"lat": 48.8}, tags=["a", "b"])


def parse_whole(fmt, text: str, max_calls: int | None = None) -> Extracted:
    extractor = ToolCallExtractor(fmt, TOOLS, max_calls)
    out = extractor.feed(text)
    out += extractor.finish()
    return out


def parse_pieces(fmt, pieces: list[str], max_calls: int | None = None) -> Extracted:
    extractor = ToolCallExtractor(fmt, TOOLS, max_calls)
    out = Extracted()
    for piece in pieces:
        out += extractor.feed(piece)
    out += extractor.finish()
    return out


def layout(out: Extracted) -> list:
    """Text and calls in order, adjacent text joined (call ids left out: they are random)."""
    parts = []
    for part in out.parts:
        if isinstance(part, str) and parts and isinstance(parts[-1], str):
            parts[-1] += part
        else:
            parts.append(part if isinstance(part, str) else (part.name, part.arguments))
    return parts


def same(a: Extracted, b: Extracted) -> bool:
    return layout(a) == layout(b)


def crafted(name: str) -> dict[str, str]:
    call = WRITERS[name]
    fmt = TOOL_FORMATS[name]
    return {
        "one call": call("get_weather", **WEATHER),
        "text before and after": "Let me check.\n" + call("get_weather", city="Rome") + "\nDone.",
        "two calls": call("get_weather", city="Oslo", days=1) + "\n" + call("ping"),
        "text around two calls": "First,  \n" + call("ping") + "\n\n" + call("ping") + " \n then this.\n",
        "malformed then good": f"{fmt.start}\n<oops> {{not json\n{fmt.end}\n" + call("ping"),
        "unknown function": call("launch_rockets", count=3),
        "unclosed": "Sure: " + call("get_weather", city="Lima")[:-4],
        "no call": "Just an answer, with a < sign and <tool and <zyphra in it.",
        "partial tag at the end": "ends with " + fmt.start[:5],
    }


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
def test_crafted_outputs_parse(name):
    fmt = TOOL_FORMATS[name]
    cases = crafted(name)
    one = parse_whole(fmt, cases["one call"])
    assert one.content == "" and [c.name for c in one.calls] == ["get_weather"]
    assert json.loads(one.calls[0].arguments) == WEATHER
    around = parse_whole(fmt, cases["text before and after"])
    assert around.content == "Let me check.\nDone." and json.loads(around.calls[0].arguments) == {"city": "Rome"}
    two = parse_whole(fmt, cases["two calls"])
    assert two.content == "" and [(c.name, json.loads(c.arguments)) for c in two.calls] == [
        ("get_weather", {"city": "Oslo", "days": 1}), ("ping", {})]
    assert len({c.id for c in two.calls}) == 2 and all(c.id.startswith("call_") for c in two.calls)
    joined = parse_whole(fmt, cases["text around two calls"])
    assert joined.content == "First,  \nthen this." and len(joined.calls) == 2  # one gap joins the two texts
    assert layout(joined)[0] == "First," and layout(joined)[-1] == "  \nthen this."  # in output order
    bad = parse_whole(fmt, cases["malformed then good"])
    assert bad.content == f"{fmt.start}\n<oops> {{not json\n{fmt.end}" and [c.name for c in bad.calls] == ["ping"]
    for kept in ("unknown function", "unclosed", "no call", "partial tag at the end"):
        out = parse_whole(fmt, cases[kept])
        assert out.content == cases[kept] and out.calls == [], kept  # left exactly as generated
    only_first = parse_whole(fmt, cases["two calls"], max_calls=1)
    assert [c.name for c in only_first.calls] == ["get_weather"] and only_first.content == WRITERS[name]("ping")


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
def test_streamed_parse_equals_the_whole_text_parse(name):
    fmt = TOOL_FORMATS[name]
    for case, text in crafted(name).items():
        whole = parse_whole(fmt, text)
        assert same(parse_pieces(fmt, list(text)), whole), case
        for cut in range(len(text) + 1):
            assert same(parse_pieces(fmt, [text[:cut], text[cut:]]), whole), (case, cut)


def test_zaya_values_follow_the_parameter_schema():
    text = ("<zyphra_tool_call>\n<function=get_weather>\n<parameter=city>\n  New York \n</parameter>\n"
            "<parameter=days>\n 7 \n</parameter>\n<parameter=unit>\n f \n</parameter>\n"
            "<parameter=exact>\nfalse\n</parameter>\n<parameter=where>\n{\"lat\": 1}\n</parameter>\n"
            "<parameter=extra>\nnot json\n</parameter>\n</function>\n</zyphra_tool_call>")
    (call,) = parse_whole(ZAYA, text).calls
    assert json.loads(call.arguments) == {"city": "  New York ", "days": 7, "unit": "f", "exact": False,
                                          "where": {"lat": 1}, "extra": "not json"}
    junk = "<zyphra_tool_call>\n<function=ping>\nhello\n</function>\n</zyphra_tool_call>"
    assert parse_whole(ZAYA, junk).calls == []  # text outside parameters: malformed


def test_ling_needs_an_arguments_object():
    for body in ('{"name": "ping"}', '{"name": "ping", "arguments": "{}"}', '{"name": "ping", "arguments": NaN}',
                 '["ping", {}]'):
        assert parse_whole(LING, f"<tool_call>\n{body}\n</tool_call>").calls == [], body


def test_registry_names_and_model_defaults():
    assert model_tool_format("zaya") is ZAYA and model_tool_format("bailing_hybrid") is LING
    assert tool_format("ling") is LING and tool_format("zaya") is ZAYA
    with pytest.raises(ValueError, match="choose one of ling, zaya"):
        tool_format("hermes")


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
@pytest.mark.parametrize("parallel", [False, True])
def test_forcing_grammar_accepts_what_the_parser_reads(name, parallel):
    fmt, call = TOOL_FORMATS[name], WRITERS[name]
    structural = {"type": "structural_tag", "format": forced_calls_format(fmt, TOOLS, parallel)}
    grammar = xgrammar.Grammar.from_structural_tag(json.dumps(structural))
    one = call("get_weather", city="Paris", days=3)
    two = one + "\n" + call("ping")
    assert _is_grammar_accept_string(grammar, one)
    assert _is_grammar_accept_string(grammar, two) == parallel
    for wrong in ("hello " + one, call("get_weather", days=3), call("get_weather", city="x", days="three"),
                  call("launch", count=1)):
        assert not _is_grammar_accept_string(grammar, wrong), wrong
    assert [c.name for c in parse_whole(fmt, two).calls] == ["get_weather", "ping"]


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
def test_forced_calls_with_a_reasoning_parser_may_reason_first_within_bounds(name):
    """With a reasoning parser the forcing grammar allows a whole <think> block (or, when the prompt opened one,
    its rest) before the call, then at most MAX_WHITESPACE whitespace: unbounded, a model with random weights spent
    every token on whitespace and never called."""
    fmt, call = TOOL_FORMATS[name], WRITERS[name]("ping")
    selection = select_tools([ChatTool.model_validate({"type": "function", "function": {"name": "ping"}})],
                             "required", False)

    def accepts(in_reasoning: bool, text: str) -> bool:
        params = selection.structured_output(fmt, reasoning_format("qwen3"), in_reasoning)
        return _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(json.dumps(params.structural_tag)),
                                         text)

    gap = " \n" * (MAX_WHITESPACE // 2)
    for text in (call, "<think>\nplan\n</think>\n\n" + call, gap + call, "<think></think>" + gap + call):
        assert accepts(False, text), text
    for text in (gap + " " + call, "plan</think>" + call, "hello " + call):
        assert not accepts(False, text), text
    assert accepts(True, "still planning\n</think>\n" + call)
    assert not accepts(True, call)  # the open block must be closed first
