"""Fused-MoE kernel (`ops.triton.moe`) vs the torch reference (`ops.reference.moe`), and its alignment step.

The reference runs in fp32 on the kernel's (rounded) inputs. Tolerances, relative to the largest output value:
fp32 1e-5 (summation order only); fp16 4e-3 (the kernel rounds the SwiGLU activations and the weighted rows to
fp16, each a 2^-11 relative step, and sums K of them). Split-K (SPLIT_K_UP / SPLIT_K_DOWN > 1) changes only the
fp32 summation order, so it is held to the same tolerances.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.ops.conftest import DEVICE, KERNEL_DTYPES, ON_GPU
from hybridserve.ops.reference import moe as reference
from hybridserve.ops.triton import moe as kernel
from hybridserve.ops.triton import moe_config
from hybridserve.ops.triton import moe_tuning

TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _config(block_m: int = 16, block_n: int = 32, block_k: int = 16, group_m: int = 1,
            splits: tuple[int, int] | None = None) -> dict[str, int]:
    """A launch configuration; the SPLIT_K keys left out (meaning 1, as in tables written before they existed)
    unless `splits` (gate/up, down) is given."""
    config = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=4, num_stages=2)
    return config if splits is None else {**config, "SPLIT_K_UP": splits[0], "SPLIT_K_DOWN": splits[1]}


@pytest.fixture
def reduce_launches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The split-K reduce launches of the calls in a test, as their `swiglu` flags (proves the split path ran)."""
    launches: list[bool] = []
    original = kernel._reduce_splits

    def counted(partial, out, weights, split, swiglu):
        launches.append(swiglu)
        original(partial, out, weights, split, swiglu)

    monkeypatch.setattr(kernel, "_reduce_splits", counted)
    return launches


def _weights(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _routing(tokens: int, experts: int, top_k: int, seed: int, pool: list[int] | None = None):
    """Distinct experts per token drawn from `pool` (default: all), weights in (0.1, 1]."""
    gen = torch.Generator().manual_seed(seed)
    pool_ids = torch.tensor(pool if pool is not None else range(experts))
    ids = pool_ids[torch.rand(tokens, len(pool_ids), generator=gen).topk(top_k, dim=-1).indices]
    weights = 0.1 + 0.9 * torch.rand(tokens, top_k, generator=gen)
    return ids.to(DEVICE), weights.to(DEVICE)


def _check(x, w13, w2, ids, weights, config) -> torch.Tensor:
    got = kernel.fused_experts(x, w13, w2, ids, weights, config=config)
    assert got.dtype == x.dtype and got.shape == x.shape
    want = reference.experts_sorted(x.float().cpu(), w13.float().cpu(), w2.float().cpu(), ids.cpu(),
                                    weights.float().cpu())
    tol = TOLERANCE[x.dtype] * want.abs().max().item()
    torch.testing.assert_close(got.float().cpu(), want, rtol=TOLERANCE[x.dtype], atol=tol)
    return got


# tokens, experts, top_k, hidden, inter, pool of chosen experts, config
CASES = {
    "one token, top-8 of 64": (1, 64, 8, 64, 32, None, _config(block_k=32)),
    "many tokens, top-2 of 16, H and I off the blocks": (97, 16, 2, 72, 40, None, _config(32, 64, 32, 4)),
    "top-1 of 16 (ZAYA1-like)": (50, 16, 1, 48, 48, None, _config(16, 32, 16)),
    "top-8 of 64, 64-row blocks": (33, 64, 8, 32, 16, None, _config(64, 32, 32, 8)),
    "empty experts": (20, 16, 2, 32, 24, [3, 7, 8], _config()),
    "all tokens on one expert": (40, 16, 1, 32, 16, [5], _config(16, 32, 32)),
}


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("splits", [(1, 1), (3, 3)])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case: str, splits: tuple[int, int], dtype: torch.dtype,
                           reduce_launches: list[bool]) -> None:
    """Every case unsplit and with both GEMMs in three splits over 1 to 3 BLOCK_K tiles: a last split holding the
    ragged end of an odd H or I, and splits past the end (fewer tiles than splits) adding zeros. (Splits of
    several tiles and one GEMM split alone: the tests below.)"""
    tokens, experts, top_k, hidden, inter, pool, config = CASES[case]
    w13, w2 = _weights(experts, hidden, inter, dtype, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    ids, weights = _routing(tokens, experts, top_k, seed=experts, pool=pool)
    _check(x, w13, w2, ids, weights, {**config, "SPLIT_K_UP": splits[0], "SPLIT_K_DOWN": splits[1]})
    assert reduce_launches == ([] if splits == (1, 1) else [True, False])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("splits", [(1, 1), (1, 2)])
def test_skip_rows_contribute_exact_zero(dtype: torch.dtype, splits: tuple[int, int]) -> None:
    """ZAYA1's MOD skip: expert 0 with weight 0.0. Expert 0's weights are scaled to overflow (inf in the
    product; with split-K, inf partial sums) and its rows must still be exactly 0; the others match the
    reference."""
    tokens, experts, hidden, inter = 24, 16, 32, 32
    w13, w2 = _weights(experts, hidden, inter, dtype, seed=3)
    w2[0] = torch.finfo(dtype).max
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    ids, weights = _routing(tokens, experts, 1, seed=4, pool=list(range(1, experts)))
    skip = torch.arange(tokens, device=DEVICE) % 3 == 0
    ids[skip], weights[skip] = 0, 0.0
    got = kernel.fused_experts(x, w13, w2, ids, weights, config=_config(splits=splits))
    assert torch.equal(got[skip], torch.zeros_like(got[skip]))
    _check(x[~skip], w13, w2, ids[~skip], weights[~skip], _config(splits=splits))


@pytest.mark.parametrize("splits", [(1, 1), (2, 1)])
def test_duplicates_and_ties(splits: tuple[int, int], reduce_launches: list[bool]) -> None:
    """Equal weights, identical tokens (identical outputs, bit for bit), and one expert chosen twice by a token
    (counted twice, as the reference does). H = 80 is five 16-wide K tiles: gate/up split 2 gives shares of 3
    and 2 (the down GEMM alone unsplit)."""
    tokens, experts, top_k, hidden, inter = 18, 16, 4, 80, 16
    w13, w2 = _weights(experts, hidden, inter, torch.float32, seed=5)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    x[9:] = x[:9]
    ids, _ = _routing(tokens, experts, top_k, seed=7)
    ids[0, 1] = ids[0, 0]
    ids[9:] = ids[:9]
    weights = torch.full((tokens, top_k), 0.25, device=DEVICE)
    got = _check(x, w13, w2, ids, weights, _config(block_k=16, splits=splits))
    if ON_GPU:
        assert torch.equal(got[9:], got[:9])
    else:  # the interpreter's tl.dot is numpy's BLAS, whose rounding may depend on a row's place in the tile
        torch.testing.assert_close(got[9:], got[:9], rtol=0, atol=1e-6)
    assert reduce_launches == ([] if splits == (1, 1) else [True])


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 64, 8, 16), (25, 256, 8, 16), (300, 16, 2, 32),
                                                          (5, 16, 1, 64), (120, 64, 4, 16)])
