"""What generation returns, in the shape vLLM users already know."""
from __future__ import annotations

from dataclasses import dataclass

TopLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    cumulative_logprob: float | None = None
    logprobs: list[TopLogprobs] | None = None  # per generated token: {token_id: logprob}, chosen token included

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
