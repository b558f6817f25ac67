"""Triton lightning kernels (ops/triton/lightning.py) against the torch reference (ops/reference/lightning.py, itself
tested against the token-by-token recurrence in tests/unit/test_lightning_ops.py): outputs and the state of every
slot, with restored, fresh (NaN-poisoned) and untouched slots. Through the interpreter on CPU (fp32, fp16), on the
GPU with bf16 too.

Tolerance 2e-5 relative for every input dtype through the interpreter: the reference upcasts the same q/k/v, so
both sides do fp32 math and only summation order differs. On the GPU the fp32-operand dots run as tf32x3 (three tf32
products), fp32-level but not bit-for-bit: 2.6e-5 was measured on the H200, so the bound there is 5e-5.
"""
from __future__ import annotations

import pytest
import torch

from hybridserve.core.batch import ScheduledChunk, build_forward_batch
from hybridserve.ops.reference import lightning as reference
from hybridserve.ops.triton import lightning as kernel
from tests.ops.conftest import DEVICE, KERNEL_DTYPES, ON_GPU

PAGE = 16
HEADS, DK, DV = 2, 16, 24  # d_v != d_k and not a power of two: masked v-blocks
BLOCK_V = 16  # two v-blocks, the second half masked
# A head as fast as Ling-2.6-flash's fastest (a^-63 overflows fp32: padded chunk positions must be masked, not
# weighted; fla-core's chunk kernel weighted them, issue 8) and an almost flat one.
LOG_DECAY = torch.tensor([-1.7, -1e-3], device=DEVICE)
NUM_SLOTS = 10
TOL = 5e-5 if ON_GPU else 2e-5


def _batch(lengths: list[int], slots: list[int], restored: list[bool]):
    chunks = [ScheduledChunk([0] * n, 3 if r else 0, list(range(1, 2 + (3 + n) // PAGE)), s, r)
              for n, s, r in zip(lengths, slots, restored)]
    return build_forward_batch(chunks, PAGE, DEVICE)


def _qkv(tokens: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(tokens, HEADS, d, device=DEVICE, generator=gen).to(dtype) for d in (DK, DK, DV)]


def _pool(slots: list[int], restored: list[bool], gen: torch.Generator) -> torch.Tensor:
    pool = torch.randn(NUM_SLOTS + 1, HEADS, DK, DV, device=DEVICE, generator=gen)
    for slot, keep in zip(slots, restored):
        if not keep:
            pool[slot] = float("nan")  # a fresh row must never read its slot
    return pool


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _check_pools(got: torch.Tensor, expected: torch.Tensor, before: torch.Tensor, slots: list[int],
                 tol: float = TOL) -> None:
    for slot in slots:
        assert _rel(got[slot], expected[slot]) <= tol, slot
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in slots]
    assert torch.equal(got[untouched], before[untouched])


def _check_rows(got: torch.Tensor, expected: torch.Tensor, starts: list[int], lengths: list[int],
                tol: float = TOL) -> None:
    for start, n in zip(starts, lengths):
        assert _rel(got[start:start + n], expected[start:start + n]) <= tol, (start, n)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_varlen_prefill_with_restored_and_fresh_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    lengths, slots = [1, 63, 64, 65, 150, 200], [8, 3, 10, 1, 6, 4]  # chunk edges; slots out of row order
    restored = [True, False, True, False, True, False]
    batch = _batch(lengths, slots, restored)
    q, k, v = _qkv(sum(lengths), dtype, gen)
    before = _pool(slots, restored, gen)
    got_pool, ref_pool = before.clone(), before.clone()
    out = kernel.lightning_prefill(q, k, v, LOG_DECAY, got_pool, batch, block_v=BLOCK_V)
    expected = reference.lightning_prefill(q, k, v, LOG_DECAY, ref_pool, batch)
    _check_rows(out, expected, batch.query_starts, lengths)
    _check_pools(got_pool, ref_pool, before, slots)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_consecutive_decode_steps(dtype: torch.dtype) -> None:
    """Four rows on slots 7, 2, 9, 4 (row 1 fresh on the first step), four steps; every slot checked each step."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    slots = [7, 2, 9, 4]
    before = _pool(slots, [True, False, True, True], gen)
    got_pool, ref_pool = before.clone(), before.clone()
    for step in range(4):
        batch = _batch([1] * 4, slots, [True, step > 0, True, True])
        assert batch.is_decode
        q, k, v = _qkv(4, dtype, gen)
        out = kernel.lightning_decode(q, k, v, LOG_DECAY, got_pool, batch, block_v=BLOCK_V)
        expected = reference.lightning_decode(q, k, v, LOG_DECAY, ref_pool, batch)
        _check_rows(out, expected, list(range(4)), [1] * 4)
        _check_pools(got_pool, ref_pool, before, slots)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_mixed_batch_of_decode_rows_and_prefill_chunks(dtype: torch.dtype) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    lengths, slots, restored = [1, 70, 1, 5], [5, 2, 9, 1], [True, False, True, True]
    batch = _batch(lengths, slots, restored)
    assert not batch.is_decode
    q, k, v = _qkv(sum(lengths), dtype, gen)
    before = _pool(slots, restored, gen)
    got_pool, ref_pool = before.clone(), before.clone()
    out = kernel.lightning_attention(q, k, v, LOG_DECAY, got_pool, batch)
    expected = reference.lightning_attention(q, k, v, LOG_DECAY, ref_pool, batch)
    _check_rows(out, expected, batch.query_starts, lengths)
    _check_pools(got_pool, ref_pool, before, slots)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(("half", "norm"), [(4, True), (8, True), (4, False)])
def test_decode_with_qk_norm_and_rope_on_load(dtype: torch.dtype, half: int, norm: bool) -> None:
    """Raw q, k (views of one [T, 4, H, d] projection output, as the model passes them) normed and rotated by the
    decode kernel itself == ops.ling_norm.qk_norm_rope's contract then the recurrence: partial (8 of 16 channels)
    and full RoPE, with and without the norm weights; a fresh row among restored ones. The fused q/k are rounded
    to the input dtype as qk_norm_rope's output is. The bound is the recurrence's, except for 16-bit inputs on the
    GPU: there the kernel's and torch's cos/sin and the norm's sum order may differ in the last fp32 bit, which can
    flip an element of q or k by one unit in the last place of its dtype, so the bound is that dtype's eps."""
    gen = torch.Generator(device=DEVICE).manual_seed(half)
    slots, restored = [3, 8, 5], [True, False, True]
    batch = _batch([1, 1, 1], slots, restored)
    fused = (3 * torch.randn(3, 4, HEADS, DK, device=DEVICE, generator=gen)).to(dtype)
    v = torch.randn(3, HEADS, DV, device=DEVICE, generator=gen).to(dtype)
    weights = [(1 + 0.2 * torch.randn(DK, device=DEVICE, generator=gen)).to(dtype) for _ in range(2)]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 2 * half, 2, device=DEVICE, dtype=torch.float32) / (2 * half)))
    positions = torch.tensor([5, 900, 3000], device=DEVICE)
    norm_rope = reference.QKNormRope(*(weights if norm else (None, None)), positions, inv_freq, 1e-6)
    before = _pool(slots, restored, gen)
    got_pool, ref_pool = before.clone(), before.clone()
    out = kernel.lightning_decode(fused[:, 0], fused[:, 1], v, LOG_DECAY, got_pool, batch, block_v=BLOCK_V,
                                  norm_rope=norm_rope)
    expected = reference.lightning_attention(fused[:, 0], fused[:, 1], v, LOG_DECAY, ref_pool, batch, norm_rope)
    tol = torch.finfo(dtype).eps if ON_GPU and dtype != torch.float32 else TOL
    _check_rows(out, expected, list(range(3)), [1] * 3, tol)
    _check_pools(got_pool, ref_pool, before, slots, tol)


