"""The implementations of Ling's lightning attention that the agreement mode compares (issue 8): the torch
reference, hybridserve's Triton kernel and fla-core's kernels, swapped in for ops.triton.lightning per run."""
from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch

import hybridserve.ops.triton as triton_ops
from hybridserve.ops import backends
from hybridserve.ops.reference import lightning as reference


def lightning_variants() -> dict[str, types.ModuleType | None]:
    """name -> a module with `lightning_attention` standing in for ops.triton.lightning (None: the torch path).

    "fla-chunk" is fla-core's chunk kernel with `g_gamma` for prefill, the call issue 8 found writing NaN states
    (see ops/triton/lightning_fla.py); kept here so the table shows the failure next to the fix."""
    variants: dict[str, types.ModuleType | None] = {"torch": None}
    try:
        from hybridserve.ops.triton import lightning as own
        variants["triton"] = own
    except ImportError:
        return variants
    try:
        from fla.ops.simple_gla import chunk_simple_gla

        from hybridserve.ops.triton import lightning_fla as fla
    except ImportError:
        return variants

    def fla_chunk_prefill(q, k, v, log_decay, state_pool, batch):
        cu_host = torch.tensor([*batch.query_starts, sum(batch.query_lens)], dtype=torch.long)
        out, final = chunk_simple_gla(q.float()[None], k.float()[None], v.float()[None], g_gamma=log_decay.float(),
                                      initial_state=reference.initial_states(state_pool, batch),
                                      output_final_state=True, cu_seqlens=cu_host.to(q.device),
                                      cu_seqlens_cpu=cu_host)
        state_pool[batch.state_slots] = final
        return out[0].float()

    fla_chunk = types.ModuleType("lightning_fla_chunk")
    fla_chunk.lightning_attention = lambda q, k, v, g, pool, batch: (
        fla.lightning_attention if batch.is_decode else fla_chunk_prefill)(q, k, v, g, pool, batch)
    variants["fla-decode"] = fla
    variants["fla-chunk"] = fla_chunk
    return variants


@contextlib.contextmanager
def lightning_as(module: types.ModuleType | None, selection: dict[str, str]) -> Iterator[None]:
    """Run with the engine's kernel selection, the lightning op replaced by `module` (None: torch reference)."""
    saved = (dict(backends._selected), getattr(triton_ops, "lightning", None), sys.modules.get(
        "hybridserve.ops.triton.lightning"))
    backends._selected.update(selection)
    if module is None:
        backends._selected["lightning"] = "torch"
    else:
        backends._selected["lightning"] = "triton"
        triton_ops.lightning = module
        sys.modules["hybridserve.ops.triton.lightning"] = module
    try:
        yield
    finally:
        backends._selected.clear()
        backends._selected.update(saved[0])
        if saved[1] is not None:
            triton_ops.lightning = saved[1]
            sys.modules["hybridserve.ops.triton.lightning"] = saved[2]
