"""Triton paged attention (ops/triton/attention.py) against the torch reference (ops/reference/attention.py), on
caches whose unreadable rows are NaN (tests/ops/attention_cases.py).

Tolerances (kernel vs the fp32 reference on the same rounded inputs): fp32 2e-5 absolute + relative (only the
summation order differs); fp16 2e-3 (probabilities are rounded to fp16 before P·V, 2^-11 relative, and so is the
output); bf16 1e-2 (the same roundings at 2^-8). Outputs are weighted means of N(0, 1) values, |o| < ~3.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math

import pytest
import torch

from hybridserve.layers.mla import MultiLatentAttention
from hybridserve.ops import backends
from hybridserve.ops.triton import attention as kernel  # conftest already set TRITON_INTERPRET where needed
from tests.ops import attention_cases
from tests.ops.attention_cases import Case, reference_output
from tests.ops.conftest import DEVICE, KERNEL_DTYPES

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# MLA: also q W_UK and the latent-width output are rounded to the dtype before the last einsum (7e-4 seen in fp16).
MLA_TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
GQA = [(8, 2), (4, 1)]  # ZAYA1's 8 q / 2 kv heads, and one KV head for a group of 4
make_case = functools.partial(attention_cases.make_case, device=DEVICE)


def check(case: Case, num_splits: int | None = None, group_split: int | None = None) -> None:
    got = kernel.paged_attention(case.q, case.k, case.v, case.batch, case.q.shape[-1] ** -0.5, case.window,
                                 num_splits, group_split)
    want = reference_output(case)
    assert got.dtype == case.q.dtype and got.shape == want.shape
    tol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def edge_lengths(page_size: int) -> list[int]:
    return [1, page_size - 1, page_size, page_size + 1, 2 * page_size + 3, 70]  # 70 > BLOCK_N: several tiles


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("page_size", [4, 16])
def test_decode(page_size: int, heads: tuple[int, int], dtype: torch.dtype) -> None:
    case = make_case([(n - 1, 1) for n in edge_lengths(page_size)], page_size, heads, 32, 32, dtype)
    assert case.batch.is_decode
    check(case)
    check(case, num_splits=4)  # the 70-key row fills 2 splits; the rest are empty and must contribute nothing


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("page_size", [4, 16])
def test_prefill_with_prefix_hits_chunk_resumes_and_decode_rows(page_size: int, heads: tuple[int, int],
                                                                dtype: torch.dtype) -> None:
    rows = [(0, n) for n in edge_lengths(page_size)[1:4]]  # fresh prompts of page - 1, page, page + 1 tokens
    rows += [(page_size, 5),  # a prefix-cache hit of one page
             (2 * page_size + 3, page_size + 2),  # a chunk resumed mid-page
             (9, 1), (0, 1)]  # decode rows (and a 1-token prompt) inside a prefill batch
    case = make_case(rows, page_size, heads, 32, 32, dtype, seed=1)
    assert not case.batch.is_decode
    check(case)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_many_sequences_of_mixed_lengths(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    rows = [(int(p), int(n)) for p, n in zip(torch.randint(0, 40, (12,), generator=gen),
                                             torch.randint(1, 20, (12,), generator=gen))]
    check(make_case(rows, 4, (8, 2), 32, 32, dtype, seed=3))
    decode = make_case([(p, 1) for p, _ in rows], 16, (8, 2), 32, 32, dtype, seed=4)
    check(decode)
    check(decode, num_splits=3)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("window,page_size", [(6, 4), (17, 16)])
def test_sliding_window_reads_only_the_window(window: int, page_size: int, dtype: torch.dtype) -> None:
    """Rows shorter than, equal to and longer than the window; pages before it are unmapped and poisoned."""
    lengths = [1, window - 1, window, window + 1, window + page_size + 3, 3 * window + 2]
    decode = make_case([(n - 1, 1) for n in lengths], page_size, (8, 2), 32, 32, dtype, window=window, seed=5)
    check(decode)
    check(decode, num_splits=3)
    prefill = make_case([(n - 1, 1) for n in lengths[:3]] + [(0, 2 * window + 1), (window + page_size + 3, 9),
                                                             (3 * window, window + 2)],
                        page_size, (8, 2), 32, 32, dtype, window=window, seed=6)
    check(prefill)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("page_size", [4, 16])
def test_mla_dims_with_v_a_strided_view_of_k(page_size: int, dtype: torch.dtype) -> None:
    """A small analogue of MLA's absorbed form: one KV head, Dk = 64 + 8, V = the first 64 channels of each row."""
    lengths = edge_lengths(page_size)
    decode = make_case([(n - 1, 1) for n in lengths], page_size, (8, 1), 72, 64, dtype, v_in_k=True, seed=7)
    assert decode.v.data_ptr() == decode.k.data_ptr() and not decode.v.is_contiguous()
    check(decode)
    check(decode, num_splits=5)
    check(make_case([(0, 9), (page_size, page_size + 1), (30, 1)], page_size, (8, 1), 72, 64, dtype, v_in_k=True,
                    seed=8))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_query_group_cut_over_programs(dtype: torch.dtype) -> None:
    """A KV head's query heads cut over 2, 4 or 8 programs that each read its keys (MLA's 32 heads over one latent
    at batch 1: 4 programs of 8), with key splits beside; a wide latent (V 256: MLA's tiles) whose splits take two
    32-key tiles at least, so a count fixed for long rows leaves a short row fewer, longer splits."""
    lengths = [1, 33, 70, 130]
    narrow = make_case([(n - 1, 1) for n in lengths], 4, (16, 1), 40, 32, dtype, v_in_k=True, seed=20)
    for cut in (1, 2, 4, 8):
        check(narrow, num_splits=5, group_split=cut)
    check(narrow)  # the heuristic's cut: 2 programs of 8 heads
    check(make_case([(n - 1, 1) for n in lengths], 16, (8, 2), 32, 32, dtype, seed=21), num_splits=3, group_split=2)
    wide = make_case([(n - 1, 1) for n in lengths], 16, (16, 1), 272, 256, dtype, v_in_k=True, seed=22)
    assert kernel.launch_config(True, 8, 256, 256).min_split_keys == 64
    for splits in (1, 16):  # 16 splits of a 130-key row: 3 of 64 keys (two tiles), not 5 of one
        check(wide, num_splits=splits)


