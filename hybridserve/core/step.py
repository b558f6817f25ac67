"""StepPlan: everything the model runner needs for one step, as host data (what rank 0 would broadcast), and what
the runner hands back per chunk. Imports only `core.chunk`, so the scheduler and the runner share it without either
importing the other (or `layers/`); a request's SamplingParams (`hybridserve.sampling`, a level above) reach the
sampler as `DrawParams`, which they satisfy."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hybridserve.core.chunk import ScheduledChunk


class DrawParams(Protocol):
    """What the runner and the sampler read of a row's SamplingParams."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float]
    allowed_token_ids: list[int]
    logprobs: int | None

    @property
    def greedy(self) -> bool: ...

    @property
    def uses_penalties(self) -> bool: ...

    @property
    def structured_output(self) -> object | None:
        """The request's grammar, if any: its rows are drawn only once the host has filled their mask."""


@dataclass
class SamplingRow:
    params: DrawParams
    seed: int
    output_token_ids: list[int]
    prompt_token_ids: list[int]
    banned_token_ids: list[int]  # tokens that may not be sampled yet (stop tokens before min_tokens)
    key: int | None = None  # the sequence (Request.serial), for state the sampler keeps across draws (penalties)
    # The index of the token drawn (the seeded uniform number's step). None: len(output_token_ids); with overlapped
    # scheduling the previous token may still be on its way to the host, so the scheduler counts it in.
    token_index: int | None = None
    # A speculative verify position: the drafts before it, which count as output for penalties and min_tokens
    # here but are not the sequence's yet (the draw is not counted on the device either: it may be rejected; the
    # host lists bring the kept counts up to date). None: an ordinary draw.
    draft_prefix: list[int] | None = None
    # Forced acceptance (`LLMEngine.set_draft_source(..., force_acceptance=True)`, a benchmark instrument): the
    # token this verify position yields whatever the target draws, i.e. the draft after it. None: the draw.
    forced_token: int | None = None

    @property
    def index(self) -> int:
        if self.token_index is not None:
            return self.token_index
        return len(self.output_token_ids) + len(self.draft_prefix or ())


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class PromptLogprobTargets:
    """Score prompt tokens: logits row j of the chunk predicts `token_ids[j]`, at `temperature` (the logits divided
    by it first: SamplingParams.prompt_logprobs_temperature)."""

    top_k: int
    token_ids: list[int]
    temperature: float = 1.0


@dataclass
class CacheOps:
    """The cache manager's device work for one step, run by the runner in this order: table resets and truncations,
    page copies, restores and page restores (before the forward), snapshots (after it, before any draw commits a
    verify row's state)."""

    table_resets: list[int] = field(default_factory=list)  # device-table rows given to a new sequence
    # (row, pages kept): rows whose sequence gave back its last pages (rejected drafts' pages) since the last step
    table_truncations: list[tuple[int, int]] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # (KV page -> KV page)
    window_page_copies: list[tuple[int, int]] = field(default_factory=list)  # the same in the window group
    restores: list[tuple[int, int]] = field(default_factory=list)  # (slot -> working slot)
    page_restores: list[tuple[int, int]] = field(default_factory=list)  # (page footer -> working slot)
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (working slot -> checkpoint slot)


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk]
    # Per chunk: draws from its last token's logits (several when a request forks into n > 1 sequences; none for
    # a chunk that does not finish its prompt), and the prompt tokens to score (or None).
    samples: list[list[SamplingRow]]
    prompt_logprobs: list[PromptLogprobTargets | None]
    cache_ops: CacheOps = field(default_factory=CacheOps)


@dataclass
class ChunkResult:
    sampled: list[SampledToken] = field(default_factory=list)  # one per SamplingRow of the chunk
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # per scored token: {id: logprob}
    error: Exception | None = None  # this chunk's sampling or scoring failed (the rest of the step did not)
    drafts: list[int] = field(default_factory=list)  # a draft layer's proposals to verify next (speculative, MTP)
