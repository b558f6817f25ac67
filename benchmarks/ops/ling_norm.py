"""Ling's RMS-norm fusions at Ling-2.6-flash widths (hidden 4096, 32 heads x 128, 4 norm groups), bf16 model dtype,
decode batch 1, 64, 256 and an 8192-token prefill: residual add + RMSNorm, QK RMSNorm + partial RoPE on the q/k
heads of the Q|K|V|G projection output, GroupRMSNorm of the fp32 lightning output times sigmoid(gate), the
residual add of a MoE block's parts (8 routed rows per token and the shared expert) with the router's fp32 copy,
and MLA's latent op (kv_lora 512 + rope 64, 32 query heads).

Bytes: every input read once and every output written once (no FLOP floor: these are bandwidth-bound).
"""
from __future__ import annotations

import torch

from benchmarks.ops._micro import OpCase
from hybridserve.ops.reference import ling_norm as reference
from hybridserve.ops.triton import ling_norm as kernel

HIDDEN, HEADS, DIM, GROUPS, EPS = 4096, 32, 128, 4, 1e-6
TOP_K, KV_LORA, ROPE, Q_LORA = 8, 512, 64, 1536


def _cases(tokens: int, label: str, device: torch.device) -> list[OpCase]:
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    x, residual, weight = randn(tokens, HIDDEN), randn(tokens, HIDDEN), randn(HIDDEN)
    qkvg = randn(tokens, 4, HEADS, DIM)
    qk, gate = qkvg[:, :2], qkvg[:, 3].flatten(1)
    q_weight, k_weight = randn(DIM), randn(DIM)
    positions = torch.arange(tokens, device=device) + 1000
    inv_freq = 1.0 / (6e6 ** (torch.arange(0, DIM // 2, 2, device=device, dtype=torch.float32) / (DIM // 2)))
    lightning_out = randn(tokens, HIDDEN, dtype=torch.float32)
    routed, shared = randn(tokens, TOP_K, HIDDEN), randn(tokens, HIDDEN)
    qkv_a = randn(tokens, Q_LORA + KV_LORA + ROPE)[:, Q_LORA:]
    kv_weight, q = randn(KV_LORA), randn(tokens, HEADS, DIM + ROPE)
    rope_freq = 1.0 / (6e6 ** (torch.arange(0, ROPE, 2, device=device, dtype=torch.float32) / ROPE))
    slots = torch.arange(tokens, device=device)
    latent, q_attn = randn(tokens, 1, KV_LORA + ROPE), randn(HEADS, tokens, KV_LORA + ROPE).transpose(0, 1)

    def latent_op(impl):
        return lambda: impl.mla_latent_rope(qkv_a, kv_weight, q[..., DIM:], q_attn[..., KV_LORA:], positions,
                                            rope_freq, True, EPS, slots, latent)

    return [
        OpCase("ling_norm", f"add_rms_norm {label}", lambda: kernel.add_rms_norm(x, residual, weight, EPS),
               lambda: reference.add_rms_norm(x, residual, weight, EPS), bytes=tokens * HIDDEN * 2 * 4),
        OpCase("ling_norm", f"qk_norm_rope {label}",
               lambda: kernel.qk_norm_rope(qk, q_weight, k_weight, positions, inv_freq, EPS),
               lambda: reference.qk_norm_rope(qk, q_weight, k_weight, positions, inv_freq, EPS),
               bytes=tokens * 2 * HEADS * DIM * 2 * 2),
        OpCase("ling_norm", f"gated group_rms_norm {label}",
               lambda: kernel.group_rms_norm(lightning_out, weight, GROUPS, EPS, gate),
               lambda: reference.group_rms_norm(lightning_out, weight, GROUPS, EPS, gate),
               bytes=tokens * HIDDEN * (4 + 2 + 2)),
        OpCase("ling_norm", f"add_rms_norm MoE parts {label}",
               lambda: kernel.add_rms_norm(routed, residual, weight, EPS, shared, fp32_copy=True),
               lambda: reference.add_rms_norm(routed, residual, weight, EPS, shared, fp32_copy=True),
               bytes=tokens * HIDDEN * 2 * (TOP_K + 4 + 2)),
        OpCase("ling_norm", f"mla_latent_rope {label}", latent_op(kernel), latent_op(reference),
               bytes=tokens * 2 * (2 * (KV_LORA + ROPE) + 2 * HEADS * ROPE)),
    ]


def cases(device: torch.device) -> list[OpCase]:
    return [case for tokens, label in ((1, "B=1"), (64, "B=64"), (256, "B=256"), (8192, "T=8192"))
            for case in _cases(tokens, label, device)]
