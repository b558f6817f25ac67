"""Incremental detokenization and stop strings, with the real Qwen3 tokenizer."""
from __future__ import annotations

import pytest

from hybridserve.demo import bundled_tokenizer_dir
from hybridserve.tokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled_tokenizer_dir())


@pytest.mark.parametrize("text", ["Hello world, this is a test.", "混合模型的推理 🚀 emoji and accents: café",
                                  "  leading spaces\n\nand newlines\t"])
def test_deltas_concatenate_to_the_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Prompt:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped_on_request(tokenizer):
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id]
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert "".join(kept.add(t) for t in ids) == "hi<|im_end|>"
    assert "".join(skipped.add(t) for t in ids) == "hi"


def _previous_detokenizer(tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
    """The engine's own incremental decoder before it moved to DecodeStream, kept as the oracle: decode a window
    of (up to 5 prompt tokens +) new tokens, hold text back while it ends in U+FFFD."""
    ids, prefix_offset = list(prompt_ids[-5:]), 0
    read_offset = len(ids)

    def add(token_id: int) -> str:
        nonlocal prefix_offset, read_offset
        ids.append(token_id)
        prefix = tokenizer.decode(ids[prefix_offset:read_offset], skip_special_tokens=skip_special_tokens)
        full = tokenizer.decode(ids[prefix_offset:], skip_special_tokens=skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        prefix_offset, read_offset = read_offset, len(ids)
        return full[len(prefix):]
    return add


def _tricky_cases(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids): multi-token characters split at every token, emoji sequences, special tokens
    between and around them, prompts ending in a special token or inside a character, empty prompts."""
    texts = ["混合模型的推理 🚀 emoji", "accents: café, naïve, Ålborg", "👩‍👩‍👧‍👦 family, 🇫🇷 flag", "\n\n  spaces\t",
             "<think>\nplan</think>\n\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﷽"]
    specials = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>")]
    cases = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)
        prompts = [[], tokenizer.encode("Prompt:"), tokenizer.encode("x") + [specials[i % 3]],
                   tokenizer.encode("🚀")[:-1]]  # the last one ends inside a character
        for prompt in prompts:
            cases.append((prompt, ids))
            cases.append((prompt, [specials[(i + 1) % 3]] + ids + [specials[i % 3]]))
            cases.append((prompt, ids[: len(ids) // 2] + [specials[i % 3]] + ids[len(ids) // 2:]))
    return cases


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_stream_gives_the_previous_deltas(tokenizer, skip_special_tokens):
    """DecodeStream replaced our own incremental decoder: on valid text with special tokens anywhere, every
    delta is the same as before, and the deltas add up to the full decode of the output."""
    for prompt, ids in _tricky_cases(tokenizer):
        previous = _previous_detokenizer(tokenizer, prompt, skip_special_tokens)
        current = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        deltas = [current.add(t) for t in ids]
        assert deltas == [previous(t) for t in ids], (prompt, ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(tokenizer):
    """DecodeStream primed with a context whose text ends inside a character would return that context's text
    with the first delta; the detokenizer primes it with whole characters only."""
    prompt = tokenizer.encode("Prompt 🚀")[:-1]
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    assert tokenizer.decode(prompt[-5:]).endswith("\ufffd")
    assert [detok.add(t) for t in tokenizer.encode(" ok")] == [" ok"]


def test_stop_strings_cut_the_text_and_are_never_shown_partially():
    matcher = StopStringMatcher(["STOP", "###"], include_stop=False)
    shown = []
    for delta in ["Hello ", "wor", "ld S", "TO", "P and more"]:
        done = matcher.add(delta)
        shown.append(matcher.visible(finished=False))
        if done:
            break
    assert matcher.matched == "STOP"
    assert matcher.text == "Hello world "
    assert all("S" not in s.removeprefix("Hello world") for s in shown[:-1])  # "S" held back until resolved
    included = StopStringMatcher(["STOP"], include_stop=True)
    assert included.add("abcSTOPdef") and included.text == "abcSTOP"


def test_earliest_stop_string_wins():
    matcher = StopStringMatcher(["cd", "bc"], include_stop=False)
    assert matcher.add("abcde") and matcher.matched == "bc" and matcher.text == "a"
