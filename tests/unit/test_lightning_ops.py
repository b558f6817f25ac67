"""Lightning attention ops (torch reference) against the naive token-by-token recurrence of tests/reference, and
GroupRMSNorm against the reference's per-group formula."""
from __future__ import annotations

import pytest
import torch

from hybridserve.core.batch import build_forward_batch
from hybridserve.core.chunk import ScheduledChunk
from hybridserve.layers.norm import GroupRMSNorm
from hybridserve.ops.reference import lightning as reference
from hybridserve.ops.reference.lightning import lightning_decode, lightning_prefill
from tests.reference.ling_naive import group_rms_norm, lightning_recurrence

PAGE = 16
CPU_DEVICE = torch.device("cpu")
HEADS, DK, DV = 3, 8, 6  # d_v != d_k on purpose
# A fast head (a^64 ~ 1e-25), a middling one and an almost non-decaying one.
LOG_DECAY = torch.tensor([-0.9, -0.05, -1e-3])
NUM_SLOTS = 8


def _batch(lengths: list[int], prefixes: list[int], slots: list[int], restored: list[bool]):
    chunks = [ScheduledChunk(token_ids=[0] * n, prefix_len=p, page_ids=list(range(1, 2 + (p + n) // PAGE)),
                             state_slot=s, has_initial_state=r)
              for n, p, s, r in zip(lengths, prefixes, slots, restored)]
    return build_forward_batch(chunks, PAGE, torch.device("cpu"))


def _inputs(total: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(total, HEADS, DK, generator=gen), torch.randn(total, HEADS, DK, generator=gen),
            torch.randn(total, HEADS, DV, generator=gen))


def _pool(seed: int) -> torch.Tensor:
    """Random states in every slot; the fresh rows' slots are poisoned with NaN by the tests."""
    return torch.randn(NUM_SLOTS + 1, HEADS, DK, DV, generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk_size", [64, 7])
def test_prefill_matches_recurrence_with_restored_and_fresh_rows(chunk_size: int) -> None:
    lengths, slots = [1, 63, 64, 65, 150], [3, 1, 5, 2, 7]
    restored = [True, False, True, False, True]
    q, k, v = _inputs(sum(lengths), seed=0)
    pool = _pool(seed=1)
    for slot, keep in zip(slots, restored):
        if not keep:
            pool[slot] = float("nan")  # stale contents must never leak into a fresh row
    before = pool.clone()
    out = lightning_prefill(q, k, v, LOG_DECAY, pool, _batch(lengths, [5] * 5, slots, restored),
                            chunk_size=chunk_size)
    start = 0
    for n, slot, keep in zip(lengths, slots, restored):
        initial = before[slot] if keep else torch.zeros(HEADS, DK, DV)
        ref_out, ref_state = lightning_recurrence(q[start:start + n], k[start:start + n], v[start:start + n],
                                                  LOG_DECAY.double(), initial)
        assert _rel(out[start:start + n], ref_out) <= 1e-5
        assert _rel(pool[slot], ref_state) <= 1e-5
        start += n
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])


def test_decode_matches_recurrence() -> None:
    slots, restored = [4, 2, 6, 1], [True, False, True, True]
    q, k, v = _inputs(len(slots), seed=2)
    pool = _pool(seed=3)
    pool[2] = float("nan")
    before = pool.clone()
    out = lightning_decode(q, k, v, LOG_DECAY, pool, _batch([1] * 4, [9, 0, 30, 2], slots, restored))
    for row, (slot, keep) in enumerate(zip(slots, restored)):
        initial = before[slot] if keep else torch.zeros(HEADS, DK, DV)
        ref_out, ref_state = lightning_recurrence(q[row:row + 1], k[row:row + 1], v[row:row + 1],
                                                  LOG_DECAY.double(), initial)
        assert _rel(out[row], ref_out[0]) <= 1e-6
        assert _rel(pool[slot], ref_state) <= 1e-6
    assert torch.equal(pool[[0, 3, 5, 7, 8]], before[[0, 3, 5, 7, 8]])


def test_prefill_in_pieces_equals_one_shot() -> None:
    pieces = [1, 3, 17, 129]
    q, k, v = _inputs(sum(pieces), seed=4)
    one_shot = torch.zeros(NUM_SLOTS + 1, HEADS, DK, DV)
    expected = lightning_prefill(q, k, v, LOG_DECAY, one_shot, _batch([sum(pieces)], [0], [1], [False]))
    pool = torch.full((NUM_SLOTS + 1, HEADS, DK, DV), float("nan"))
    start = 0
    for n in pieces:
        out = lightning_prefill(q[start:start + n], k[start:start + n], v[start:start + n], LOG_DECAY, pool,
                                _batch([n], [start], [1], [start > 0]))
        assert _rel(out, expected[start:start + n]) <= 1e-6
        start += n
    assert _rel(pool[1], one_shot[1]) <= 1e-6


def test_group_rms_norm_matches_per_group_formula() -> None:
    gen = torch.Generator().manual_seed(5)
    norm = GroupRMSNorm(24, num_groups=3, eps=1e-6)
    norm.weight.data.copy_(1.0 + 0.1 * torch.randn(24, generator=gen))
    x = torch.randn(5, 24, generator=gen)
    x[:, :8] *= 10.0  # groups of very different scale, so a whole-row norm would differ
    expected = group_rms_norm(x, norm.weight.data, 3, 1e-6)
    assert (norm(x) - expected).abs().max().item() <= 1e-6


def test_verify_rows_keep_the_state_after_each_token() -> None:
    """A verify row (speculative decoding) writes, for each token j, the state a plain chunk ending at j leaves
    (the first token's into the row's slot, the drafts' into their own slots), with the plain chunk's outputs."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(5, 2, 8, generator=gen) for _ in range(3))
    log_decay = torch.tensor([-0.9, -0.05])
    initial = torch.randn(2, 8, 8, generator=gen)

    def run(n: int, drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pool = torch.zeros(10, 2, 8, 8)
        pool[1] = initial
        chunk = ScheduledChunk([0] * n, 4, [1, 2, 3], 1, True, draft_slots=drafts)
        out = reference.lightning_attention(q[:n], k[:n], v[:n], log_decay, pool, build_forward_batch([chunk], 4,
                                                                                                        CPU_DEVICE))
        return out, pool

    out, pool = run(5, [6, 7, 8, 9])
    for j in range(5):
        plain_out, plain_pool = run(j + 1, [])
        assert torch.allclose(out[:j + 1], plain_out, rtol=1e-5, atol=1e-6)
        assert torch.allclose(pool[1 if j == 0 else 5 + j], plain_pool[1], rtol=1e-5, atol=1e-6), j
