"""Paged-attention test cases shared by the kernel tests (tests/ops) and the GPU tests (tests/gpu).

A case is a packed batch over a shuffled paged cache in which every row the batch must not read (other pages, the
dummy page 0, rows past a row's length, keys before a sliding window) is NaN, so any such read shows up in the
output; the reference runs on the same cache without the poison. Pages entirely before a window are also unmapped
(page-table entry 0), as the scheduler may free them.
"""
from __future__ import annotations

import dataclasses

import torch

from hybridserve.core.batch import ForwardBatch, ScheduledChunk, build_forward_batch
from hybridserve.ops.reference import attention as reference


@dataclasses.dataclass
class Case:
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor  # poisoned: NaN wherever the batch must not read
    v: torch.Tensor
    clean_k: torch.Tensor
    clean_v: torch.Tensor
    window: int | None


def make_case(rows: list[tuple[int, int]], page_size: int, heads: tuple[int, int], head_dim: int, v_dim: int,
              dtype: torch.dtype, device: torch.device, window: int | None = None, v_in_k: bool = False,
              seed: int = 0) -> Case:
    """rows: (prefix_len, query_len) per sequence. Pages are shuffled and every row owns one spare page."""
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    needs = [-(-(p + n) // page_size) + 1 for p, n in rows]
    ids = (torch.randperm(sum(needs), generator=gen) + 1).tolist()
    chunks, used = [], 0
    for (prefix, length), need in zip(rows, needs):
        chunks.append(ScheduledChunk([0] * length, prefix, ids[used:used + need], 0, prefix > 0))
        used += need
    batch = build_forward_batch(chunks, page_size, device)
    num_rows = (sum(needs) + 1) * page_size
    readable = torch.zeros(num_rows, dtype=torch.bool)
    table = batch.page_table.clone()
    for b, (chunk, (prefix, length)) in enumerate(zip(chunks, rows)):
        first = max(0, prefix - window + 1) if window else 0  # the earliest key any query of this row sees
        for pos in range(first, prefix + length):
            readable[chunk.page_ids[pos // page_size] * page_size + pos % page_size] = True
        table[b, : first // page_size] = 0  # pages entirely before the window: freed, unmapped
    batch = dataclasses.replace(batch, page_table=table)
    width = head_dim if v_in_k else head_dim + v_dim
    store = torch.randn(num_rows, num_kv_heads, width, generator=gen).to(dtype).to(device)
    clean_k, clean_v = store[..., :head_dim], store[..., :v_dim] if v_in_k else store[..., head_dim:]
    poisoned = store.clone()
    poisoned[~readable.to(device)] = float("nan")
    k, v = poisoned[..., :head_dim], poisoned[..., :v_dim] if v_in_k else poisoned[..., head_dim:]
    q = torch.randn(sum(n for _, n in rows), num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    return Case(batch, q, k, v, clean_k, clean_v, window)


def reference_output(case: Case) -> torch.Tensor:
    """The torch reference in fp32 on the unpoisoned cache (the same rounded values the kernel sees)."""
    return reference.paged_attention(case.q.float(), case.clean_k.float(), case.clean_v.float(), case.batch,
                                     case.q.shape[-1] ** -0.5, case.window)
