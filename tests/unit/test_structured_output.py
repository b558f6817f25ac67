"""Structured output's parts without a model: the request-side spec and its checks, the compiled-grammar cache,
one sequence's grammar state, and the token masks (filled like xgrammar fills them, applied like xgrammar's own
`apply_token_bitmask_inplace`, to the masked rows only)."""
from __future__ import annotations

import json

import pytest
import torch
import xgrammar

from hybridserve.demo import bundled_tokenizer_dir
from hybridserve.parsers import reasoning_format
from hybridserve.sampling import SamplingParamError, SamplingParams
from hybridserve.structured import StructuredOutputError, StructuredOutputParams
from hybridserve.structured.bitmask import TokenMask, apply_token_mask, words_for
from hybridserve.structured.compiler import GrammarCompiler, ebnf_literal
from hybridserve.structured.matcher import GrammarState
from hybridserve.tokenizer import load_tokenizer

VOCAB = 151936  # the demo model's logits width (the tokenizer has 151669 tokens)
EOS = [151643, 151645]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(bundled_tokenizer_dir()))


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(str(bundled_tokenizer_dir()), VOCAB, EOS)


def _walk(compiler: GrammarCompiler, tokenizer, spec: StructuredOutputParams, text: str) -> GrammarState:
    """A fresh state that has accepted `text` token by token, each token allowed by the mask before it."""
    state = GrammarState(compiler.compile(spec))
    bits = torch.zeros(1, words_for(VOCAB), dtype=torch.int32)
    for token in tokenizer.encode(text):
        state.fill(bits, 0)
        assert (bits[0, token // 32] >> (token % 32)) & 1, (text, token)
        state.accept(token)
    return state


def _completes(compiler: GrammarCompiler, tokenizer, spec: StructuredOutputParams, text: str) -> bool:
    """Whether the grammar allows `text` token by token and then the stop token (the whole output)."""
    try:
        state = _walk(compiler, tokenizer, spec, text)
    except AssertionError:
        return False
    bits = torch.zeros(1, words_for(VOCAB), dtype=torch.int32)
    state.fill(bits, 0)
    return bool((bits[0, EOS[0] // 32] >> (EOS[0] % 32)) & 1)


# --- the spec ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param, why", [
    ({}, "structured_output", "exactly one of json, json_object, regex, choice, grammar, structural_tag"),
    ({"json": SCHEMA, "regex": "a"}, "structured_output", "got 2: json, regex"),
    ({"json": "{not json"}, "json", "is not valid JSON text"),
    ({"json": [1, 2]}, "json", "must be a JSON object"),
    ({"json": "[1]"}, "json", "must be a JSON object"),
    ({"regex": ""}, "regex", "non-empty string"),
    ({"grammar": 5}, "grammar", "non-empty string"),
    ({"choice": []}, "choice", "1 to 1024 non-empty strings"),
    ({"choice": ["a", ""]}, "choice", "1 to 1024 non-empty strings"),
    ({"choice": "ab"}, "choice", "1 to 1024 non-empty strings"),
    ({"structural_tag": "[]"}, "structural_tag", "must be a JSON object"),
    ({"json_object": 1}, "json_object", "must be True"),
    ({"regex": "a", "strict": "yes"}, "strict", "must be a bool"),
    ({"regex": "a", "reasoning": "<think>"}, "reasoning", "is not valid JSON text"),
    ({"regex": "a", "reasoning": {"begin": "<think>"}}, "reasoning", "a JSON object with a 'type'"),
])
def test_a_malformed_spec_names_its_field(fields, param, why):
    with pytest.raises(StructuredOutputError, match="invalid structured output") as caught:
        StructuredOutputParams(**fields)
    assert caught.value.param == param and why in caught.value.why


def test_sampling_params_take_a_spec_and_refuse_min_tokens_beside_it():
    spec = StructuredOutputParams(regex="[ab]+")
    assert SamplingParams(structured_output=spec).structured_output is spec
    with pytest.raises(SamplingParamError, match="structured_output=.*must be a StructuredOutputParams"):
        SamplingParams(structured_output={"regex": "a"})
    with pytest.raises(SamplingParamError, match="min_tokens=2.*the grammar decides where the output may end"):
        SamplingParams(structured_output=spec, min_tokens=2)


def test_equal_json_given_as_dict_or_text_has_one_cache_key():
    as_dict = StructuredOutputParams(json={"b": 1, "a": [1, {"y": 2, "x": 3}]})
    as_text = StructuredOutputParams(json='{"a": [1, {"x": 3, "y": 2}], "b": 1}')
    assert as_dict.cache_key() == as_text.cache_key()
    assert StructuredOutputParams(json={"a": 1}).cache_key() != StructuredOutputParams(json={"a": 2}).cache_key()
    lead = reasoning_format("qwen3").lead(False)
    led = StructuredOutputParams(json={"a": 1}, reasoning=lead)
    assert led.cache_key() != StructuredOutputParams(json={"a": 1}).cache_key()  # another grammar
    assert led.cache_key() == StructuredOutputParams(json='{"a": 1}', reasoning=json.dumps(lead)).cache_key()
    assert led.without_reasoning().cache_key() == StructuredOutputParams(json={"a": 1}).cache_key()


# --- the compiler ------------------------------------------------------------------------------------------------
def test_each_kind_compiles_and_accepts_its_language(compiler, tokenizer):
    cases = [
        (StructuredOutputParams(json=SCHEMA), '{"a": -12, "b": "y"}'),
        (StructuredOutputParams(json_object=True), '{"k": [1, {"z": null}]}'),
        (StructuredOutputParams(regex=r"\d{3}-[a-z]+"), "123-abc"),
        (StructuredOutputParams(choice=["yes", "no"]), "no"),
        (StructuredOutputParams(grammar='root ::= "(" [0-9]+ ")"'), "(42)"),
        (StructuredOutputParams(grammar='start: "SELECT " column\ncolumn: "col_1" | "col_2"'), "SELECT col_2"),  # Lark
        (StructuredOutputParams(structural_tag={"type": "structural_tag", "format": {
            "type": "tag", "begin": "<n>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
            "end": "</n>"}}), "<n>17</n>"),
    ]
    for spec, text in cases:
        state = _walk(compiler, tokenizer, spec, text)
        assert not state.terminated
        state.accept(EOS[0])  # complete: the stop token ends it
        assert state.terminated, spec.kind


def test_json_is_compact_and_strict_unless_told_otherwise(compiler, tokenizer):
    spec = StructuredOutputParams(json=SCHEMA)
    _walk(compiler, tokenizer, spec, '{"a": 1, "b": "x"}')
    for loose in ('{"a":1, "b": "x"}', '{ "a": 1, "b": "x"}', '{"a": 1,  "b": "x"}', '{"a": 1,\n"b": "x"}'):
        with pytest.raises(AssertionError):  # only ", " and ": " between values: no whitespace to wander in
            _walk(compiler, tokenizer, spec, loose)
    extra = '{"a": 1, "b": "x", "c": 2}'
    with pytest.raises(AssertionError):
        _walk(compiler, tokenizer, spec, extra)  # strict: no undeclared property
    _walk(compiler, tokenizer, StructuredOutputParams(json=SCHEMA, strict=False), extra)


def test_choices_are_literal_whatever_their_characters(compiler, tokenizer):
    choices = ['say "hi"', "back\\slash", "two\nlines", "tab\there", "ünïcödé ✓", "x" * 3]
    spec = StructuredOutputParams(choice=choices)
    for choice in choices:
        _walk(compiler, tokenizer, spec, choice).accept(EOS[1])
    with pytest.raises(AssertionError):
        _walk(compiler, tokenizer, spec, "say hi")
    assert ebnf_literal('a"b\\c\n') == '"a\\"b\\\\c\\u000a"'


@pytest.mark.parametrize("in_reasoning", [False, True])
def test_a_reasoning_lead_puts_the_language_after_the_reasoning(compiler, tokenizer, in_reasoning):
    """With a reasoning parser the server gives the request's own language a lead: the rest of the reasoning block
    the prompt opened (or an optional whole block), a bounded gap, then the language, so the constrained answer is
    what follows the reasoning (without the lead it was forced from the first token, which the reasoning parser
    read as reasoning). The language itself stays exact after the lead: compact, strict JSON."""
    lead = reasoning_format("qwen3").lead(in_reasoning)
    spec = StructuredOutputParams(json=SCHEMA, reasoning=lead)
    answer = '{"a": 1, "b": "x"}'
    block = "plan: a=1 {not json}\n</think>" if in_reasoning else "<think>plan: a=1 {not json}\n</think>"
    for text in (block + "\n\n" + answer, block + answer) + (() if in_reasoning else (answer, "  " + answer)):
        assert _completes(compiler, tokenizer, spec, text), text
    refused = [block + "answer: " + answer, block + " " * 17 + answer, block + '{"a":1, "b": "x"}']
    refused += [answer] if in_reasoning else ["plan</think>" + answer]  # in a block: reasoning, not the answer
    for text in refused:
        assert not _completes(compiler, tokenizer, spec, text), text


def test_a_language_that_matches_nothing_is_refused_even_with_a_reasoning_lead(compiler):
    """A reasoning block could always start the output, so the lead alone would hide an empty language."""
    with pytest.raises(StructuredOutputError) as caught:
        compiler.compile(StructuredOutputParams(regex=r"[^\s\S]", reasoning=reasoning_format("qwen3").lead(False)))
    assert caught.value.param == "regex" and caught.value.why == "matches no text the model can produce"


@pytest.mark.parametrize("fields, why", [
    ({"regex": "[a-"}, "cannot be compiled: Regex parsing error at position 4: Unclosed '['"),
    ({"regex": r"[^\s\S]"}, "matches no text the model can produce"),
    ({"json": {"type": "foo"}}, 'cannot be compiled: Unsupported type "foo"'),
    ({"json": {"properties": {"a": {"$ref": "#/nowhere"}}}}, "cannot be compiled: Cannot find field"),
    ({"grammar": "root ::= undefined_rule"}, 'cannot be compiled: EBNF parser error at line 1, column 10: Rule '
                                             '"undefined_rule" is not defined'),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}},
     "cannot be compiled: Invalid structural tag error: Format type not recognized: nope"),
])
def test_an_uncompilable_spec_says_why_and_names_its_field(compiler, fields, why):
    with pytest.raises(StructuredOutputError) as caught:
        compiler.compile(StructuredOutputParams(**fields))
    assert caught.value.param == next(iter(fields)) and caught.value.why.startswith(why), caught.value.why