def test_group_split_heuristic() -> None:
    assert kernel.choose_group_split(True, 32, 1, 132) == 4  # MLA at batch 1: 4 programs of 8 heads
    assert kernel.choose_group_split(True, 32, 16, 132) == 4  # ... up to 16 rows (an eighth of the SMs)
    assert kernel.choose_group_split(True, 32, 17, 132) == 1  # more rows: key splits alone (64: the cut is slower)
    assert kernel.choose_group_split(False, 32, 1, 132) == 1  # prefill: query blocks give the programs
    assert kernel.choose_group_split(True, 4, 2, 132) == 1  # ZAYA1's 4 heads a KV head: one program
    assert kernel.choose_group_split(True, 24, 1, 132) == 4  # 6 heads a program: a power of two dividing 24
    assert kernel.launch_config(True, 4, 128, 128).min_split_keys == 64  # ZAYA1's tiles: one 64-key tile, as before


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_head_dims_beyond_one_power_of_two(dtype: torch.dtype) -> None:
    """ZAYA1's D = 128; D = 48 (32 + 16) with Dv = 24 (padded, masked); MHA (group 1) as MLA's unabsorbed form."""
    rows = [(0, 7), (5, 1), (20, 6)]
    check(make_case(rows, 16, (8, 2), 128, 128, dtype, seed=9))
    check(make_case(rows, 4, (2, 2), 48, 24, dtype, seed=10))
    check(make_case([(p + n - 1, 1) for p, n in rows], 4, (3, 3), 48, 24, dtype, seed=11), num_splits=2)


