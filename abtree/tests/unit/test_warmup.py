"""Start-up warm-up (runtime/warmup.py): the shapes it covers, and that running it leaves every cache untouched."""
from __future__ import annotations

import pytest
import torch

from hybridserve.config import EngineConfig
from hybridserve.runtime.model_runner import ModelRunner
from hybridserve.runtime.warmup import DUMMY_PAGE, DUMMY_SLOT, warmup_batches

PAGE = 16


def test_ladder_covers_every_bucket_in_both_divisibility_classes() -> None:
    steps = warmup_batches(max_tokens=1000, max_rows=40, max_model_len=300, page_size=PAGE)
    prefill = [rows for rows in steps if len(rows) <= 2 and rows[0].prefix_len == 0]
    single = sorted(len(rows[0].token_ids) for rows in prefill if len(rows) == 1)
    assert single == [1, 2, 4, 8, 16, 31, 32, 63, 64, 127, 128, 255, 256, 511, 512, 1000]
    mixed = [rows for rows in prefill if len(rows) == 2]
    assert all(len(b.token_ids) == 1 and b.prefix_len == 1 and b.has_initial_state for _, b in mixed)
    assert sorted(len(a.token_ids) + 1 for a, _ in mixed) == single[1:]
    decode = [rows for rows in steps if all(r.prefix_len > 0 for r in rows)]
    assert all(len(r.token_ids) == 1 for rows in decode for r in rows)
    contexts = {rows[0].prefix_len for rows in decode}
    assert contexts == {PAGE - 1, 299}
    for context in contexts:
        sizes = sorted(len(rows) for rows in decode if rows[0].prefix_len == context)
        assert sizes == [1, 2, 4, 8, 16, 31, 32, 40]
    for rows in steps:
        assert sum(len(r.token_ids) for r in rows) <= 1000
        for row in rows:
            assert row.state_slot == DUMMY_SLOT and set(row.page_ids) == {DUMMY_PAGE}
            assert len(row.page_ids) * PAGE >= row.prefix_len + len(row.token_ids)


def test_decode_rows_never_exceed_the_token_budget() -> None:
    steps = warmup_batches(max_tokens=24, max_rows=256, max_model_len=64, page_size=PAGE)
    assert max(len(rows) for rows in steps) == 24


@pytest.mark.parametrize("model", ["zaya_dir", "ling_dir"])
def test_warm_up_leaves_every_cache_as_it_found_it(model: str, request: pytest.FixtureRequest) -> None:
    """The pools start zeroed; warm-up writes only the dummy page and slot (and the dummy page's footer) and zeroes
    them again, so every buffer is zero afterwards. Prefix caching on: ZAYA1 then keeps per-page state footers."""
    directory = str(request.getfixturevalue(model))
    config = EngineConfig(model=directory, device="cpu", dtype="float32", max_num_batched_tokens=40,
                          max_running_requests=8, kv_cache_memory_bytes=1 << 24)
    runner = ModelRunner(config, directory)
    pools = [runner.kv_pool, runner.state_pool] + ([runner.footer_pool] if runner.footer_pool else [])
    forwards, dirty = [], []
    runner.model.register_forward_hook(lambda module, args, output: forwards.append(1))
    for pool in pools:  # before zeroing: the warm-up did write there (so the check below can fail)
        name = "clear_page" if pool is runner.kv_pool else "clear_slot"

        def checked(index, pool=pool, clear=getattr(pool, name)):
            dirty.append(any(bool(torch.count_nonzero(b)) for b in pool.buffers.values()))
            clear(index)
        setattr(pool, name, checked)
    steps = runner.warm_up(max_rows=8, max_model_len=70)
    assert steps == len(forwards) == len(warmup_batches(40, 8, 70, config.page_size))
    assert dirty == [True] * len(pools)
    for pool in pools:
        for name, buffer in pool.buffers.items():
            assert torch.count_nonzero(buffer) == 0, name
