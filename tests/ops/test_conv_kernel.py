"""CCA conv + value lag kernel vs the reference (ops/reference/conv.py), over packed varlen rows, in both of the
kernel's forms (heads: a tl.dot per head; columns: each head's output columns split over programs).

Every case runs the reference in fp32 on the same (dtype-rounded) inputs. The kernel computes in fp32 from the
raw inputs, so q/k agree to fp32 rounding (1e-5 of the output scale) in fp32 and through the interpreter; on the
GPU the heads form takes a TF32 tl.dot for the [D, D] stage-2 product of 16-bit inputs (10-bit mantissa: 3e-3 of
the output scale bounds its error over D = 16..128 terms), while the columns form stays fp32 (1e-5). Values, the
carried window, the lag and page footers are copies of input values, so they must match exactly.
"""
from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from hybridserve.core.batch import ScheduledChunk, build_forward_batch
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.ops.qk_cache import QKCache
from hybridserve.ops.reference import conv as reference
from hybridserve.ops.reference import zaya_qk
from hybridserve.ops.triton import conv as kernel
from tests.ops.conftest import DEVICE, KERNEL_DTYPES, ON_GPU

pytestmark = pytest.mark.heavy  # scheduled first: tests/conftest.py

P = 2  # cca_time0 = cca_time1 = 2
POISON = float("nan")
FORMS = ["heads", "columns"]


def _weights(q_heads: int, k_heads: int, d: int, bias: bool, gen: torch.Generator):
    c = (q_heads + k_heads) * d
    w0 = torch.randn(c, 1, 2, generator=gen)
    b0 = torch.randn(c, generator=gen) * 0.1
    w1 = torch.randn(c, d, 2, generator=gen) / d ** 0.5
    b1 = torch.randn(c, generator=gen) * 0.1
    return w0, b0, w1, b1