def test_fixed_split_counts_larger_than_needed() -> None:
    """A count fixed for the longest context (CUDA graphs): most splits of short rows are empty, also in a mixed
    batch, where splits cut each query block's keys."""
    decode = make_case([(0, 1), (2, 1), (5, 1)], 4, (8, 2), 32, 32, torch.float32, seed=12)
    check(decode, num_splits=16)
    check(make_case([(0, 5), (3, 1), (40, 30)], 4, (8, 2), 32, 32, torch.float32, seed=13), num_splits=3)
    # A prefill row's splits take MIN_KEYS_PER_SPLIT keys at least: 9 splits (a lone 512-token prompt's prefill
    # graph) of a 300-token row leave 3 of 128 keys, not 5 of one 64-key tile.
    assert kernel.launch_config(False, 4, 32, 32).min_split_keys == kernel.MIN_KEYS_PER_SPLIT == 128
    check(make_case([(0, 300), (20, 3)], 16, (8, 2), 32, 32, torch.float32, seed=17), num_splits=9)


def test_split_merge_in_chunks_of_splits() -> None:
    """The merge loads its splits in chunks (`merge_chunk`: 16 for ZAYA1's 4 query heads of 128 channels): 40
    splits of 64 keys (three chunks, the last partial) and 10 (one partial chunk, batch 1's few hundred keys); a
    prefill block of 128 rows x 128 channels holds one split a chunk (the unrolled loop)."""
    assert kernel.merge_chunk(4, 128) == 16 and kernel.merge_chunk(128, 32) == 2 and kernel.merge_chunk(128, 128) == 1
    check(make_case([(2499, 1), (639, 1), (30, 1)], 16, (8, 2), 128, 128, torch.float32, seed=14), num_splits=40)
    check(make_case([(639, 1)], 16, (8, 2), 128, 128, torch.float32, seed=15), num_splits=64)
    check(make_case([(0, 5), (3, 1), (40, 30)], 4, (8, 2), 128, 128, torch.float32, seed=16), num_splits=3)


def test_padding_rows_without_keys_give_zeros() -> None:
    """CUDA-graph padding: a decode row with kv_len 0 reads nothing and outputs zeros, split or not."""
    case = make_case([(4, 1), (0, 1)], 4, (8, 2), 32, 32, torch.float32, seed=14)
    case.batch.kv_lens[1] = 0
    case.k[case.batch.page_table[1, 0] * 4:][:4] = float("nan")
    for splits in (None, 3):
        out = kernel.paged_attention(case.q, case.k, case.v, case.batch, 32 ** -0.5, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[:1], reference_output(case)[:1], atol=2e-5, rtol=2e-5)


def test_split_merge_in_the_last_program_leaves_counters_at_zero() -> None:
    """The split programs' pairs are merged by the last of each group to arrive: a second call (a CUDA-graph
    replay) merges again, to the same bits, and every counter is back at zero after each call."""
    from hybridserve.ops.triton.counters import arrival_counters

    case = make_case([(90, 1), (5, 1), (200, 1)], 4, (8, 2), 32, 32, torch.float32, seed=15)
    first = kernel.paged_attention(case.q, case.k, case.v, case.batch, 32 ** -0.5, num_splits=6)
    assert not arrival_counters("attention_splits", kernel.COUNTERS, case.q.device).any()
    assert torch.equal(first, kernel.paged_attention(case.q, case.k, case.v, case.batch, 32 ** -0.5, num_splits=6))
    assert not arrival_counters("attention_splits", kernel.COUNTERS, case.q.device).any()
    torch.testing.assert_close(first, reference_output(case), atol=2e-5, rtol=2e-5)


