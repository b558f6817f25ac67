"""Tokenizer loading and incremental detokenization with stop strings."""
from __future__ import annotations

from pathlib import Path

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The model's tokenizer; it must have a tokenizers (Rust) backend, which the detokenizer streams through."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"no usable tokenizer files in {path}: {err}") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise FileNotFoundError(f"the tokenizer in {path} ({type(tokenizer).__name__}) has no fast tokenizers "
                                "backend; hybridserve needs a tokenizer.json")
    return tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas, with tokenizers' own `DecodeStream` (Rust).

    The stream holds text back while the tokens so far end inside a multi-byte UTF-8 character, so characters are
    never split. It is primed with the last few prompt tokens, so the first generated token gets the spacing it has
    after the prompt; a context that itself ends inside a character is shortened first (DecodeStream would otherwise
    hand back the context's text with the first delta).
    """

    _CONTEXT = 5  # prompt tokens decoded in front of the output

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], skip_special_tokens: bool):
        self._backend = backend = tokenizer.backend_tokenizer
        context = list(prompt_ids[-self._CONTEXT:])
        while context and backend.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            context.pop()
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


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


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], template_options: dict | None = None,
                tools: list[dict] | None = None) -> str:
    """A conversation rendered with the chat template (the model's, or `template_options`' `chat_template`), by
    default ready for the assistant's turn; `template_options` are further keyword arguments of
    apply_chat_template (template variables such as enable_thinking, add_generation_prompt); `tools` are the
    functions offered (OpenAI's {"type": "function", "function": {...}} form)."""
    options = {"add_generation_prompt": True, **(template_options or {})}
    if tokenizer.chat_template is None and options.get("chat_template") is None:
        raise ValueError("this model's tokenizer has no chat template; use completions with a plain prompt")
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **options)


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], template_options: dict | None = None,
                    add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
    """Token ids of `render_chat`. The template already wrote the special tokens it wants (BOS included), so by
    default none are added."""
    return tokenizer.encode(render_chat(tokenizer, messages, template_options, tools),
                            add_special_tokens=add_special_tokens)
