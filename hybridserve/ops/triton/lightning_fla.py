"""Lightning attention on CUDA through fla-core's simple_gla kernels (optional `gpu` extra; imports Triton).

Ling's decay is a constant per-head log-decay, which is exactly simple_gla's `g_gamma` [H]; the state layout is
fla's default K-major [N, H, K, V], the same as the state pool's. fla's `lightning_attn` helper is deliberately
not used: it derives its own decay from the layer index, which is not Ling's law (spec §2.2).
Same contract as `ops.lightning.lightning_attention`, which stays the reference.
"""
from __future__ import annotations

from itertools import accumulate

import torch
from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

from hybridserve.core.batch import ForwardBatch
from hybridserve.ops.reference.lightning import initial_states


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                        state_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """q, k [T, H, d_k], v [T, H, d_v] -> o [T, H, d_v] fp32; row states read/written by slot."""
    # The kernels run in fp32, as SGLang's do: in bf16 the chunk kernels round their intermediate states and
    # attention scores to bf16, which costs ~2e-3 relative error against the fp32 recurrence.
    q, k, v, g_gamma = q.float(), k.float(), v.float(), log_decay.float()
    start = initial_states(state_pool, batch)
    if batch.is_decode:
        # One token per row: B sequences of length 1, the same launch for every decode step.
        out, final = fused_recurrent_simple_gla(q[:, None], k[:, None], v[:, None], g_gamma=g_gamma,
                                                initial_state=start, output_final_state=True)
        out = out[:, 0]
    else:
        cu_host = torch.tensor([0, *accumulate(batch.query_lens)], dtype=torch.long)
        out, final = chunk_simple_gla(q[None], k[None], v[None], g_gamma=g_gamma, initial_state=start,
                                      output_final_state=True, cu_seqlens=cu_host.to(q.device),
                                      cu_seqlens_cpu=cu_host)
        out = out[0]
    state_pool[batch.state_slots] = final
    return out.float()