@pytest.mark.parametrize("single_program", [True, False])
def test_alignment(tokens: int, experts: int, top_k: int, block_m: int, single_program: bool,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pair placed once, in pair order inside its expert's run; runs padded with the sentinel to whole
    blocks in expert order; block_expert names each used block's expert and -1 after; grid bound respected. By one
    program that counts and places (small batches), and by count + place kernels over chunks."""
    monkeypatch.setattr(kernel, "_SINGLE_PROGRAM_PAIRS", 10**9 if single_program else 0)
    ids, _ = _routing(tokens, experts, top_k, seed=tokens, pool=list(range(0, experts, 3)))
    sorted_pairs, block_expert = kernel.align_pairs(ids, experts, block_m)
    num_pairs = tokens * top_k
    assert block_expert.numel() == kernel.max_blocks(num_pairs, experts, block_m)
    flat = ids.flatten().cpu().tolist()
    expected_rows, expected_blocks = [], []
    for e in range(experts):
        mine = [p for p, chosen in enumerate(flat) if chosen == e]
        blocks = -(-len(mine) // block_m)
        expected_rows += mine + [num_pairs] * (blocks * block_m - len(mine))
        expected_blocks += [e] * blocks
    used = len(expected_blocks)
    assert block_expert.cpu().tolist() == expected_blocks + [-1] * (block_expert.numel() - used)
    assert sorted_pairs[:used * block_m].cpu().tolist() == expected_rows


@pytest.mark.parametrize("splits", [(1, 1), (2, 2)])
def test_decode_reads_only_chosen_experts(splits: tuple[int, int]) -> None:
    """Fewer pairs than experts: the grid covers T*K blocks, each one a chosen expert; the weights of all other
    experts are NaN and the output is still exact."""
    experts, top_k = 64, 8
    w13, w2 = _weights(experts, 32, 16, torch.float32, seed=8)
    ids, weights = _routing(2, experts, top_k, seed=9)
    _, block_expert = kernel.align_pairs(ids, experts, 16)
    assert block_expert.numel() == 2 * top_k
    assert set(block_expert.cpu().tolist()) - {-1} == set(ids.flatten().cpu().tolist())
    unchosen = torch.ones(experts, dtype=torch.bool, device=DEVICE)
    unchosen[ids.flatten()] = False
    poisoned13, poisoned2 = w13.clone(), w2.clone()
    poisoned13[unchosen], poisoned2[unchosen] = float("nan"), float("nan")
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    config = _config(splits=splits)
    got = kernel.fused_experts(x, poisoned13, poisoned2, ids, weights, config=config)
    torch.testing.assert_close(got, kernel.fused_experts(x, w13, w2, ids, weights, config=config), rtol=0, atol=0)


def test_no_tokens_and_bad_shapes() -> None:
    w13, w2 = _weights(4, 32, 16, torch.float32, seed=0)
    empty = torch.zeros(0, 1, dtype=torch.long, device=DEVICE)
    assert kernel.fused_experts(torch.zeros(0, 32, device=DEVICE), w13, w2, empty, empty.float()).shape == (0, 32)
    with pytest.raises(ValueError, match="expert weights"):
        kernel.fused_experts(torch.zeros(2, 16, device=DEVICE), w13, w2, empty, empty.float())
    with pytest.raises(ValueError, match="BLOCK_N"):
        kernel.fused_experts(torch.zeros(1, 32, device=DEVICE), w13, w2, torch.zeros(1, 1, dtype=torch.long,
                             device=DEVICE), torch.ones(1, 1, device=DEVICE), config=_config(block_n=16))
    for splits in ((0, 1), (1, moe_config.MAX_SPLIT_K + 1), (True, 1)):
        with pytest.raises(ValueError, match="SPLIT_K"):
            moe_config.check_config(_config(splits=splits), "test")
    old = moe_config.check_config(_config(), "old table")  # an entry without the keys: unsplit
    assert old["SPLIT_K_UP"] == old["SPLIT_K_DOWN"] == 1


# ------------------------------------------------------------------------------------------- configs


def test_heuristic_configs_are_valid_and_fill_the_gpu_at_decode() -> None:
    for experts, inter, hidden, top_k in ((16, 2048, 2048, 1), (256, 1024, 4096, 8), (64, 96, 40, 4)):
        for tokens in (1, 2, 8, 64, 256, 1024, 8192, 16384):
            config = moe_config.check_config(moe_config.heuristic_config(tokens, experts, inter, hidden, top_k),
                                             "heuristic")
            assert config["BLOCK_M"] <= 128
    one = moe_config.heuristic_config(1, 256, 1024, 4096, 8)
    assert one["BLOCK_M"] == 16 and 8 * 1024 // (one["BLOCK_N"] // 2) >= 256
    assert one["SPLIT_K_UP"] == one["SPLIT_K_DOWN"] == 1
    zaya = moe_config.heuristic_config(1, 16, 2048, 2048, 1)  # one expert: 128 / 64 narrowest tiles, split to 256
    assert (zaya["BLOCK_N"], zaya["SPLIT_K_UP"], zaya["SPLIT_K_DOWN"]) == (32, 2, 4)
    two = moe_config.heuristic_config(2, 16, 2048, 2048, 1)  # 256 gate/up programs, 128 down
    assert (two["SPLIT_K_UP"], two["SPLIT_K_DOWN"]) == (1, 2)
    for config in [moe_config.heuristic_config(t, 16, 2048, 2048, 1) for t in (64, 8192)] + \
            [moe_config.heuristic_config(1, 4, 32, 64, 1)]:  # tiny test models: K too short to split
        assert config["SPLIT_K_UP"] == config["SPLIT_K_DOWN"] == 1


def test_tables_ship_for_both_models_and_lookup_takes_the_nearest(monkeypatch, tmp_path) -> None:
    for experts, inter, hidden in ((16, 2048, 2048), (256, 1024, 4096)):
        name = moe_config.config_file_name(experts, inter, hidden, torch.bfloat16, "NVIDIA H200")
        table = moe_config.load_table(name)
        assert table is not None and sorted(table) == [2**i for i in range(15)], name
    tuned = {"_comment": "test", "1": _config(16), "64": _config(32), "4096": _config(128, 128, 64, 8)}
    (tmp_path / moe_config.config_file_name(8, 16, 32, torch.float16, "Some GPU")).write_text(json.dumps(tuned))
    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(moe_config, "_device_name", lambda index: "Some GPU")
    moe_config.load_table.cache_clear()
    try:
        pick = [moe_config.moe_config(t, 8, 16, 32, 2, torch.float16, torch.device("cuda", 0))["BLOCK_M"]
                for t in (1, 20, 40, 1000, 3000, 100000)]
        assert pick == [16, 16, 32, 32, 128, 128]
        assert moe_config.moe_config(64, 8, 16, 32, 2, torch.float32, torch.device("cuda", 0)) == \
            moe_config.heuristic_config(64, 8, 16, 32, 2)  # no table for fp32
        (tmp_path / moe_config.config_file_name(8, 16, 32, torch.float32, "Some GPU")).write_text(
            json.dumps({"4": {"BLOCK_M": 16}}))
        moe_config.load_table.cache_clear()
        with pytest.raises(ValueError, match=r"\[4\]"):
            moe_config.moe_config(4, 8, 16, 32, 2, torch.float32, torch.device("cuda", 0))
    finally:
        moe_config.load_table.cache_clear()


@pytest.mark.parametrize("splits", [(1, 1), (1, 2)])
def test_unreduced_rows_sum_to_the_output(splits: tuple[int, int]) -> None:
    """reduce=False hands back the K weighted rows per token, each the only contribution of its (token, choice):
    their sum is the reduced output exactly (the same sum, the same rounding)."""
    experts, top_k = 16, 4
    w13, w2 = _weights(experts, 32, 16, torch.float16, seed=11)
    ids, weights = _routing(3, experts, top_k, seed=12)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(13)).to(DEVICE, torch.float16)
    config = _config(splits=splits)
    rows = kernel.fused_experts(x, w13, w2, ids, weights, config=config, reduce=False)
    assert rows.shape == (3, top_k, 32) and rows.dtype == torch.float16
    assert torch.equal(rows.sum(dim=1), kernel.fused_experts(x, w13, w2, ids, weights, config=config))
    for k in range(top_k):  # row k is choice k alone
        alone = torch.where(torch.arange(top_k, device=DEVICE) == k, weights, 0.0)
        torch.testing.assert_close(rows[:, k], kernel.fused_experts(x, w13, w2, ids, alone, config=config),
                                   rtol=0, atol=0)


def test_tuner_pools_split_small_grids_only() -> None:
    """Split-K candidates exist where the decode grid is small (one ZAYA1 expert, Ling's eight) and not where
    the unsplit grid already has thousands of programs; every candidate passes check_config."""
    for (experts, top_k, hidden, inter), tokens, splits in (((16, 1, 2048, 2048), 1, True),
                                                            ((256, 8, 4096, 1024), 1, True),
                                                            ((256, 8, 4096, 1024), 64, False),
                                                            ((16, 1, 2048, 2048), 8192, False)):
        pool = moe_tuning.candidates(tokens, experts, top_k, inter, hidden, torch.bfloat16)
        assert all(moe_config.check_config(c, "pool") == c for c in pool)
        assert any(c["SPLIT_K_UP"] * c["SPLIT_K_DOWN"] > 1 for c in pool) == splits, (experts, tokens)


@pytest.mark.parametrize("tokens", [2, 64, 4096])
def test_tuner_pools_for_fp8_suit_the_grouped_form(tokens: int) -> None:
    """e4m3 candidates (the W8A8 grouped form's): no split-K, tiles the FP8 GEMM takes with block scales too."""
    from hybridserve.core.quant import FP8_DTYPE, Fp8Scheme
    from hybridserve.ops.triton.fp8_linear import check_tiles
    pool = moe_tuning.candidates(tokens, 256, 8, 1024, 4096, FP8_DTYPE)
    assert len(pool) > 4
    for c in pool:
        assert moe_config.check_config(c, "pool") == c and c["SPLIT_K_UP"] == c["SPLIT_K_DOWN"] == 1
        assert check_tiles(c, Fp8Scheme("block", "group", (128, 128))) == c


def test_tuner_keeps_the_untuned_token_counts(tmp_path) -> None:
    """A run over some token counts replaces those entries and keeps the previous table's others (an entry
    without the SPLIT_K keys stays as it was), in token order."""
    name = "E=8,N=16,H=32,dtype=float16,device=Some_GPU.json"
    old = {"_comment": "old", "_time_us": {"1": 9.0, "64": 20.0}, "1": _config(16), "64": _config(32)}
    (tmp_path / name).write_text(json.dumps(old))
    moe_tuning.write_table(tmp_path, name, "new", {"1": _config(16, splits=(4, 2)), "8": _config(16)},
                         {"1": 5.0, "8": 7.0})
    new = json.loads((tmp_path / name).read_text())
    assert list(new) == ["_comment", "_time_us", "1", "8", "64"] and new["_comment"] == "new"
    assert new["_time_us"] == {"1": 5.0, "8": 7.0, "64": 20.0}
    assert new["1"]["SPLIT_K_UP"] == 4 and new["64"] == _config(32)