def test_split_heuristic_follows_the_host_lengths() -> None:
    def splits(batch_size: int, kv_len: int, query_len: int = 1) -> int:
        batch = dataclasses.replace(make_case([(0, 1)], 4, (2, 1), 16, 16, torch.float32).batch,
                                    query_lens=[query_len] * batch_size, max_kv_len=kv_len)
        return kernel.choose_splits(batch, 2, 1 if query_len == 1 else 32, 132)

    assert splits(1, 4096) == 32  # 2 programs: ~2 waves would want 132, capped at 128 keys per split
    assert splits(1, 100) == 1  # too few keys to split
    assert splits(64, 4096) == 3  # 128 programs: 3 splits give ~2 waves
    assert splits(256, 4096) == 1  # 512 programs already fill 132 SMs
    assert splits(1, 1 << 20) == kernel.MAX_SPLITS
    assert splits(1, 8192, query_len=8192) == 1  # a big prefill has programs enough


def test_bad_input_is_refused() -> None:
    case = make_case([(3, 1)], 4, (8, 2), 32, 32, torch.float32)
    with pytest.raises(ValueError, match="shapes disagree"):
        kernel.paged_attention(case.q[:, :7], case.k, case.v, case.batch, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        kernel.paged_attention(case.q, case.k, case.v, case.batch, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="num_splits"):
        kernel.paged_attention(case.q, case.k, case.v, case.batch, 1.0, num_splits=kernel.MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="group_split"):
        kernel.paged_attention(case.q, case.k, case.v, case.batch, 1.0, group_split=3)
    with pytest.raises(ValueError, match="unit stride"):
        kernel.paged_attention(case.q, case.k.transpose(1, 2).contiguous().transpose(1, 2), case.v, case.batch, 1.0)


def test_hand_checked_softmax() -> None:
    """Independent of the reference: one query, two keys, scores 0 and ln 3 -> weights 1/4, 3/4."""
    batch = make_case([(1, 1)], 4, (1, 1), 16, 16, torch.float32).batch
    rows = (batch.page_table[0, 0] * 4 + torch.arange(2, device=DEVICE)).cpu()
    k = torch.zeros(32, 1, 16, device=DEVICE)
    v = torch.zeros(32, 1, 16, device=DEVICE)
    k[rows[1], 0, 0] = math.log(3.0)
    v[rows[0], 0, 0], v[rows[1], 0, 0] = 4.0, 8.0
    q = torch.zeros(1, 1, 16, device=DEVICE)
    q[0, 0, 0] = 1.0
    out = kernel.paged_attention(q, k, v, batch, 1.0)
    assert out[0, 0, 0].item() == pytest.approx(0.25 * 4.0 + 0.75 * 8.0, rel=1e-6)


# ------------------------------------------------------------------------------------------- MLA (layers/mla.py)

MLA_WIDTHS = dict(hidden_size=32, num_heads=4, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0, rope_interleave=True, eps=1e-6)


def tiny_mla(dtype: torch.dtype, latent_rows: int, seed: int) -> tuple[MultiLatentAttention, MultiLatentAttention]:
    """(fp32 module, `dtype` module) with the same `dtype`-representable weights. Latent rows: [32 + 8] (absorbed:
    Dk = 40 = 32 + 8, Dv = 32, one KV head; unabsorbed: Dk = 24 = 16 + 8, Dv = 16, 4 heads)."""
    gen = torch.Generator().manual_seed(seed)
    reference_mla = MultiLatentAttention(**MLA_WIDTHS)
    for param in reference_mla.parameters():
        param.data = (torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1])).to(dtype).float()
    mla = copy.deepcopy(reference_mla).to(DEVICE, dtype)
    reference_mla.to(DEVICE).kv["latent"] = torch.empty(latent_rows, 1, 40, device=DEVICE)
    mla.kv["latent"] = torch.empty(latent_rows, 1, 40, dtype=dtype, device=DEVICE)
    return reference_mla, mla


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch-op"])
def test_mla_forms_agree(kernels: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Absorbed (MQA over the latent cache) == batched unabsorbed (packed context, one kv_b GEMM) == whichever the
    layer picks == the per-sequence reference, on prefill with prefix hits and decode rows, and on decode.
    On the kernel path latent rows the batch must not read are NaN: the packed context gathers whole pages, so it
    holds such rows too, and their expansion must never be read."""
    monkeypatch.setattr(backends, "use_triton", lambda op, device: kernels)
    if not kernels and dtype != torch.float32:
        pytest.skip("the torch op path is checked in fp32")
    rows = [(0, 9), (4, 6), (13, 1), (7, 1)]
    prefill = make_case(rows, 4, (1, 1), 40, 32, dtype, v_in_k=True, seed=14)
    # The last token of every row as a decode step over the same cache.
    decode = dataclasses.replace(prefill.batch, query_lens=[1] * 4, query_starts=list(range(4)),
                                 prefix_lens=[p + n - 1 for p, n in rows], is_decode=True, max_query_len=1,
                                 query_start_loc=torch.arange(5, device=DEVICE, dtype=torch.int32))
    reference_mla, mla = tiny_mla(dtype, prefill.k.shape[0], seed=15)
    mla.kv["latent"].copy_(prefill.k if kernels else prefill.clean_k)  # the torch op's decode reads padding rows
    reference_mla.kv["latent"].copy_(prefill.clean_k)
    gen = torch.Generator().manual_seed(16)
    def absorbed(q: torch.Tensor, batch) -> torch.Tensor:
        """The absorbed form's query buffer (head-major, the rope part written as the latent op does)."""
        q_attn = q.new_empty(4, q.shape[0], 32 + 8).transpose(0, 1)
        q_attn[..., 32:] = q[..., 16:]
        return mla._attend_absorbed(q[..., :16], q_attn, batch)

    def picked(q: torch.Tensor, batch) -> torch.Tensor:
        """The form the layer's forward takes for this batch."""
        if mla._absorbed(batch, q.device):
            return absorbed(q, batch)
        return mla._attend_unabsorbed(q, batch) if kernels else mla._attend_unabsorbed_reference(q, batch)

    for batch in (prefill.batch, decode):
        q = torch.randn(sum(batch.query_lens), 4, 16 + 8, generator=gen).to(DEVICE, dtype)  # [nope | roped]
        want = reference_mla._attend_unabsorbed_reference(q.float(), batch)
        tol = MLA_TOLERANCE[dtype]
        for form in (absorbed, mla._attend_unabsorbed, picked):
            got = form(q, batch).float()
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_mla_picks_the_form_with_fewer_flops_at_flash_widths() -> None:
    """Ling-2.6-flash widths: unabsorbed for ordinary chunks, absorbed when decode rows' contexts dominate."""
    with torch.device("meta"):
        mla = MultiLatentAttention(4096, 32, 1536, 512, 128, 64, 128, 10000.0, True, 1e-6)
    base = make_case([(0, 1)], 16, (1, 1), 16, 16, torch.float32).batch

    def flops(rows: list[tuple[int, int]]) -> tuple[int, int]:
        return mla._form_flops(dataclasses.replace(base, prefix_lens=[p for p, _ in rows],
                                                   query_lens=[n for _, n in rows]))

    absorbed, unabsorbed = flops([(0, 8192)])
    assert round(absorbed / 1e12, 2) == 2.41 and round(unabsorbed / 1e12, 2) == 0.76
    absorbed, unabsorbed = flops([(4096, 512)])
    assert round(absorbed / 1e9) == 159 and round(unabsorbed / 1e9) == 84
    absorbed, unabsorbed = flops([(4096, 512)] + [(4095, 1)] * 64)  # a chunk among 64 decode rows
    assert absorbed < unabsorbed
    absorbed, unabsorbed = flops([(32768, 128)])  # a short chunk after a long prefix
    assert absorbed < unabsorbed
