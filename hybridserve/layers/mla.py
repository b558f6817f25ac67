"""Multi-head latent attention (DeepSeek-V2/V3 style, as used by Ling-2.6's full-attention layers).

The paged KV cache holds one latent row per token: [normed c_kv (kv_lora_rank) | roped k_rope (qk_rope_head_dim)],
shared by all heads (field "latent", shape [1, kv_lora_rank + qk_rope_head_dim]) and replicated on every
tensor-parallel rank. Two equivalent ways to attend over it:
- absorbed: W_UK is folded into the query and W_UV applied after attention, so attention is multi-query attention
  of H heads over the latent cache itself (the paged attention op with one KV head; V = the first kv_lora_rank
  channels of the same rows). Per query-key pair it costs 2·kv_lora + rope = 1088 channels (flash), but it never
  expands the context;
- unabsorbed: the context's k_nope and v are rebuilt per head through kv_b_proj (a GEMM over every context token),
  then ordinary attention over nope + rope + v = 320 channels per pair.
All-decode batches use the absorbed form. Other batches: on CPU the per-sequence unabsorbed reference; on the
kernel path whichever form needs fewer FLOPs for this batch's lengths (`_form_flops`). At Ling-2.6-flash widths
that is the unabsorbed form for ordinary chunks (8192 tokens from scratch: 0.76 vs 2.41 TFLOP; 512 tokens after a
4096-token prefix: 84 vs 159 GFLOP; the bytes either form moves take ~40 us at 4.8 TB/s, far below the FLOP
time), and the absorbed form when rows are short against their context (below ~170 new tokens per row at long
contexts, e.g. mixed batches dominated by decode rows, whose contexts the unabsorbed form would have to expand).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.core.batch import ForwardBatch
from hybridserve.core.parallel import divide, tp_size
from hybridserve.core.quant import QuantScope
from hybridserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from hybridserve.layers.norm import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.ops import backends
from hybridserve.ops.attention import paged_attention
from hybridserve.ops.ling_norm import mla_latent_rope


class MultiLatentAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope_theta: float,
                 rope_interleave: bool, eps: float, quant: QuantScope = QuantScope()):
        """`quant`: the scope of the checkpoint's attention module (FP8 projections); kv_b_proj stays 16-bit, as
        the absorbed form folds its weights into the query and output."""
        super().__init__()
        self.num_heads = divide(num_heads, tp_size(), "num_attention_heads")
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        q_width = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, q_width, quant=quant.scheme("q_proj"))
            self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, kv_lora_rank + qk_rope_head_dim,
                                                       quant=quant.scheme("kv_a_proj_with_mqa"))
        else:
            # q_a_proj and kv_a_proj_with_mqa read the same input: one GEMM of both (checkpoints keep them apart,
            # loaded as shards 0 and 1).
            self.fused_qkv_a_proj = MergedColumnParallelLinear(
                hidden_size, [q_lora_rank, kv_lora_rank + qk_rope_head_dim], replicated=[True, True],
                quant=quant.scheme("q_a_proj", "kv_a_proj_with_mqa"))
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, q_width, quant=quant.scheme("q_b_proj"))
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.dense = RowParallelLinear(num_heads * v_head_dim, hidden_size,  # o_proj; Ling's checkpoint name
                                       quant=quant.scheme("dense"))
        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta, interleaved=rope_interleave)
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        self.kv: dict[str, torch.Tensor] = {}

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H, nope + rope] before RoPE, kv_a [T, kv_lora + rope] = [c_kv | k_rope] before norm and RoPE)."""
        if self.q_lora_rank is None:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        else:
            q_a, kv_a = self.fused_qkv_a_proj(x).split([self.q_lora_rank, self.kv_lora_rank + self.rope_dim], -1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        return q.view(x.shape[0], self.num_heads, self.nope_dim + self.rope_dim), kv_a

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, kv_a = self._projections(x)
        absorbed = self._absorbed(batch, x.device)
        # The absorbed form attends with [q_nope W_UK | RoPE(q_rope)] [T, H, kv_lora + rope], laid out head-major
        # so that one batched GEMM writes its first part in place; the other form rotates q's rope channels in place.
        q_attn = x.new_empty(self.num_heads, x.shape[0], self.kv_lora_rank + self.rope_dim).transpose(0, 1) \
            if absorbed else q
        mla_latent_rope(kv_a, self.kv_a_layernorm.weight, q[..., self.nope_dim:], q_attn[..., -self.rope_dim:],
                        batch.positions, self.rotary.inv_freq, self.rotary.interleaved, self.kv_a_layernorm.eps,
                        batch.slot_mapping, self.kv["latent"])
        if absorbed:
            out = self._attend_absorbed(q[..., :self.nope_dim], q_attn, batch)
        elif backends.use_triton("attention", x.device):
            out = self._attend_unabsorbed(q, batch)
        else:
            out = self._attend_unabsorbed_reference(q, batch)
        return self.dense(out.flatten(1))

    def _absorbed(self, batch: ForwardBatch, device: torch.device) -> bool:
        """The absorbed form for decode and for batches of verify rows only (speculative decoding: a few tokens per
        row over their context; CUDA-graph verify steps capture it, their host lengths being placeholders);
        otherwise the CPU reference (unabsorbed), or the cheaper form on kernels."""
        if batch.is_decode or (batch.verify is not None and len(batch.verify.rows) == batch.num_seqs):
            return True
        if not backends.use_triton("attention", device):
            return False
        absorbed, unabsorbed = self._form_flops(batch)
        return absorbed < unabsorbed

    def _form_flops(self, batch: ForwardBatch) -> tuple[int, int]:
        """(absorbed, unabsorbed) FLOPs of this batch's attention, from host lengths only."""
        tokens = sum(batch.query_lens)
        context = sum(p + n for p, n in zip(batch.prefix_lens, batch.query_lens))
        pairs = sum(n * p + n * (n + 1) // 2 for p, n in zip(batch.prefix_lens, batch.query_lens))  # causal
        heads, rank = self.num_heads, self.kv_lora_rank
        fold = 2 * heads * rank * (self.nope_dim + self.v_dim)  # W_UK into one query and W_UV out, or one kv_b row
        absorbed = tokens * fold + 2 * heads * pairs * (2 * rank + self.rope_dim)
        unabsorbed = context * fold + 2 * heads * pairs * (self.nope_dim + self.rope_dim + self.v_dim)
        return absorbed, unabsorbed

    def _kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, kv_lora] and W_UV [H, v, kv_lora]: kv_b_proj's rows per head are [k_nope | v]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim:]

    def _attend_absorbed(self, q_nope: torch.Tensor, q_attn: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q_nope . k_nope = (q_nope W_UK) . c_kv, so scores and the weighted sum use the latent cache directly.
        q_attn's rope part is already written; its latent part is written here (head-major GEMMs, no copies)."""
        w_uk, w_uv = self._kv_b_weights()
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_attn[..., :self.kv_lora_rank].transpose(0, 1))
        latent = self.kv["latent"]  # [rows, 1, kv_lora + rope]: one KV head shared by all query heads
        out = paged_attention(q_attn, latent, latent[..., : self.kv_lora_rank], batch, self.scale)  # [T, H, kv_lora]
        o = out.new_empty(out.shape[0], self.num_heads, self.v_dim)
        torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))
        return o

    def _attend_unabsorbed(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """All rows at once: their cached latent pages packed into one copy, expanded to per-head k_nope / v by one
        kv_b_proj GEMM, then causal varlen attention over that copy (no per-sequence loop)."""
        rows, packed = packed_context(batch)
        c_kv, k_rope = self.kv["latent"][rows, 0].split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(rows.shape[0], self.num_heads, -1)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # v: a strided view, read in place
        k = torch.cat([k_nope, k_rope[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        return paged_attention(q, k, v, packed, self.scale)

    def _attend_unabsorbed_reference(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The CPU path and the oracle, per sequence: k_nope and v of every position from its cached latent, then
        causal softmax attention."""
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        for seq, (start, length) in enumerate(zip(batch.query_starts, batch.query_lens)):
            prefix, kv_len = batch.prefix_lens[seq], batch.prefix_lens[seq] + length
            latent = self.kv["latent"][batch.kv_slots(seq, kv_len), 0]  # [S, kv_lora + rope]
            c_kv, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            k_nope, v = self.kv_b_proj(c_kv).view(kv_len, self.num_heads, -1).split([self.nope_dim, self.v_dim], -1)
            k = torch.cat([k_nope, k_rope[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
            q_pos = torch.arange(prefix, kv_len, device=q.device)
            visible = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q[start:start + length].transpose(0, 1), k.transpose(0, 1),
                                               v.transpose(0, 1), attn_mask=visible, scale=self.scale)
            out[start:start + length] = o.transpose(0, 1)
        return out


def packed_context(batch: ForwardBatch) -> tuple[torch.Tensor, ForwardBatch]:
    """KV rows of every row's pages packed page after page ([pages * page_size]), and the batch with its page table
    renumbered to address that packed copy. Sizes come from host lengths; indices are built on the device."""
    page_size, device = batch.page_size, batch.page_table.device
    total = sum(-(-(p + n) // page_size) for p, n in zip(batch.prefix_lens, batch.query_lens))
    counts = (batch.kv_lens + page_size - 1) // page_size
    first = torch.cumsum(counts, 0) - counts
    row_of_page = torch.repeat_interleave(torch.arange(batch.num_seqs, device=device), counts, output_size=total)
    pages = batch.page_table[row_of_page, torch.arange(total, device=device) - first[row_of_page]]
    rows = (pages[:, None] * page_size + batch.page_offsets[None, :]).flatten()
    slot = torch.arange(batch.page_table.shape[1], device=device)
    table = torch.where(slot[None, :] < counts[:, None], first[:, None] + slot[None, :], 0)
    return rows, dataclasses.replace(batch, page_table=table)
