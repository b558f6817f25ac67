"""Request: one sequence's tokens, where its caches live, and how far it has been computed."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from hybridserve.cache.prefix_cache import TreeNode
from hybridserve.sampling import SamplingParams


_serials = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    page_ids: list[int] = field(default_factory=list)
    window_page_ids: list[int] = field(default_factory=list)  # window group (sliding layers): 0 before the window
    window_start: int = 0  # window pages before this column are released (0 in window_page_ids)
    state_slot: int | None = None
    table_row: int | None = None  # its row in the device page/slot tables while it runs
    num_computed_tokens: int = 0  # tokens whose KV is written and whose state is folded into state_slot
    num_cached_tokens: int | None = None  # prompt tokens reused from the prefix cache at first admission
    cache_node: TreeNode | None = None  # deepest prefix-cache node whose path this request has locked
    cached_len: int = 0  # tokens of this request already inserted into the prefix cache
    branch_point: int = 0  # sparse checkpoints: where the cached KV match went past the last checkpoint
    num_forks: int = 0  # sequences still to fork off when the prompt completes (n > 1)
    num_prompt_scored: int = 0  # prompt positions whose logprobs were already computed
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    serial: int = field(default_factory=lambda: next(_serials))  # unique in the process, unlike a reused request_id
    # Overlapped scheduling: tokens drawn by launched steps and not yet appended (at most 1 when a step is
    # scheduled, 2 between launching step N+1 and processing step N), and the index of the latest in its step's
    # draws. The scheduler counts them (lengths, pages, positions) before their values reach the host.
    num_pending: int = 0
    pending_draw: int = 0
    # Speculative decoding with a model draft layer (MTP): the tokens it proposed in this request's last step.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens drawn so far, the one in flight included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.num_output_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt positions are still to be scored (prompt logprobs asked and not all computed yet)."""
        return self.params.prompt_logprobs is not None and self.num_prompt_scored < self.num_prompt_tokens - 1

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (all known on the host)."""
        if end > self.num_known_tokens:
            raise ValueError(f"tokens up to {end} asked for, {self.num_known_tokens} known")
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        head = self.prompt_token_ids[start:] if start < prompt_len else []
        return head + self.output_token_ids[max(start - prompt_len, 0): end - prompt_len]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def stop_token_hit(self, token_id: int) -> bool:
        """Whether a freshly sampled token ends the request (EOS unless ignored, or a requested stop id)."""
        if len(self.output_token_ids) < self.params.min_tokens:
            return False
        if token_id in self.params.stop_token_ids:
            return True
        return not self.params.ignore_eos and token_id in self.eos_token_ids

    def banned_token_ids(self, ahead: int = 0) -> list[int]:
        """Tokens that may not be sampled yet: everything that would stop the request before min_tokens (for the
        draw `ahead` tokens later: a speculative verify position)."""
        if self.num_output_tokens + ahead >= self.params.min_tokens:
            return []
        eos = [] if self.params.ignore_eos else list(self.eos_token_ids)
        return sorted(set(eos) | set(self.params.stop_token_ids))
