"""Engine logprobs ({token_id: logprob} per position) in the two OpenAI shapes.

Completions use the legacy object (lm-eval reads it): parallel lists `tokens`, `token_logprobs`, `top_logprobs`
(dicts keyed by token text, the position's own token included) and `text_offset`. Chat uses
`content: [{token, logprob, bytes, top_logprobs: [...]}]` with exactly the k most likely alternatives.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

TopLogprobs = dict[int, float]


class TokenText:
    """The text of single tokens, decoded once per id (logprob dicts repeat the same ids a lot)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _ranked(entry: TopLogprobs) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])


def legacy_logprobs(text: TokenText, token_ids: list[int], entries: list[TopLogprobs | None],
                    text_offset: int) -> dict:
    """The completions logprobs object for `token_ids`; a None entry (the first prompt token) gives nulls."""
    result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        token = text(token_id)
        result["tokens"].append(token)
        result["text_offset"].append(text_offset)
        text_offset += len(token)
        if entry is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            continue
        result["token_logprobs"].append(entry.get(token_id))
        top: dict[str, float] = {}
        for candidate, logprob in _ranked(entry):
            top.setdefault(text(candidate), logprob)  # ids that decode alike keep the likelier value
        result["top_logprobs"].append(top)
    return result


def chat_logprobs(text: TokenText, token_ids: list[int], entries: list[TopLogprobs], top_k: int) -> list[dict]:
    def item(token_id: int, logprob: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return [{**item(token_id, entry[token_id]),
             "top_logprobs": [item(candidate, logprob) for candidate, logprob in _ranked(entry)[:top_k]]}
            for token_id, entry in zip(token_ids, entries)]
