"""ScheduledChunk: one sequence's share of a step, as the scheduler writes it and the runner reads it. Host lists
only (no torch), so the scheduler's side of the contract needs nothing of the device packing (core/batch.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: the new tokens it runs and where its caches live."""

    token_ids: list[int]
    prefix_len: int  # tokens already in the KV cache (and folded into the state, when restored)
    # KV pages covering positions [0, prefix_len + len(token_ids)). The engine passes the request's own lists here
    # and in window_page_ids (no O(pages) copy per step): the runner reads them when it launches the step, right
    # after scheduling; later steps append to them, release window entries, or replace them.
    page_ids: list[int]
    state_slot: int
    has_initial_state: bool  # the slot holds the state after `prefix_len` tokens (else start from zero)
    logits_offsets: list[int] = field(default_factory=list)  # which new tokens need logits (0-based in chunk)
    table_row: int = 0  # the sequence's row in the device PageTables while it runs (engine steps only)
    # Window-group pages (models with sliding-window layers), column for column like page_ids: 0 (the dummy) for
    # pages before the window, which the sequence no longer holds. None without a window group.
    window_page_ids: list[int] | None = None
    # Overlapped scheduling: the chunk's last input token was drawn by the step before, whose tokens are not on the
    # host yet. token_ids holds FUTURE_TOKEN there, and the runner reads the token on the device from that step's
    # draws at this index (plan order).
    future_token: int | None = None
    # Speculative decoding: a verify row runs [its last drawn token, d_1 .. d_k] (drafts to check). The state after
    # its first token goes to `state_slot` (that token is already accepted), the state after draft j to
    # draft_slots[j - 1] (the row's intermediate slots); the slot never sees a draft's state. Empty: not a verify row.
    draft_slots: list[int] = field(default_factory=list)
    # The known token after the chunk (a chunk that stops short of its prompt's end), which a draft layer reading
    # each position's next token needs (Ling's MTP). None: the chunk draws it, or it is not known.
    next_token_id: int | None = None

    @property
    def num_drafts(self) -> int:
        return len(self.draft_slots)

    @property
    def verify_slots(self) -> list[int]:
        """The slot each token of a verify row writes its state to: position 0's is the row's own."""
        return [self.state_slot, *self.draft_slots]


FUTURE_TOKEN = -1  # a token id in ScheduledChunk.token_ids that the step before is still drawing
