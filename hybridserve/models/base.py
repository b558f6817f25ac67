"""CausalLM: what a model gives the runtime, so that the runner, its CUDA graphs and the memory profile depend on
this contract instead of on ZAYA1 or Ling. A model family implements it (and is an nn.Module: the loader and the
dummy weights walk its parameters) and registers in models/registry.py; tests/unit/test_protocols.py checks that
both families' models satisfy it."""
from __future__ import annotations

from collections.abc import Hashable
from typing import Literal, Protocol

import torch

from hybridserve.cache.kv_pool import KVCacheSpec
from hybridserve.cache.state_pool import StateSpec
from hybridserve.core.batch import ForwardBatch


class CausalLM(Protocol):
    # How prefix caching keeps the recurrent state: a footer per KV page, written by the forward ("per_page"), or
    # copies at checkpoint positions that the scheduler ends chunks at ("sparse").
    state_checkpoints: Literal["per_page", "sparse"]
    # Whether prefill and mixed steps may replay CUDA graphs (the forward reads no host value but the bounds).
    prefill_graphs: bool

    @property
    def history_len(self) -> int:
        """Carried rows the batch lays out in front of each sequence's tokens (`ForwardBatch.token_history`)."""

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        """What each attention layer keeps per token (the KV pools' layout)."""

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        """What each recurrent layer keeps per sequence (the state pool's layout)."""

    def bind_caches(self, kv_layers: list[dict[str, torch.Tensor]], state_layers: list[dict[str, torch.Tensor]],
                    page_state_layers: list[dict[str, torch.Tensor]] | None = None) -> None:
        """Hand the layers their views of the pools (and of the per-page state footers, with "per_page")."""

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """The module's forward: the final hidden states [T, H] of the batch's tokens."""

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] hidden states -> [N, V] fp32 logits (written into `out` when given)."""

    def checkpoint_target(self, name: str) -> tuple[str, Hashable | None] | None:
        """The parameter (and shard) a checkpoint tensor fills; None for tensors deliberately not loaded."""

    def prepare_kernels(self) -> None:
        """Once the weights are in (loaded or random), derive what the selected kernels read besides them; before
        the memory plan, so that it counts them."""


class DraftModel(CausalLM, Protocol):
    """A CausalLM with a multi-token-prediction layer (Ling's MTP): what spec/mtp.py's drafter runs."""

    def draft_hidden(self, token_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The draft layer's output at each position of `batch`, given the token after it and the final hidden
        state at it (its logits are the draft distribution of the token after that)."""
