"""Paged attention cases: ZAYA1-8B decode (8 q / 2 kv heads x 128, page 16) at batch 1, 64, 256 and contexts 512 and
4096, its prefill of 8 x 1024 fresh tokens, and Ling-2.6-flash MLA absorbed decode (32 heads over one 576-wide
latent head, V = its first 512 channels) at batch 64 and context 2048, and at batch 1 and contexts 640 and 2048 with
the 64 key splits of the decode graph; each MLA case with its 32 heads in one program, and as the kernel's heuristic
cuts them over programs (`choose_group_split`: at batch 64 it does not). bf16. A lone 512-token prompt's prefill
(the first token of batch 1, whose attention took 53 us a layer in a step profile) is timed from a CUDA graph, so
that the device's time is measured rather than the launch, with the split-K heuristic's count and with 1, 2 and 9
splits (9: what the prefill graphs, sized for max_model_len keys, choose).

Bytes: the K/V rows the batch needs (each once; MLA's V is part of its K row) plus q and the output. FLOPs:
2 * Hq * (Dk + Dv) per attended query-key pair (= 4 * Hq * D when Dv = D), causal pairs for prefill.
"""
from __future__ import annotations

import torch

from benchmarks.ops._micro import OpCase, graphed
from hybridserve.core.batch import ScheduledChunk, build_forward_batch
from hybridserve.ops.reference import attention as reference
from hybridserve.ops.triton import attention as kernel

PAGE = 16


def _case(name: str, rows: list[tuple[int, int]], heads: tuple[int, int], head_dim: int, v_dim: int,
          device: torch.device, v_in_k: bool = False, num_splits: int | None = None,
          group_split: int | None = None, graph: bool = False) -> OpCase:
    num_q_heads, num_kv_heads = heads
    chunks, next_page = [], 1
    for prefix, length in rows:
        pages = -(-(prefix + length) // PAGE)
        chunks.append(ScheduledChunk([0] * length, prefix, list(range(next_page, next_page + pages)), 0, prefix > 0))
        next_page += pages
    batch = build_forward_batch(chunks, PAGE, device)
    width = head_dim if v_in_k else head_dim + v_dim
    store = torch.randn(next_page * PAGE, num_kv_heads, width, device=device, dtype=torch.bfloat16)
    k = store[..., :head_dim]
    v = store[..., :v_dim] if v_in_k else store[..., head_dim:]
    tokens = sum(n for _, n in rows)
    q = torch.randn(tokens, num_q_heads, head_dim, device=device, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    keys = sum(p + n for p, n in rows)
    pairs = sum(n * p + n * (n + 1) // 2 for p, n in rows)

    def run() -> torch.Tensor:
        return kernel.paged_attention(q, k, v, batch, scale, num_splits=num_splits, group_split=group_split)

    return OpCase(
        op="attention", name=name,
        kernel=graphed([run]) if graph else run,
        reference=lambda: reference.paged_attention(q, k, v, batch, scale),
        bytes=2 * (keys * num_kv_heads * width + tokens * num_q_heads * (head_dim + v_dim)),
        flops=2 * num_q_heads * (head_dim + v_dim) * pairs,
    )


def cases(device: torch.device) -> list[OpCase]:
    zaya = dict(heads=(8, 2), head_dim=128, v_dim=128, device=device)
    out = [_case(f"zaya1 decode B={b} ctx={ctx}", [(ctx - 1, 1)] * b, **zaya)
           for ctx in (512, 4096) for b in (1, 64, 256)]
    out.append(_case("zaya1 prefill 8x1024", [(0, 1024)] * 8, **zaya))
    out.extend(_case(f"zaya1 prefill 1x512 graphed, splits {splits or 'auto'}", [(0, 512)], **zaya,
                     num_splits=splits, graph=True) for splits in (None, 1, 2, 9))
    mla = dict(heads=(32, 1), head_dim=576, v_dim=512, device=device, v_in_k=True, graph=True)
    for cut in (1, None):  # one program for the 32 heads (as before the group split), and the heuristic's cut
        label = "one program a row" if cut == 1 else "as the heuristic cuts"
        out.append(_case(f"ling mla absorbed decode B=64 ctx=2048 graphed, {label}", [(2047, 1)] * 64, **mla,
                         group_split=cut))
        for ctx in (640, 2048):  # 64 splits: the count the batch-1 decode graph plans for max_model_len keys
            out.append(_case(f"ling mla absorbed decode B=1 ctx={ctx} graphed, 64 splits, {label}",
                             [(ctx - 1, 1)], **mla, num_splits=64, group_split=cut))
    return out
