"""Tokenizer loading and incremental detokenization with stop strings."""
from __future__ import annotations

from functools import partial
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"no usable tokenizer files in {path}: {err}") from None


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas.

    Each step decodes only a short window of tokens, and holds text back while the window ends in an incomplete
    UTF-8 sequence (the replacement character), so multi-token characters are never split.
    """

    _CONTEXT = 5  # prompt tokens decoded in front of the output, so the first token gets its proper spacing

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], skip_special_tokens: bool):
        # The Rust tokenizer directly when there is one: transformers' decode adds ~10 us of Python per call
        # (argument conversion), twice per generated token, on the engine thread. Without the clean-up step,
        # which stays off here, both give the same text.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_ids = backend.decode if backend is not None else partial(tokenizer.decode,
                                                                              clean_up_tokenization_spaces=False)
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-self._CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]


class StopStringMatcher:
    """Finds stop strings in the output text and releases the text that is safe to show.

    Text that could still turn into the start of a stop string (the last `holdback` characters) is held back, so
    a stop string is never streamed partially. Only the held text is searched and copied per step: O(delta).
    """

    def __init__(self, stop: list[str], include_stop: bool):
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self._released: list[str] = []  # text already released, in pieces
        self._held = ""  # text not released yet: at most `holdback` characters plus the latest delta
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """All text so far (cut at the stop string once one has appeared)."""
        return "".join(self._released) + self._held

    def add(self, delta: str) -> bool:
        """Append text; True when a stop string has appeared (the text is then cut there)."""
        start = max(0, len(self._held) - self.holdback)  # earlier text was searched when it arrived
        self._held += delta
        if not self.stop:
            return False
        hits = [(self._held.find(s, start), s) for s in self.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return False
        pos, self.matched = min(hits)
        self._held = self._held[: pos + len(self.matched) if self.include_stop else pos]
        return True

    def _safe(self, finished: bool) -> int:
        """How many held characters may be shown now."""
        if finished or self.matched is not None:
            return len(self._held)
        return max(0, len(self._held) - self.holdback)

    def visible(self, finished: bool) -> str:
        """All the text that may be shown now."""
        return "".join(self._released) + self._held[: self._safe(finished)]

    def release(self, finished: bool) -> str:
        """The text that became safe to show since the last release."""
        safe = self._safe(finished)
        new, self._held = self._held[:safe], self._held[safe:]
        if new:
            self._released.append(new)
        return new


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], template_options: dict | None = None,
                    add_special_tokens: bool = False) -> list[int]:
    """Token ids of a conversation rendered with the chat template (the model's, or `template_options`'
    `chat_template`), by default ready for the assistant's turn; `template_options` are further keyword arguments of
    apply_chat_template (template variables such as enable_thinking, add_generation_prompt)."""
    options = {"add_generation_prompt": True, **(template_options or {})}
    if tokenizer.chat_template is None and options.get("chat_template") is None:
        raise ValueError("this model's tokenizer has no chat template; use completions with a plain prompt")
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    # The template already wrote the special tokens it wants (BOS included); by default do not add them twice.
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
