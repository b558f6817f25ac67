"""Engine logprobs ({token_id: logprob} per position) in the two OpenAI shapes.

Completions use the legacy object (lm-eval reads it): parallel lists `tokens`, `token_logprobs`, `top_logprobs`
(dicts keyed by token text, the position's own token included) and `text_offset`. Chat uses
`content: [{token, logprob, bytes, top_logprobs: [...]}]` with exactly the k most likely alternatives (or, with
vLLM's logprob_token_ids, every token the engine scored: the chosen one and the listed ones). vLLM's
`prompt_logprobs` is a list over the prompt (null for its first token) of {token id: {logprob, rank,
decoded_token}}. With vLLM's return_tokens_as_token_ids the tokens (and top_logprobs keys) are named
"token_id:{id}"; `bytes` and `text_offset` stay those of the token's text.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

TopLogprobs = dict[int, float]


class TokenText:
    """The text of single tokens, decoded once per id (logprob dicts repeat the same ids a lot), and the name
    logprobs give a token: its text, or "token_id:{id}" with `as_ids` (vLLM's return_tokens_as_token_ids: a client
    gets the id back exactly, also for a token that is part of a character)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self(token_id)


def _ranked(entry: TopLogprobs) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])


def legacy_logprobs(text: TokenText, token_ids: list[int], entries: list[TopLogprobs | None],
                    text_offset: int) -> dict:
    """The completions logprobs object for `token_ids`; a None entry (the first prompt token) gives nulls."""
    result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        result["tokens"].append(text.name(token_id))
        result["text_offset"].append(text_offset)
        text_offset += len(text(token_id))
        if entry is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            continue
        result["token_logprobs"].append(entry.get(token_id))
        top: dict[str, float] = {}
        for candidate, logprob in _ranked(entry):
            top.setdefault(text.name(candidate), logprob)  # ids that decode alike keep the likelier value
        result["top_logprobs"].append(top)
    return result


def chat_logprobs(text: TokenText, token_ids: list[int], entries: list[TopLogprobs], top_k: int | None
                  ) -> list[dict]:
    """The chat logprobs of `token_ids`, each with its `top_k` likeliest alternatives (None: all the entry has)."""
    def item(token_id: int, logprob: float) -> dict:
        return {"token": text.name(token_id), "logprob": logprob, "bytes": list(text(token_id).encode())}

    return [{**item(token_id, entry[token_id]),
             "top_logprobs": [item(candidate, logprob) for candidate, logprob in _ranked(entry)[:top_k]]}
            for token_id, entry in zip(token_ids, entries)]


def prompt_logprobs(text: TokenText, token_ids: list[int], entries: list[TopLogprobs | None], top_k: int
                    ) -> list[dict[str, dict] | None]:
    """vLLM's prompt_logprobs: per prompt token, itself and the `top_k` likeliest tokens by id (the prompt token
    first). `rank` is 1 for the likeliest; the engine keeps only the top k, so a prompt token outside them has
    rank null."""
    out: list[dict[str, dict] | None] = []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        among_top = len(entry) <= top_k  # the dict holds the top k and the prompt token: k + 1 if it is not one
        ranked = [candidate for candidate, _ in _ranked(entry) if among_top or candidate != token_id]
        rank = {candidate: i + 1 for i, candidate in enumerate(ranked)}
        order = [token_id] + [candidate for candidate in ranked if candidate != token_id]
        out.append({str(candidate): {"logprob": entry[candidate], "rank": rank.get(candidate),
                                     "decoded_token": text(candidate)} for candidate in order})
    return out
