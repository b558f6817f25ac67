"""Ling's Triton lightning kernels on CUDA at Ling-2.6-flash widths (32 heads x 128): bf16 q/k/v against the fp32
torch reference over a varlen prefill and 40 decode steps (errors printed and bounded), the dot-precision choice
measured, CUDA-graph replay of the decode kernel, its QK norm + RoPE on load against the unfused kernels, and
MLA's latent op at flash widths. Issue 8's symptom (several requests decoding together in the whole model) is
tests/gpu/test_decode_agreement_gpu.py, which runs these kernels on the product path.

    pytest -s tests/gpu/test_ling_kernels_gpu.py      # -s shows the measured errors
"""
from __future__ import annotations

import pytest
import torch

from hybridserve.core.batch import ScheduledChunk, build_forward_batch
from hybridserve.models.ling import alibi_slopes, layer_decay_factor
from hybridserve.models.ling_config import parse_ling_config
from hybridserve.ops.reference import lightning as reference
from tests.reference.ling_naive import tiny_ling_config

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
HEADS, DIM, PAGE, NUM_SLOTS = 32, 128, 16, 16
BOUND = 2e-3  # relative, outputs and states, bf16 q/k/v vs the fp32 reference on the same bf16 values


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _log_decay(layer: int) -> torch.Tensor:
    """Ling-2.6-flash's decays at one layer (L = 32, the training law): per-token decay 0.43 .. 0.996 at layer 0."""
    config = parse_ling_config(tiny_ling_config(num_attention_heads=HEADS, num_hidden_layers=32, layer_group_size=8,
                                                group_norm_size=4, head_dim=DIM, hidden_size=4096))
    return -torch.tensor(alibi_slopes(HEADS), device=CUDA) * layer_decay_factor(config, layer)


