"""The forced-tool grammar and the tool-call parser agree (hypothesis): for generated tool schemas, every output the
`tool_choice: "required"` grammar accepts, in either tool format, parses back into calls whose arguments validate
against the tool's schema.

Outputs are random walks through the grammar itself, as a model's sampler would take them: an xgrammar matcher
over a character-level vocabulary (plus the formats' closing tags as tokens) masks the tokens it does not allow,
hypothesis picks among the others (whitespace, where allowed, half the time: layout is where grammar and parser
disagreed), and after a drawn number of steps the walk heads for the end (closing tags and EOS first). Bounded
strings stay shorter than `</parameter>`, whose appearance inside a value is the ZAYA1 format's own ambiguity
(hybridserve/parsers/zaya.py)."""
from __future__ import annotations

import json

import jsonschema
import torch
import xgrammar
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from hybridserve.parsers import TOOL_FORMATS
from hybridserve.parsers.tool_calls import ToolCallExtractor
from hybridserve.server.protocol import ChatTool
from hybridserve.server.tool_choice import select_tools

EOS = "<eos>"
CLOSERS = ["\n</parameter>\n", "</function>\n</zyphra_tool_call>", "}\n</tool_call>"]
VOCAB = [chr(c) for c in range(32, 127)] + ["\n", "\t", "é", "日", "true", "false", "null", *CLOSERS, EOS]
# Where a walk that has used up its steps goes first, when the grammar allows it: the way out.
FINISH = [VOCAB.index(token) for token in [EOS, *CLOSERS, '"', "}", "]", "0"]]
SPACES = [VOCAB.index(token) for token in " \n\t"]
MAX_STEPS = 4000
_compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(VOCAB, vocab_type=xgrammar.VocabType.RAW,
                                                            stop_token_ids=[VOCAB.index(EOS)]))

names = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
short = st.integers(0, 10)  # string lengths: below len("</parameter>")
strings = st.one_of(
    st.just({"type": "string"}),
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra}, st.integers(0, 4),
              st.integers(0, 6)),
    st.sampled_from([{"type": "string", "pattern": "^[a-z]{1,8}$"},
                     {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"},
                     {"type": ["string", "null"], "maxLength": 5}]),
    st.lists(st.text(st.sampled_from("ab \n"), max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda choices: {"enum": choices}))
scalars = st.one_of(
    strings, st.just({"type": "boolean"}), st.just({"type": "number"}), st.just({"type": "null"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span}, st.integers(-50, 50),
              st.integers(0, 100)))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.builds(lambda items, most: {"type": "array", "items": items, "maxItems": most}, inner, st.integers(0, 3)),
    st.dictionaries(names, inner, max_size=3).flatmap(lambda props: st.builds(
        lambda required: {"type": "object", "properties": props, "required": required,
                          "additionalProperties": False},
        st.lists(st.sampled_from(sorted(props)), unique=True) if props else st.just([])))), max_leaves=4)
tool_schemas = st.dictionaries(names, values, max_size=4).flatmap(lambda props: st.builds(
    lambda required: {"type": "object", "properties": props, "required": required},
    st.lists(st.sampled_from(sorted(props)), unique=True) if props else st.just([])))


def _allowed(matcher: xgrammar.GrammarMatcher) -> list[int]:
    mask = xgrammar.allocate_token_bitmask(1, len(VOCAB))
    matcher.fill_next_token_bitmask(mask)
    bits = (mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return [i for i in bits.flatten().nonzero().flatten().tolist() if i < len(VOCAB)]


def _walk(grammar: xgrammar.CompiledGrammar, data: st.DataObject) -> str:
    """One output of `grammar`, chosen by hypothesis token by token."""
    matcher, text = xgrammar.GrammarMatcher(grammar), []
    free_steps = data.draw(st.integers(0, 150), label="free steps")
    for step in range(MAX_STEPS):
        allowed = _allowed(matcher)
        if step < free_steps:
            spaces = [t for t in SPACES if t in allowed]
            token = data.draw(st.sampled_from(spaces if spaces and data.draw(st.booleans()) else allowed))
        else:
            token = next((t for t in FINISH if t in allowed), allowed[0])
        if token == VOCAB.index(EOS):
            return "".join(text)
        assert matcher.accept_token(token)
        text.append(VOCAB[token])
    reject()  # no way out within the bound (nothing to learn from this draw)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tools=st.dictionaries(names, tool_schemas, min_size=1, max_size=2), parallel=st.booleans(),
       format_name=st.sampled_from(sorted(TOOL_FORMATS)), data=st.data())
def test_every_forced_output_parses_to_arguments_its_schema_accepts(tools, parallel, format_name, data):
    fmt = TOOL_FORMATS[format_name]
    offered = [ChatTool.model_validate({"type": "function", "function": {"name": name, "parameters": schema}})
               for name, schema in tools.items()]
    spec = select_tools(offered, "required", parallel).structured_output(fmt, None, False)
    grammar = _compiler.compile_grammar(xgrammar.Grammar.from_structural_tag(json.dumps(spec.structural_tag)))
    text = _walk(grammar, data)
    extractor = ToolCallExtractor(fmt, tools)
    parsed = extractor.feed(text)
    parsed += extractor.finish()
    assert parsed.content == "" and parsed.calls, text
    assert parallel or len(parsed.calls) == 1
    for call in parsed.calls:
        jsonschema.validate(json.loads(call.arguments), tools[call.name])
