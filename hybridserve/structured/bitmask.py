"""TokenMask: which tokens some of a step's draws may take, filled on the host and applied to the logits on the
device before penalties and sampling.

Only draws of requests with a grammar have a row; the others are not touched (no mask, no extra work). A row is
xgrammar's layout: ceil(vocab / 32) int32 words, bit j of word w set = token 32w + j allowed.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from hybridserve.core.upload import upload


def words_for(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@dataclass
class TokenMask:
    """`bits[i]` constrains draw `rows[i]` (ascending indices into the draws of one sampler call or step)."""

    rows: list[int]
    bits: torch.Tensor  # [len(rows), words] int32

    @classmethod
    def allocate(cls, rows: list[int], vocab_size: int) -> TokenMask:
        """All tokens allowed in every row (host memory; pinned when a GPU will read it)."""
        bits = torch.full((len(rows), words_for(vocab_size)), -1, dtype=torch.int32,
                          pin_memory=torch.cuda.is_available())
        return cls(list(rows), bits)

    def to(self, device: torch.device) -> TokenMask:
        """The same mask on `device`: one (asynchronous, from pinned memory) copy."""
        return TokenMask(self.rows, self.bits.to(device, non_blocking=True))

    def restrict(self, start: int, stop: int) -> TokenMask | None:
        """The rows of draws [start, stop), renumbered from `start` (None if none of them has a row)."""
        first, last = bisect.bisect_left(self.rows, start), bisect.bisect_left(self.rows, stop)
        if first == last:
            return None
        return TokenMask([row - start for row in self.rows[first:last]], self.bits[first:last])


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """`logits` [rows, vocab] with the disallowed tokens of the masked rows at -inf (a new tensor; the input
    stays as it was, e.g. for raw logprobs)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((mask.bits[:, :, None] >> shifts) & 1).view(len(mask.rows), -1)[:, :vocab].bool()
    index = upload(mask.rows, logits.device, torch.long)
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked)