def _batch(rows: list[tuple[int, int, bool]], page_size: int, device: torch.device = DEVICE, verify=()):
    """rows: (prefix_len, new tokens, has_initial_state); slots 1.., pages handed out in order from 1. Rows listed
    in `verify` are verify rows (speculative decoding): their drafts' states go to slots after the rows' slots."""
    chunks, next_page, next_draft_slot = [], 1, len(rows) + 1
    for slot, (prefix, length, init) in enumerate(rows, start=1):
        pages = list(range(next_page, next_page + -(-(prefix + length) // page_size)))
        next_page += len(pages)
        drafts = list(range(next_draft_slot, next_draft_slot + length - 1)) if slot - 1 in verify else []
        next_draft_slot += len(drafts)
        chunks.append(ScheduledChunk([0] * length, prefix, pages, slot, init, [], draft_slots=drafts))
    return build_forward_batch(chunks, page_size, device, history_len=P)


def run_conv_case(rows, dtype, form, page_size=4, q_heads=4, k_heads=2, d=16, full_k_heads=None, kv_head_offset=0,
                  bias=True, footers=True, seed=0, verify=(), block_tokens=None, rotary_dim=None, positions=None):
    """Kernel (in `form`, None: chosen by the token count) vs reference on `rows` (see _batch), with every slot and
    page of the pools not used by a row (and every fresh row's slot) poisoned; returns the batch. With
    `rotary_dim`, the kernel runs with its q/k epilogue (`to_cache`: tests/ops/test_conv_qk_epilogue_kernel.py) against
    the reference conv followed by the reference q/k normalisation, RoPE and cache write; `positions` replaces the
    batch's (only without footers, which follow the positions)."""
    gen = torch.Generator().manual_seed(seed)
    slots = len(rows) + 3 + sum(rows[i][1] - 1 for i in verify)
    pages = sum(-(-(prefix + n) // page_size) for prefix, n, _ in rows) + 3
    full_k_heads = full_k_heads or k_heads
    lag_width = full_k_heads * d // 2
    c = (q_heads + k_heads) * d
    batch, cpu_batch = _batch(rows, page_size, verify=verify), _batch(rows, page_size, torch.device("cpu"), verify)
    if positions is not None:
        assert not footers, "footers follow the batch's own positions"
        batch = dataclasses.replace(batch, positions=positions.to(DEVICE))
        cpu_batch = dataclasses.replace(cpu_batch, positions=positions)
    tokens = sum(n for _, n, _ in rows)
    proj = torch.randn(tokens, c + 2 * lag_width, generator=gen).to(dtype)
    weights = [w.to(dtype) for w in _weights(q_heads, k_heads, d, bias, gen)]
    lag_bias = (torch.randn(lag_width, generator=gen) * 0.1).to(dtype) if bias else None
    conv = torch.randn(slots, c, P, generator=gen).to(dtype)
    lag = torch.randn(slots, lag_width, generator=gen).to(dtype)
    for slot, (_, _, init) in enumerate(rows, start=1):
        if not init:  # a fresh row must never read its slot
            conv[slot], lag[slot] = POISON, POISON
    conv_footer = torch.full((pages, c, P), -7.0).to(dtype) if footers else None
    lag_footer = torch.full((pages, lag_width), -7.0).to(dtype) if footers else None

    def f32(t):
        return None if t is None else t.float().clone()

    ref_state = [f32(conv), f32(lag), f32(conv_footer), f32(lag_footer)]
    ref = reference.cca_conv(proj.float(), *[w.float() for w in weights], f32(lag_bias), q_heads, kv_head_offset,
                             cpu_batch, *ref_state)
    dev = [None if t is None else t.to(DEVICE) for t in (conv, lag, conv_footer, lag_footer)]
    args = (proj.to(DEVICE), *[w.to(DEVICE) for w in weights], None if lag_bias is None else lag_bias.to(DEVICE),
            q_heads, kv_head_offset, batch, *dev)
    tol = 3e-3 if ON_GPU and dtype != torch.float32 and form != "columns" else 1e-5
    if rotary_dim is None:
        got = kernel.cca_conv(*args, form=form, block_tokens=block_tokens)
        for name, want, have in zip(("query", "key"), ref[:2], got[:2]):
            scale = want.abs().max().item()
            assert (have.float().cpu() - want).abs().max().item() <= tol * scale, name
        assert got[2].dtype == dtype and torch.equal(got[2].float().cpu(), ref[2]), "value"
    else:
        _check_to_cache(args, ref, cpu_batch.positions, form, block_tokens, rotary_dim, dtype, tol, gen)
    for name, want, have in zip(("conv", "lag", "conv footer", "lag footer"), ref_state, dev):
        if want is not None:  # untouched slots and pages keep their (poison / sentinel) contents, NaN included
            assert torch.equal(have.float().cpu().nan_to_num(123.0), want.nan_to_num(123.0)), name
    assert not kernel._arrival_counters(DEVICE).any()  # back at zero for the next call (and graph replay)
    return batch


def _check_to_cache(args, ref, positions, form, block_tokens, rotary_dim, dtype, tol, gen) -> None:
    """The kernel with its q/k epilogue vs ops/reference/zaya_qk.py on the reference conv's fp32 q, k, v: q and
    the K cache within the conv's tolerance of their scale (the normalisation divides by a row's norm, which is of
    the order of its elements' scale) plus one ulp of the dtype, V bit for bit, other cache rows untouched."""
    (query, key, value), tokens, k_heads = ref, ref[0].shape[0], ref[1].shape[1]
    cache_rows = 3 * tokens + 5
    slots = torch.randperm(cache_rows, generator=gen)[:tokens]
    temp = (torch.rand(k_heads, generator=gen) * 1.5 + 0.5).to(dtype)
    inv_freq = RotaryEmbedding(rotary_dim, 5_000_000.0).inv_freq
    caches = [torch.full((cache_rows, k_heads, query.shape[-1]), 9.0).to(dtype) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    want = zaya_qk.qk_norm_rope_cache(query, key, value.to(dtype), temp, inv_freq, positions, slots, *want_caches,
                                      dtype)  # V: values of the dtype, exactly
    got_caches = [c.to(DEVICE) for c in caches]
    got = kernel.cca_conv(*args, to_cache=QKCache(temp.to(DEVICE), inv_freq.to(DEVICE), slots.to(DEVICE),
                                                  *got_caches, dtype), form=form, block_tokens=block_tokens)
    assert got.dtype == dtype
    ulp = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    for name, have, want in (("q", got, want), ("k cache", got_caches[0], want_caches[0])):
        have, want = have.cpu().float(), want.float()
        assert ((have - want).abs() <= 2 * tol * want.abs().max() + ulp * want.abs()).all(), name
    assert torch.equal(got_caches[1].cpu(), want_caches[1]), "v cache"


# (prefix_len, new tokens, has_initial_state) rows; chunk lengths 1, P - 1, P, P + 1 and long.
FRESH = [(0, 1, False), (0, 2, False), (0, 3, False), (0, 37, False)]
RESUMED = [(5, 1, True), (3, 2, True), (4, 3, True), (7, 37, True), (1, 1, True)]
DECODE = [(3, 1, True), (15, 1, True), (0, 1, False), (8, 1, True), (31, 1, True)]
MIXED = [(0, 5, False), (6, 1, True), (2, 2, True), (0, 1, False), (11, 19, True), (3, 1, True)]


@pytest.fixture
def few_programs(monkeypatch):
    """Columns-form tiles for 8 programs instead of an H200's 128: at these narrow widths that means whole heads
    and longer token blocks, far fewer programs for the interpreter (the tiling changes no result beyond fp32
    summation order). The decode tests below keep the real constants, several programs per head."""
    monkeypatch.setattr(kernel, "PROGRAMS", 8)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows", [FRESH, RESUMED, DECODE, MIXED], ids=["fresh", "resumed", "decode", "mixed"])
def test_conv_kernel_matches_reference(rows, dtype, form, few_programs):
    run_conv_case(rows, dtype, form)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("page_size", [4, 16])
def test_footers_at_page_ends(page_size, form, few_programs):
    """Pages completed by a row's first token (window partly from the old state), mid-chunk and at its end."""
    rows = [(page_size - 1, 1, True), (page_size - 2, page_size + 3, True), (0, 2 * page_size, False),
            (2 * page_size - 1, 2, True)]
    batch = run_conv_case(rows, torch.float32, form, page_size=page_size)
    assert batch.page_end_tokens.numel() >= 4  # the case exercises several footers


@pytest.mark.parametrize("form", FORMS)
def test_tensor_parallel_rank_heads_and_no_bias(form, few_programs):
    """Rank 1 of 2: local q/k heads, the full replicated value projections, this rank's KV heads (2 of 4)."""
    run_conv_case(MIXED, torch.float32, form, q_heads=2, k_heads=2, d=8, full_k_heads=4, kv_head_offset=2,
                  bias=False)


@pytest.mark.parametrize("form", FORMS)
def test_single_kv_head_group_of_one_without_footers(form, few_programs):
    run_conv_case(MIXED, torch.float32, form, q_heads=1, k_heads=1, d=12, footers=False)


@pytest.mark.parametrize("form", FORMS)
def test_blocks_of_many_rows_split_across_programs(form):
    """More rows than one program's token block: first tokens of rows land at every block position, including the
    overlap column; in the columns form each head's output columns span two programs (arrival counters with
    overlapping token blocks)."""
    rows = [(i % 5, 1 + (i % 3), i % 4 != 0) for i in range(11)]
    run_conv_case(rows, torch.float32, form)


@pytest.mark.parametrize("block_tokens", [64, 128])
def test_heads_form_at_larger_token_blocks(block_tokens):
    """The heads form's token block forced above its default (the prefill sweep of benchmarks/ops/conv.py): rows
    that start, end and complete pages at every position of a block, one longer than a block."""
    rows = [(i % 5, 3 + 11 * (i % 4), i % 3 != 0) for i in range(9)] + [(2, block_tokens + 9, True)]
    run_conv_case(rows, torch.float32, "heads", block_tokens=block_tokens)


def test_token_block_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="block_tokens"):
        run_conv_case(FRESH, torch.float32, "heads", block_tokens=48)


def _decode_rows(count: int) -> list[tuple[int, int, bool]]:
    """`count` one-token rows: resumed ones, every other one completing a page of 4, and every fifth fresh."""
    return [(0, 1, False) if i % 5 == 2 else (3 + 2 * i, 1, True) for i in range(count)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("count", [1, 3, 16])
def test_decode_steps(count, form):
    """Decode steps at the real launch constants: the columns form splits each head over 4 programs (2 at 16 rows,
    in token blocks of 2), the last to arrive writing the window and the footers; no token blocks overlap."""
    batch = run_conv_case(_decode_rows(count), torch.float32, form)
    assert batch.page_end_tokens.numel() == {1: 1, 3: 1, 16: 6}[count]  # rows 0, 4, 6, 8, 10, 14 complete a page


@pytest.mark.parametrize("form", FORMS)
def test_decode_tensor_parallel_rank(form):
    run_conv_case(_decode_rows(5), torch.float32, form, q_heads=2, k_heads=2, d=8, full_k_heads=4,
                  kv_head_offset=2)


def test_form_chosen_by_token_count(monkeypatch):
    monkeypatch.setattr(kernel, "COLUMNS_MAX_TOKENS", 2)
    with mock.patch.object(kernel, "column_tiles", wraps=kernel.column_tiles) as tiles:
        run_conv_case(_decode_rows(2), torch.float32, None)
        assert tiles.call_count == 1
        run_conv_case([(3, 1, True), (5, 2, True)], torch.float32, None)
        assert tiles.call_count == 1
    with pytest.raises(ValueError, match="form"):
        run_conv_case(_decode_rows(1), torch.float32, "rows")


# Verify rows (speculative decoding): the last token and 1..4 drafts, beside decode rows and a prefill chunk, with
# rows starting at every offset in a page (footers of pages that drafts complete).
VERIFY = [(5, 3, True), (3, 1, True), (7, 5, True), (0, 6, False), (12, 2, True), (4, 4, True)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_verify_rows_match_reference(dtype, form, few_programs):
    run_conv_case(VERIFY, dtype, form, verify={0, 2, 4, 5})


def test_verify_rows_store_the_state_after_each_token():
    """The reference's per-token states are what a plain chunk ending at that token leaves in its slot (both the
    window and the lag), and the working slot holds the state after the row's first token."""
    gen = torch.Generator().manual_seed(3)
    q_heads, k_heads, d, page_size = 2, 1, 8, 4
    c, lag_width = (q_heads + k_heads) * d, k_heads * d // 2
    weights = _weights(q_heads, k_heads, d, True, gen)
    prefix, length = 6, 4
    proj = torch.randn(length, c + 2 * lag_width, generator=gen)
    conv0, lag0 = torch.randn(1, c, P, generator=gen), torch.randn(1, lag_width, generator=gen)

    def run(rows_proj, verify):
        conv = torch.zeros(2 + length, c, P)
        lag = torch.zeros(2 + length, lag_width)
        conv[1], lag[1] = conv0[0], lag0[0]
        batch = _batch([(prefix, rows_proj.shape[0], True)], page_size, torch.device("cpu"), verify)
        reference.cca_conv(rows_proj, *weights, None, q_heads, 0, batch, conv, lag)
        return conv, lag

    conv, lag = run(proj, verify={0})
    for j in range(length):
        want_conv, want_lag = run(proj[:j + 1], verify=())
        slot = 1 if j == 0 else 1 + j  # the working slot, then the draft slots 2, 3, ...
        assert torch.equal(conv[slot], want_conv[1]) and torch.equal(lag[slot], want_lag[1]), j