def test_compiled_grammars_are_cached_per_spec_in_a_bounded_lru(tokenizer):
    compiler = GrammarCompiler(str(bundled_tokenizer_dir()), VOCAB, EOS)
    first = compiler.compile(StructuredOutputParams(json=SCHEMA))
    assert compiler.compile(StructuredOutputParams(json=json.dumps(SCHEMA))) is first
    assert compiler.compile(StructuredOutputParams(json=SCHEMA, strict=False)) is not first  # strict is in the key
    assert len(compiler) == 2
    compiler.cache_bytes = first.memory_size_bytes  # room for about one: the least recently used goes first
    regex = compiler.compile(StructuredOutputParams(regex="a+"))
    assert len(compiler) == 1 and compiler.compile(StructuredOutputParams(regex="a+")) is regex
    assert compiler.compile(StructuredOutputParams(json=SCHEMA)) is not first  # evicted, compiled again


# --- grammar state and masks -------------------------------------------------------------------------------------
def test_a_state_rolls_back_and_refuses_tokens_its_grammar_does_not_allow(compiler, tokenizer):
    spec = StructuredOutputParams(regex="ab(c|d)")
    state = _walk(compiler, tokenizer, spec, "ab")
    (c,), (d,) = tokenizer.encode("c"), tokenizer.encode("d")
    state.accept(c)
    state.rollback(1)
    state.accept(d)
    with pytest.raises(RuntimeError, match="not allowed by the request's grammar"):
        state.accept(tokenizer.encode("x")[0])


