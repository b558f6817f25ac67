"""Paged attention kernels on the GPU at real widths, bf16 against the fp32 torch reference: ZAYA1 (8 q / 2 kv heads
x 128, page 16), its 74B-preview sliding window (4097), and Ling-2.6-flash MLA in the absorbed form (32 heads, or 8
per rank at TP=4, over one 576-wide latent head whose first 512 channels are V); contexts of 4k-32k through
split-K; decode and MLA prefill free of device->host syncs.

Long contexts average many keys, so outputs are small: errors are measured relative to the largest |output| of the
case. bf16 bound 1.5e-2: probabilities are rounded to bf16 (2^-9 relative) before P·V, and so is the output.
"""
from __future__ import annotations

import pytest
import torch

from hybridserve.ops import attention as attention_op
from hybridserve.ops.triton import attention as kernel
from tests.ops.attention_cases import Case, make_case, reference_output

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
BF16_TOLERANCE = 1.5e-2
ZAYA1 = dict(page_size=16, heads=(8, 2), head_dim=128, v_dim=128, dtype=torch.bfloat16, device=CUDA)
LING_MLA = dict(page_size=16, heads=(32, 1), head_dim=576, v_dim=512, dtype=torch.bfloat16, device=CUDA,
                v_in_k=True)


def _relative_error(case: Case, num_splits: int | None = None) -> float:
    got = kernel.paged_attention(case.q, case.k, case.v, case.batch, case.q.shape[-1] ** -0.5, case.window,
                                 num_splits)
    want = reference_output(case)
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def _decode_rows(lengths: list[int]) -> list[tuple[int, int]]:
    return [(n - 1, 1) for n in lengths]


def test_zaya1_decode_long_contexts_split_k() -> None:
    case = make_case(_decode_rows([1, 17, 4096, 9000, 32768]), **ZAYA1)
    assert kernel.choose_splits(case.batch, 2, 1, 132) > 1
    assert _relative_error(case) <= BF16_TOLERANCE
    assert _relative_error(case, num_splits=kernel.MAX_SPLITS) <= BF16_TOLERANCE  # fixed for CUDA graphs
    assert _relative_error(case, num_splits=1) <= BF16_TOLERANCE


def test_zaya1_decode_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    for batch_size in (1, 64, 256):
        lengths = torch.randint(1, 4097, (batch_size,), generator=gen).tolist()
        assert _relative_error(make_case(_decode_rows(lengths), **ZAYA1, seed=batch_size)) <= BF16_TOLERANCE


def test_zaya1_prefill_prefix_hits_chunks_and_decode_rows() -> None:
    rows = [(0, 1024)] * 6 + [(3072, 1024), (8192, 512), (4000, 1), (100, 1), (0, 1)]
    assert _relative_error(make_case(rows, **ZAYA1, seed=1)) <= BF16_TOLERANCE


def test_zaya1_sliding_window_4097() -> None:
    decode = make_case(_decode_rows([100, 4097, 4098, 9000, 20000]), **ZAYA1, window=4097, seed=2)
    assert _relative_error(decode) <= BF16_TOLERANCE
    prefill = make_case([(0, 5000), (6000, 700), (4096, 1), (0, 1)], **ZAYA1, window=4097, seed=3)
    assert _relative_error(prefill) <= BF16_TOLERANCE


@pytest.mark.parametrize("num_q_heads", [32, 8], ids=["tp1", "tp4"])
def test_ling_mla_absorbed(num_q_heads: int) -> None:
    shape = LING_MLA | {"heads": (num_q_heads, 1)}
    decode = make_case(_decode_rows([1, 100, 2048, 8192, 16384]), **shape, seed=4)
    assert decode.v.data_ptr() == decode.k.data_ptr()
    assert _relative_error(decode) <= BF16_TOLERANCE
    assert _relative_error(decode, num_splits=kernel.MAX_SPLITS) <= BF16_TOLERANCE
    prefill = make_case([(2048, 256), (0, 300), (5000, 1)], **shape, seed=5)
    assert _relative_error(prefill) <= BF16_TOLERANCE


def test_no_device_to_host_sync() -> None:
    """The op entry point on decode batches (ZAYA1 and MLA shapes), the MLA layer's batched unabsorbed prefill
    (packed context) and its whole decode forward run without a device->host synchronisation once warm."""
    from hybridserve.layers.mla import MultiLatentAttention

    zaya = make_case(_decode_rows([5, 4096, 30000]), **ZAYA1, seed=6)
    mla_case = make_case(_decode_rows([7, 3000]), **LING_MLA, seed=7)
    prefill = make_case([(0, 700), (1024, 300), (50, 1)], **LING_MLA, seed=8)
    mla = MultiLatentAttention(4096, 32, 1536, 512, 128, 64, 128, 10000.0, True, 1e-6)
    for param in mla.parameters():
        param.data.normal_(std=0.02)
    mla = mla.to(CUDA, torch.bfloat16)
    q = torch.randn(prefill.q.shape[0], 32, 128 + 64, device=CUDA, dtype=torch.bfloat16)
    x = torch.randn(mla_case.q.shape[0], 4096, device=CUDA, dtype=torch.bfloat16)

    def run() -> None:
        for case in (zaya, mla_case):
            attention_op.paged_attention(case.q, case.k, case.v, case.batch, 0.1)
        mla.kv["latent"] = prefill.k
        mla._attend_unabsorbed(q, prefill.batch)
        mla.kv["latent"] = mla_case.k
        mla(x, mla_case.batch)  # the decode forward: fused q_a|kv_a, latent op, in-place absorbed GEMMs

    run()
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
