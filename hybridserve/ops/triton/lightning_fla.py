"""Lightning attention with fla-core's recurrent decode kernel and our own prefill kernel (optional `gpu` extra).

Not the product path (`ops/triton/lightning.py` runs both phases there); kept so the two can be compared on the GPU
(`python -m benchmarks.offline agreement --compare lightning`, `tests/gpu/test_ling_gpu.py`). Ling's decay is a
constant per-head log-decay, which is simple_gla's `g_gamma` [H]; the state layout is fla's default K-major
[N, H, K, V], the same as the state pool's. fla's `lightning_attn` helper is not used: it derives its own decay
from the layer index, which is not Ling's law (`models.ling.lightning_log_decay`).

Why not fla's chunk kernel for prefill (issue 8): in fla-core 0.6.0, `chunk_simple_gla(..., g_gamma=...)` computes
the state at the end of a sequence whose last chunk is partial as S * a^n + sum_j k_j^T v_j * exp2(g_last - g_j)
with g_j = gamma * (j + 1) for every one of the chunk's 64 positions, the padded ones included
(`fla/ops/common/chunk_h.py`, `chunk_fwd_kernel_h`, the USE_G_GAMMA branch). For a padded position j > n the
factor is a^(n - 1 - j) > 1; once the head decays fast and the chunk is short (Ling-2.6-flash's first head,
log-decay -1.68 with the checkpoint's decay law, and a chunk of fewer than ~11 tokens), it overflows fp32 to inf,
and the padded v = 0 times inf is NaN, which the dot carries into the whole state. Outputs stay right (they are
masked), so prefill logits looked fine while every later decode step read a NaN state. One-token rows of a
mixed (prefill + decode) step always hit it; prompts prefilled alone almost never do. The per-token `g` form of
the same kernel loads masked positions as 0 and is not affected; fla's `fused_recurrent_simple_gla` is exact.
"""
from __future__ import annotations

import torch
from fla.ops.simple_gla import fused_recurrent_simple_gla

from hybridserve.core.batch import ForwardBatch
from hybridserve.ops.reference.lightning import initial_states
from hybridserve.ops.triton.lightning import lightning_prefill


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                        state_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """q, k [T, H, d_k], v [T, H, d_v] -> o [T, H, d_v] fp32; row states read/written by slot."""
    if not batch.is_decode:
        return lightning_prefill(q, k, v, log_decay, state_pool, batch)
    # One token per row: B sequences of length 1. fp32 inputs, as SGLang runs it.
    out, final = fused_recurrent_simple_gla(q.float()[:, None], k.float()[:, None], v.float()[:, None],
                                            g_gamma=log_decay.float(), initial_state=initial_states(state_pool, batch),
                                            output_final_state=True)
    state_pool[batch.state_slots] = final
    return out[:, 0].float()
