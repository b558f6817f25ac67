"""Vocabulary-parallel token embedding and LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.core.parallel import (
    all_gather_last_dim,
    all_reduce,
    divide,
    tp_rank,
    tp_size,
)
from hybridserve.layers.weights import new_parameter, tp_shard_loader

_load_vocab_shard = tp_shard_loader(0)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; out-of-slice ids contribute zeros before the sum."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.local_vocab = divide(vocab_size, tp_size(), "vocab_size")
        self.vocab_start = tp_rank() * self.local_vocab
        self.weight = new_parameter(self.local_vocab, hidden_size, loader=_load_vocab_shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight) * inside[:, None].to(self.weight.dtype)
        return all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits in fp32 for the whole vocabulary; the weight may be tied to the embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tied_to = tied_to
        local = divide(vocab_size, tp_size(), "vocab_size")
        self.weight = None if tied_to is not None else new_parameter(local, hidden_size, loader=_load_vocab_shard)
        self.bias = new_parameter(local, loader=_load_vocab_shard) if bias else None

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out` [N, V] fp32: the logits are written there, the conversion to fp32 being the copy (a graph's
        logits land in a buffer its sizes share: one kernel fewer than a conversion, then a copy)."""
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        logits = F.linear(hidden, weight, self.bias)
        if tp_size() > 1:  # gathered in fp32
            logits = all_gather_last_dim(logits.float())
        return logits.float() if out is None else out.copy_(logits)