def test_strided_inputs_from_a_fused_projection() -> None:
    """q, k, v as views of one [T, 3, H, d] projection output (the model's layout), decode and prefill."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for lengths in ([1, 1, 1], [9, 1, 40]):
        slots, restored = [4, 6, 2], [True, True, False]
        batch = _batch(lengths, slots, restored)
        fused = torch.randn(sum(lengths), 3, HEADS, DK, device=DEVICE, generator=gen)
        q, k, v = fused.unbind(1)
        before = _pool(slots, restored, gen)[..., :DK].contiguous()
        got_pool, ref_pool = before.clone(), before.clone()
        out = kernel.lightning_attention(q, k, v, LOG_DECAY, got_pool, batch)
        expected = reference.lightning_attention(q, k, v, LOG_DECAY, ref_pool, batch)
        assert _rel(out, expected) <= TOL
        for slot in slots:
            assert _rel(got_pool[slot], ref_pool[slot]) <= TOL


@pytest.mark.parametrize("lengths", [[1, 1, 1], [3, 1, 20]], ids=["decode", "prefill"])
def test_negative_slots_are_neither_read_nor_written(lengths: list[int]) -> None:
    """CUDA-graph padding rows carry slot -1: the pool stays as it was, the other rows are unaffected."""
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    q, k, v = _qkv(sum(lengths), torch.float32, gen)
    before = _pool([], [], gen)
    got_pool, ref_pool = before.clone(), before.clone()
    out = kernel.lightning_attention(q, k, v, LOG_DECAY, got_pool, _batch(lengths, [3, -1, 5], [True] * 3))
    keep = torch.cat([torch.arange(lengths[0]), torch.arange(lengths[0] + lengths[1], sum(lengths))]).to(DEVICE)
    live_batch = _batch([lengths[0], lengths[2]], [3, 5], [True] * 2)
    expected = reference.lightning_attention(q[keep], k[keep], v[keep], LOG_DECAY, ref_pool, live_batch)
    assert _rel(out[keep], expected) <= TOL
    _check_pools(got_pool, ref_pool, before, [3, 5])
    assert bool(torch.isfinite(out).all())


def test_bad_layouts_are_refused() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    q, k, v = _qkv(2, torch.float32, gen)
    batch = _batch([1, 1], [1, 2], [True, True])
    pool = torch.zeros(NUM_SLOTS + 1, HEADS, DK, DV, device=DEVICE)
    with pytest.raises(ValueError, match="fp32"):
        kernel.lightning_attention(q, k, v, LOG_DECAY, pool.half(), batch)
    with pytest.raises(ValueError, match="unit stride"):
        kernel.lightning_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, LOG_DECAY, pool, batch)
    with pytest.raises(ValueError, match="precision"):
        kernel.lightning_prefill(q, k, v, LOG_DECAY, pool, batch, precision="bf16")
