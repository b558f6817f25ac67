"""What generation returns, in the shape vLLM users already know.

The engine builds one delta per request and step (the new tokens, logprobs and text); `RequestOutput.add` folds a
delta into an accumulated output in time proportional to the delta, so a whole generation costs O(its length)
however it is consumed. `RequestOutputKind` says what a request wants back from each step.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

TopLogprobs = dict[int, float]


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every step: everything so far (a fresh copy: O(length) per step)
    DELTA = "delta"  # every step: only what is new (streaming)
    FINAL_ONLY = "final_only"  # once, when the request has finished (offline generation)


class _Text:
    """`CompletionOutput.text`, kept as pieces and joined when read: appending a step's text is then O(its length),
    where `str +=` on an attribute copies the whole string (quadratic over a long generation)."""

    def __get__(self, obj: CompletionOutput | None, owner: type | None = None) -> str:
        if obj is None:
            raise AttributeError("text")  # a dataclass field without a default
        parts = obj.__dict__["_text_parts"]
        if len(parts) != 1:
            parts[:] = ["".join(parts)]
        return parts[0]

    def __set__(self, obj: CompletionOutput, value: str) -> None:
        obj.__dict__["_text_parts"] = [value]


@dataclass
class CompletionOutput:
    index: int
    text: str = _Text()
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    cumulative_logprob: float | None = None
    logprobs: list[TopLogprobs] | None = None  # per generated token: {token_id: logprob}, chosen token included

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Append the next delta of this sequence (its lists are copied, not kept)."""
        self.__dict__["_text_parts"].append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.cumulative_logprob = delta.cumulative_logprob

    def copy(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.finish_reason, self.stop_reason,
                                self.cumulative_logprob, None if self.logprobs is None else list(self.logprobs))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    prompt_logprobs: list[TopLogprobs | None] | None = None  # first entry None (nothing predicts token 0)
    error: str | None = None  # the request failed and was aborted (its outputs end with finish_reason "abort")

    def add(self, delta: RequestOutput) -> None:
        """Fold the next delta of the same request into this output, in O(size of the delta).

        A delta carries the sequences that changed in its step (a sequence seen for the first time is adopted
        whole), the prompt logprobs only in the request's first delta, and the request's current status."""
        by_index = {completion.index: completion for completion in self.outputs}
        for completion in delta.outputs:
            if completion.index in by_index:
                by_index[completion.index].add(completion)
            else:
                self.outputs.append(completion.copy())
        if len(self.outputs) != len(by_index):
            self.outputs.sort(key=lambda completion: completion.index)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished, self.num_cached_tokens, self.error = delta.finished, delta.num_cached_tokens, delta.error

    def copy(self) -> RequestOutput:
        """A snapshot that later `add`s do not change."""
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [completion.copy() for completion in self.outputs], self.finished,
                             self.num_cached_tokens, self.prompt_logprobs, self.error)
