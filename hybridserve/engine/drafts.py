"""Draft sources: what proposes the tokens a verify row checks. One small interface, so the scheduler neither knows
nor cares where drafts come from.

- `NgramDrafts`: prompt lookup over the request's own tokens (both models).
- `ModelDrafts`: the tokens the model's draft layer (Ling's MTP) produced on the device in the request's previous
  step, handed back with that step's results (`ChunkResult.drafts`).
- `ReplayDrafts`: given continuations (e.g. a plain run's greedy outputs) replayed from each request's current
  length: the forced-acceptance measurement of what verification costs (`python -m benchmarks.offline throughput`), and
  the tests' always-right / always-wrong drafts (`LLMEngine.set_draft_source`).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from hybridserve.config import SpeculativeConfig
from hybridserve.engine.request import Request
from hybridserve.spec.ngram import propose_ngram
from hybridserve.spec.verify import IntermediateSlots


class DraftSource(Protocol):
    def propose(self, request: Request, limit: int) -> list[int]:
        """At most `limit` tokens to follow the request's tokens (all on the host: speculative steps run serially)."""


class NgramDrafts:
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, request: Request, limit: int) -> list[int]:
        return propose_ngram(request.prompt_token_ids + request.output_token_ids, limit, self.n_min, self.n_max)


class ModelDrafts:
    def propose(self, request: Request, limit: int) -> list[int]:
        return request.draft_token_ids[:limit]


class ReplayDrafts:
    def __init__(self, continuations: dict, key: Callable[[Request], Hashable] = lambda r: r.request_id):
        """{key(request): the tokens to propose as its output, from its first output token on}; the key is the
        request id unless given (e.g. the prompt, for requests whose ids are not known in advance)."""
        self.continuations, self.key = continuations, key

    def propose(self, request: Request, limit: int) -> list[int]:
        done = len(request.output_token_ids)
        return self.continuations.get(self.key(request), [])[done:done + limit]


def draft_source(config: SpeculativeConfig) -> DraftSource:
    if config.method == "ngram":
        return NgramDrafts(config.prompt_lookup_min, config.prompt_lookup_max)
    return ModelDrafts()


@dataclass
class Speculation:
    """What the scheduler needs for speculative decoding."""

    drafts: DraftSource
    slots: IntermediateSlots
    # Positions after a drawing row's last token whose KV the draft layer writes in the same step (an MTP chain of
    # k drafts: k - 1); the scheduler gives the row pages for them.
    lookahead: int = 0
    # Every draft accepted, whatever the target draws (its logprobs are the target's for the draft): what
    # verification costs at full acceptance, measured without depending on bf16 draws matching the drafts.
    force_acceptance: bool = False