def _batch(lengths: list[int], prefixes: list[int], slots: list[int]):
    chunks = [ScheduledChunk([0] * n, p, list(range(1, 2 + (p + n) // PAGE)), s, p > 0)
              for n, p, s in zip(lengths, prefixes, slots)]
    return build_forward_batch(chunks, PAGE, CUDA)


def _qkv(tokens: int, gen: torch.Generator) -> list[torch.Tensor]:
    """bf16 q, k, v with unit-RMS heads (q and k come out of a per-head RMSNorm in the model)."""
    return [torch.randn(tokens, HEADS, DIM, device=CUDA, generator=gen).bfloat16() for _ in range(3)]


LENGTHS = [1, 63, 64, 65, 200, 1000]
SLOTS = [9, 3, 14, 1, 6, 11]
PREFIXES = [10, 0, 40, 0, 300, 0]  # rows with a prefix start from a restored state, the others from zero


def _prefill_setup(seed: int):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    pool = 0.05 * torch.randn(NUM_SLOTS + 1, HEADS, DIM, DIM, device=CUDA, generator=gen)
    for slot, prefix in zip(SLOTS, PREFIXES):
        if not prefix:
            pool[slot] = float("nan")  # a fresh row must never read its slot
    return pool, _batch(LENGTHS, PREFIXES, SLOTS), _qkv(sum(LENGTHS), gen), gen


def test_prefill_then_decode_bf16_matches_fp32_reference() -> None:
    from hybridserve.ops.triton import lightning as kernel

    assert not torch.backends.cuda.matmul.allow_tf32  # the reference must be true fp32
    log_decay = _log_decay(0)  # layer 0: the fastest decays (0.43 .. 0.996 per token)
    pool, batch, (q, k, v), gen = _prefill_setup(0)
    fast_pool, ref_pool = pool.clone(), pool.clone()
    out = kernel.lightning_attention(q, k, v, log_decay, fast_pool, batch)
    expected = reference.lightning_attention(q, k, v, log_decay, ref_pool, batch)
    out_err = max(_rel(out[s:s + n], expected[s:s + n]) for s, n in zip(batch.query_starts, LENGTHS))
    state_err = max(_rel(fast_pool[s], ref_pool[s]) for s in SLOTS)
    print(f"\nprefill ({kernel.DOT_PRECISION}): max relative error per row {out_err:.2e}, per state {state_err:.2e}")
    assert out_err <= BOUND and state_err <= BOUND
    lengths = [p + n for p, n in zip(PREFIXES, LENGTHS)]
    out_errs, state_errs = [], []
    for step in range(40):
        decode = _batch([1] * len(SLOTS), [n + step for n in lengths], SLOTS)
        q, k, v = _qkv(len(SLOTS), gen)
        out = kernel.lightning_attention(q, k, v, log_decay, fast_pool, decode)
        expected = reference.lightning_attention(q, k, v, log_decay, ref_pool, decode)
        out_errs.append(max(_rel(out[r], expected[r]) for r in range(len(SLOTS))))
        state_errs.append(max(_rel(fast_pool[s], ref_pool[s]) for s in SLOTS))
    print(f"decode, 40 steps: max relative error per row {max(out_errs):.2e}, per state {max(state_errs):.2e}")
    assert max(out_errs) <= BOUND and max(state_errs) <= BOUND
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in SLOTS]
    assert torch.equal(fast_pool[untouched], pool[untouched])


def test_dot_precision_choices() -> None:
    """Measures every input precision of the prefill dots (bf16 q/k/v; the fp32 operands are the decay-weighted
    scores, the state and the decayed keys); the default must meet the bound, the others are printed."""
    from hybridserve.ops.triton import lightning as kernel

    log_decay = _log_decay(30)  # slow decays: the state carries the most history
    pool, batch, (q, k, v), _ = _prefill_setup(1)
    ref_pool = pool.clone()
    expected = reference.lightning_prefill(q, k, v, log_decay, ref_pool, batch)
    errors = {}
    for precision in kernel.PRECISIONS:
        fast_pool = pool.clone()
        out = kernel.lightning_prefill(q, k, v, log_decay, fast_pool, batch, precision=precision)
        errors[precision] = (_rel(out, expected), max(_rel(fast_pool[s], ref_pool[s]) for s in SLOTS))
        print(f"\n{precision:>7}: output {errors[precision][0]:.2e}, state {errors[precision][1]:.2e}", end="")
    print()
    assert max(errors[kernel.DOT_PRECISION]) <= BOUND


def test_decode_replays_in_a_cuda_graph() -> None:
    """Fixed shapes, no allocation that depends on device data: the decode step captures and replays, with the
    same outputs and states as eager calls."""
    from hybridserve.ops.triton import lightning as kernel

    log_decay = _log_decay(0)
    gen = torch.Generator(device=CUDA).manual_seed(2)
    pool = 0.05 * torch.randn(NUM_SLOTS + 1, HEADS, DIM, DIM, device=CUDA, generator=gen)
    batch = _batch([1] * 4, [5, 9, 2, 30], [4, 12, 7, 2])
    q, k, v = _qkv(4, gen)
    eager_pool = pool.clone()
    eager = [kernel.lightning_attention(q, k, v, log_decay, eager_pool, batch) for _ in range(3)]
    graph_pool = pool.clone()
    kernel.lightning_attention(q, k, v, log_decay, graph_pool.clone(), batch)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.lightning_attention(q, k, v, log_decay, graph_pool, batch)
    graph_pool.copy_(pool)
    for step in range(3):
        graph.replay()
        assert torch.equal(out, eager[step])
    assert torch.equal(graph_pool, eager_pool)


def test_decode_with_qk_norm_and_rope_on_load_matches_the_unfused_kernels() -> None:
    """The product decode path (raw q/k normed and rotated inside the decode kernel) against the two kernels it
    replaces (ops.ling_norm's qk_norm_rope, then the decode kernel), at flash widths: d 128 with 64 channels
    rotated, theta 6e6, positions up to 8000. Both round q/k to bf16 at the same point; only the last fp32 bit of
    the norm's sum order can flip an element by one bf16 unit, so the bound is BOUND."""
    from hybridserve.ops.triton import lightning as kernel
    from hybridserve.ops.triton import ling_norm

    log_decay = _log_decay(0)
    gen = torch.Generator(device=CUDA).manual_seed(3)
    pool = 0.05 * torch.randn(NUM_SLOTS + 1, HEADS, DIM, DIM, device=CUDA, generator=gen)
    batch = _batch([1] * 4, [5, 900, 4000, 8000], [4, 12, 7, 2])
    qkv = (3 * torch.randn(4, 3, HEADS, DIM, device=CUDA, generator=gen)).bfloat16()
    weights = [(1 + 0.1 * torch.randn(DIM, device=CUDA, generator=gen)).bfloat16() for _ in range(2)]
    inv_freq = 1.0 / (6e6 ** (torch.arange(0, 64, 2, device=CUDA, dtype=torch.float32) / 64))
    norm_rope = reference.QKNormRope(*weights, batch.positions, inv_freq, 1e-6)
    fused_pool, unfused_pool = pool.clone(), pool.clone()
    out = kernel.lightning_decode(qkv[:, 0], qkv[:, 1], qkv[:, 2], log_decay, fused_pool, batch, norm_rope=norm_rope)
    q, k = ling_norm.qk_norm_rope(qkv[:, :2], *weights, batch.positions, inv_freq, 1e-6).unbind(1)
    expected = kernel.lightning_decode(q, k, qkv[:, 2], log_decay, unfused_pool, batch)
    out_err, state_err = _rel(out, expected), max(_rel(fused_pool[s], unfused_pool[s]) for s in (4, 12, 7, 2))
    print(f"\nfused QK norm + RoPE decode vs unfused kernels: output {out_err:.2e}, state {state_err:.2e}")
    assert out_err <= BOUND and state_err <= BOUND


def test_mla_latent_rope_at_flash_widths() -> None:
    """MLA's latent op at flash widths (kv_lora 512, rope 64 interleaved, 32 heads, theta 6e6) on bf16: the cache
    rows and the query's rope channels against the torch reference on the same values, to one bf16 unit of the
    largest value (the same roundings; cos/sin and the norm's sum order may differ in the last fp32 bit)."""
    from hybridserve.ops.reference import ling_norm as norm_reference
    from hybridserve.ops.triton import ling_norm

    gen = torch.Generator(device=CUDA).manual_seed(4)
    tokens, rank, rope, nope = 6, 512, 64, 128
    fused = torch.randn(tokens, 1536 + rank + rope, device=CUDA, generator=gen).bfloat16()  # [q_a | kv_a]
    weight = (1 + 0.1 * torch.randn(rank, device=CUDA, generator=gen)).bfloat16()
    q = torch.randn(tokens, HEADS, nope + rope, device=CUDA, generator=gen).bfloat16()
    positions = torch.tensor([0, 1, 63, 1000, 4097, 8000], device=CUDA)
    inv_freq = 1.0 / (6e6 ** (torch.arange(0, rope, 2, device=CUDA, dtype=torch.float32) / rope))
    slots = torch.tensor([3, 40, 7, 0, 21, 9], device=CUDA)
    results = []
    for impl in (ling_norm, norm_reference):
        cache = torch.zeros(48, 1, rank + rope, device=CUDA, dtype=torch.bfloat16)
        q_attn = torch.zeros(HEADS, tokens, rank + rope, device=CUDA, dtype=torch.bfloat16).transpose(0, 1)
        impl.mla_latent_rope(fused[:, 1536:], weight, q[..., nope:], q_attn[..., rank:], positions, inv_freq, True,
                             1e-6, slots, cache)
        results.append((cache, q_attn))
    for got, want in zip(*results):
        err = (got.float() - want.float()).abs().max().item()
        assert err <= torch.finfo(torch.bfloat16).eps * want.float().abs().max().item(), err
