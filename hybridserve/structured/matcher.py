"""GrammarState: one sequence's position in its compiled grammar (xgrammar's matcher), on the engine's thread."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar


_DEAD_END = "the request's grammar allows no token here (a dead end)"


class GrammarState:
    """Advances on each token the sequence appends, fills the sequence's allowed-token row of a bitmask, and rolls
    back (for speculative decoding: drafted tokens that were not accepted)."""

    def __init__(self, compiled: xgrammar.CompiledGrammar):
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> None:
        """Advance by one appended token; a token the grammar does not allow here is an error (the mask applied
        to the draw allowed only grammatical tokens, so this means the mask and the state disagree)."""
        if not self._matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} is not allowed by the request's grammar at this point")

    @property
    def terminated(self) -> bool:
        """The grammar is complete and has accepted a stop token: nothing may follow."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 words, bit j of word w = token 32w + j)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if not bitmask[row].any():
            raise RuntimeError(_DEAD_END)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        self._matcher.rollback(num_tokens)


class MaskFiller:
    """Fills the rows of many sequences in one call, on several threads (xgrammar's batch matcher): with a grammar
    on each of 64 requests, filling row after row took longer than the forward it runs beside."""

    def __init__(self):
        import xgrammar

        self._batch = xgrammar.BatchGrammarMatcher("auto")

    def fill(self, states: list[GrammarState], bitmask: torch.Tensor, rows: list[int]) -> dict[int, Exception]:
        """Fill `bitmask[rows[i]]` for `states[i]`. Returns {i: error} for the states that failed (a dead end: no
        token allowed); the others' rows are filled whatever happens to those."""
        try:
            self._batch.batch_fill_next_token_bitmask([s._matcher for s in states], bitmask, rows)
        except Exception:  # one state's failure must not fail the rest: row by row, to find it
            failed = {}
            for i, (state, row) in enumerate(zip(states, rows)):
                try:
                    state.fill(bitmask, row)
                except Exception as err:
                    failed[i] = err
            return failed
        empty = ~bitmask[rows].any(dim=1)
        return {i: RuntimeError(_DEAD_END) for i in empty.nonzero()[:, 0].tolist()}
