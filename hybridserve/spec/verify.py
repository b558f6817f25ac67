"""Verification: which drafts the target accepts, and making the state after the last accepted one the committed
state.

A verify row runs [t0, d_1 .. d_k] (t0: the row's last drawn token, already accepted) and draws at every position
i = 0..k exactly the token the plain run would draw there: the sampler's own draw from the target's distribution
p_i (penalties, temperature, top-k/top-p/min-p, its seeded uniform number for token index n + i), given that
d_1 .. d_i were the tokens before. Draft d_{i+1} is accepted iff that draw equals it, and the draw at the first
rejected position (or at position k, when all are accepted: the bonus token) ends the step.

That is the standard speculative-sampling rule for deterministic drafts (both sources here propose one token per
position, so q is one-hot): the draw equals d with probability p_i(d) = min(1, p_i(d) / q(d)), and given that it
does not, it is distributed as p_i restricted to the other tokens, renormalised = norm(max(p_i - q, 0)). Greedy
rows draw the argmax, so acceptance is exact match. The output is the plain run's, token for token, whenever the
verify forward's logits equal the plain run's; its distribution is the target's in any case.

State: the verify forward wrote the state after t0 into the row's working slot and the state after d_j into its
j-th intermediate slot (`core.batch.VerifyLayout`); after n accepted drafts, intermediate slot n is copied into the
working slot (n = 0: the working slot already holds the committed state). Acceptance is counted on the device from
the drawn tokens, so the commit needs no host round trip; the host counts the same from the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.cache.state_pool import StatePool
from hybridserve.core.chunk import ScheduledChunk
from hybridserve.core.upload import upload


@dataclass(frozen=True)
class IntermediateSlots:
    """State-pool slots for the states after draft tokens: `per_row` (= num_speculative_tokens) for each device-table
    row, after the `first - 1` slots the allocator hands out (the memory planner's reserved intermediate states)."""

    first: int
    per_row: int

    def of(self, table_row: int, count: int) -> list[int]:
        """The slots for the states after a row's first `count` drafts."""
        if count > self.per_row:
            raise ValueError(f"{count} drafts exceed the {self.per_row} intermediate states per row")
        base = self.first + table_row * self.per_row
        return list(range(base, base + count))


def accepted_length(drawn: list[int], drafts: list[int]) -> int:
    """Drafts accepted: how many leading drafts equal the token drawn at the position before them."""
    n = 0
    while n < len(drafts) and drawn[n] == drafts[n]:
        n += 1
    return n


def commit_states(pool: StatePool, drawn: torch.Tensor, verify: list[tuple[ScheduledChunk, int]]) -> torch.Tensor:
    """For each (verify chunk, index of its first draw in `drawn`), copy the state after its last accepted draft
    into its working slot, on the device (no sync). Returns the accepted counts [R] (device)."""
    width = 1 + max(chunk.num_drafts for chunk, _ in verify)  # columns: positions 0..k of the widest row
    draws, drafts, slots = [], [], []
    for chunk, first in verify:
        pad = width - chunk.num_drafts
        draws.append(list(range(first, first + chunk.num_drafts)) + [first] * pad)
        drafts.append(chunk.token_ids[1:] + [-1] * pad)  # -1 matches no token: counting stops at the padding
        slots.append(chunk.verify_slots + [chunk.state_slot] * (pad - 1))
    device = drawn.device
    index = upload([draws, drafts, slots], device, torch.long)
    matches = drawn[index[0]] == index[1]
    accepted = matches.long().cumprod(dim=1).sum(dim=1)
    source = index[2].gather(1, accepted[:, None])[:, 0]
    pool.copy_slots(source, index[2, :, 0])
    return accepted
