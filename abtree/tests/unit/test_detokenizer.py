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
