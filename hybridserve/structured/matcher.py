"""GrammarState: one sequence's position in its compiled grammar (xgrammar's matcher), on the engine's thread."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar


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
            raise RuntimeError("the request's grammar allows no token here (a dead end)")

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        self._matcher.rollback(num_tokens)