@pytest.mark.parametrize("vocab", [70, 96])  # a vocabulary that ends inside a 32-bit word, and one that does not
def test_the_mask_equals_xgrammars_and_touches_only_its_rows(vocab):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen)
    rows = [1, 2, 4]
    bits = torch.randint(-2**31, 2**31 - 1, (len(rows), words_for(vocab)), generator=gen, dtype=torch.int32)
    out = apply_token_mask(logits, TokenMask(rows, bits))
    want, full = logits.clone(), torch.full((6, words_for(vocab)), -1, dtype=torch.int32)
    full[rows] = bits
    xgrammar.apply_token_bitmask_inplace(want, full, indices=rows)
    assert torch.equal(out, want)
    assert torch.equal(out[[0, 3, 5]], logits[[0, 3, 5]]) and not torch.equal(out[rows], logits[rows])
    assert torch.isinf(out[rows]).any() and not torch.isinf(logits).any()  # the input is left as it was


def test_a_mask_restricted_to_some_draws_is_renumbered():
    bits = torch.arange(4, dtype=torch.int32)[:, None].expand(4, 3)
    mask = TokenMask([1, 2, 5, 9], bits)
    part = mask.restrict(2, 9)
    assert part.rows == [0, 3] and torch.equal(part.bits, bits[1:3])
    assert mask.restrict(6, 9) is None and mask.restrict(0, 10).rows == mask.rows
    fresh = TokenMask.allocate([0, 3], 70)
    assert fresh.bits.shape == (2, 3) and bool((fresh.bits == -1).all())
