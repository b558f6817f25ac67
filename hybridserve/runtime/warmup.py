"""Start-up warm-up: the batch shapes that make every Triton kernel variant compile before the first request.

Triton compiles a kernel on first use per constexpr configuration and per integer-argument class (divisible by
16 or not, equal to 1): MoE tile configs chosen by token count, the attention kernel's decode and prefill
configurations and split-K counts, prefill and decode forms of the recurrent ops. Left to the first requests, that
cost seconds inside the first steps of a run (where a warm step takes well under 0.1 s) and stalled every stream
sharing those steps.

Every row runs on the dummy page 0 and the dummy slot 0, which no request ever owns, so the warm-up touches no
request's cache; the caller zeroes those dummies afterwards.
"""
from __future__ import annotations

from hybridserve.core.chunk import ScheduledChunk

DUMMY_PAGE = 0
DUMMY_SLOT = 0


def _ladder(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit`, each power of two >= 32 also as its odd neighbour 2^k - 1 (both divisibility
    classes of every token-count bucket), and `limit` itself."""
    sizes, n = set(), 1
    while n <= limit:
        sizes.add(n)
        if n >= 32:
            sizes.add(n - 1)
        n *= 2
    sizes.add(limit)
    return sorted(sizes)


def dummy_row(num_tokens: int, prefix_len: int, page_size: int, drafts: int = 0) -> ScheduledChunk:
    """A row on the dummy page and slot; with `drafts`, a verify row of 1 + drafts tokens (its draft states into
    the dummy slot too)."""
    num_tokens += drafts
    pages = [DUMMY_PAGE] * -(-(prefix_len + num_tokens) // page_size)
    return ScheduledChunk([0] * num_tokens, prefix_len, pages, DUMMY_SLOT, prefix_len > 0, [num_tokens - 1],
                          draft_slots=[DUMMY_SLOT] * drafts)


def warmup_batches(max_tokens: int, max_rows: int, max_model_len: int, page_size: int,
                   draft_tokens: int = 0) -> list[list[ScheduledChunk]]:
    """The warm-up steps, each a list of rows.

    - Prefill: one fresh row of T tokens for every T of the token ladder up to `max_tokens`, and beside it (T >= 2)
      the mixed form, T - 1 fresh tokens plus a one-token row resumed from a state, as chunked prefill runs.
    - Decode: B one-token rows for every B of the ladder up to `max_rows` (at most `max_tokens`), once with a short
      context and once with the longest, so that both the unsplit and the split-K attention forms compile.
    - With speculative decoding (`draft_tokens` k): the same mixed steps with a verify row of 1 + k tokens in place
      of the one-token row, and B verify rows at both contexts for the ladder up to max_tokens / (1 + k) rows.
    """
    steps: list[list[ScheduledChunk]] = []
    k = draft_tokens
    for tokens in _ladder(max_tokens):
        steps.append([dummy_row(tokens, 0, page_size)])
        if tokens >= 2:
            steps.append([dummy_row(tokens - 1, 0, page_size), dummy_row(1, 1, page_size)])
        if k and tokens >= k + 2:
            steps.append([dummy_row(tokens - k - 1, 0, page_size), dummy_row(1, 1, page_size, k)])
    for context in sorted({min(page_size, max_model_len) - 1, max_model_len - 1}):
        for rows in _ladder(min(max_rows, max_tokens)):
            steps.append([dummy_row(1, context, page_size) for _ in range(rows)])
        if k and max_tokens >= k + 1:
            for rows in _ladder(min(max_rows, max_tokens // (k + 1))):
                steps.append([dummy_row(1, max(1, context - k), page_size, k) for _ in range(rows)])
    return steps
