"""The memory planner against a worked Ling-2.6-flash TP=4 example (fp32 lightning state, bf16 MLA latent cache,
40 GiB a rank), the counts SGLang's memory solve (`handle_max_mamba_cache`) gives for it."""
from __future__ import annotations

import math

import pytest

from hybridserve.cache.memory import GiB, MiB, plan_memory

P = 28 * 8 * 128 * 128 * 4  # fp32 lightning state per request per rank (TP=4): 28 layers x 8 heads x 128 x 128
CELL = 576 * 4 * 2  # bf16 MLA latent per token: 4 MLA layers x 576 values
R = 40 * GiB


def test_slot_and_cell_sizes():
    assert P == 14 * MiB and P == 14_680_064
    assert CELL == 4608


def test_no_speculation():
    plan = plan_memory(R, CELL, P, max_running_requests=64, slots_per_request=3, slots_hold_checkpoints=True)
    assert plan.num_state_slots == 1385
    assert math.isclose(plan.state_bytes / GiB, 18.94, abs_tol=0.01)
    assert math.isclose(plan.kv_bytes / GiB, 21.06, abs_tol=0.01)
    assert math.isclose(plan.num_pages / 1e6, 4.91, abs_tol=0.01)  # pages of one token here: tokens


def test_nextn_joint_solve():
    plan = plan_memory(R, CELL, P, max_running_requests=64, slots_per_request=5, num_speculative_tokens=4,
                       slots_hold_checkpoints=True)
    assert plan.num_state_slots == 769
    assert plan.max_running_requests == 64  # floor(769 / 5) = 153 > 64
    assert plan.intermediate_bytes == P * 64 * 4 and math.isclose(plan.intermediate_bytes / GiB, 3.5)
    assert math.isclose(plan.state_bytes / GiB, 10.51, abs_tol=0.01)
    assert math.isclose(plan.kv_bytes / GiB, 25.99, abs_tol=0.01)
    assert math.isclose(plan.num_pages / 1e6, 6.06, abs_tol=0.01)


def test_pinned_slots_with_speculation():
    plan = plan_memory(R, CELL, P, max_running_requests=64, slots_per_request=5, num_speculative_tokens=4,
                       max_state_slots=256, slots_hold_checkpoints=True)
    assert plan.max_running_requests == 51
    assert math.isclose(plan.intermediate_bytes / GiB, 2.79, abs_tol=0.01)
    assert math.isclose(plan.state_bytes / GiB, 3.5)
    assert math.isclose(plan.kv_bytes / GiB, 33.71, abs_tol=0.01)
    assert math.isclose(plan.num_pages / 1e6, 7.86, abs_tol=0.01)


def test_slots_are_capped_when_they_cannot_hold_checkpoints():
    plan = plan_memory(R, CELL, P, max_running_requests=64)
    assert plan.num_state_slots == 64 and plan.max_running_requests == 64
    assert plan.kv_bytes == (R - 64 * P) // CELL * CELL


@pytest.mark.parametrize("kwargs, knob", [
    (dict(max_state_slots=2, slots_per_request=3), "max_state_slots"),
    (dict(max_state_slots=3000), "lower max_state_slots"),
    (dict(num_speculative_tokens=4000, slots_per_request=1, slots_hold_checkpoints=True), "num_speculative_tokens"),
])
def test_impossible_settings_name_the_knob(kwargs, knob):
    with pytest.raises(ValueError, match=knob):
        plan_memory(R, CELL, P, max_running_requests=64, **kwargs)


def test_an_empty_budget_names_the_memory_knobs():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_memory(0, CELL, P, max_running_requests=4)


def test_window_group_gets_what_running_requests_need_and_the_full_group_the_rest():
    """ZAYA1-74B-like sliding layers (W = 4096, page 16): 64 running requests keep ceil(4095/16) + 1 = 257 window
    pages each, one step of 8192 tokens takes 512 + 64 more; every other byte goes to the full group."""
    full_page, window_page = 3 * CELL * 16, 5 * CELL * 16
    plan = plan_memory(R, full_page, P, max_running_requests=64, window_page_bytes=window_page,
                       sliding_window=4096, page_size=16, max_num_batched_tokens=8192)
    assert plan.min_window_pages == plan.num_window_pages == 64 * 257 + 512 + 64
    no_window = plan_memory(R, full_page, P, max_running_requests=64)
    assert plan.num_pages == (no_window.kv_bytes - plan.num_window_pages * window_page) // full_page
    assert plan.kv_bytes <= no_window.kv_bytes and "sliding-window layers" in plan.describe(16)
    # Fewer full pages than that: the groups get one page each per token slot, as many window as full pages.
    small = plan_memory(64 * P + 1000 * (full_page + window_page), full_page, P, max_running_requests=64,
                        max_state_slots=64, window_page_bytes=window_page, sliding_window=4096, page_size=16,
                        max_num_batched_tokens=8192)
    assert small.num_pages == small.num_window_pages == 1000


def test_no_window_group_leaves_the_plan_unchanged():
    """Ling- and ZAYA1-8B-like models (no sliding layers): the same numbers as without the window arguments."""
    base = plan_memory(R, CELL, P, max_running_requests=64, slots_per_request=3, slots_hold_checkpoints=True)
    same = plan_memory(R, CELL, P, max_running_requests=64, slots_per_request=3, slots_hold_checkpoints=True,
                       page_size=16, max_num_batched_tokens=8192)
    assert base == same and base.num_window_pages == 0 and "sliding" not in base.describe(1)


def test_a_window_group_without_room_for_full_pages_names_the_knobs():
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        plan_memory(64 * P + CELL + 10, CELL, P, max_running_requests=64, max_state_slots=64,
                    window_page_bytes=CELL, sliding_window=8, page_size=1, max_num_batched_tokens=8)


def test_max_total_tokens_caps_the_kv_token_pool():
    """SGLang's --max-total-tokens: the plan holds exactly that many KV tokens; the state side is unchanged."""
    page = 16
    free = plan_memory(R, CELL * page, P, max_running_requests=64, page_size=page)
    capped = plan_memory(R, CELL * page, P, max_running_requests=64, page_size=page, max_total_tokens=4096)
    assert capped.num_pages * page == 4096 < free.num_pages * page
    assert (capped.num_state_slots, capped.max_running_requests) == (free.num_state_slots, free.max_running_requests)
    assert "= 4096 tokens (256 pages of 16, capped by --max-total-tokens)" in capped.describe(page)
    assert "capped" not in free.describe(page)
    exact = plan_memory(R, CELL * page, P, max_running_requests=64, page_size=page,
                        max_total_tokens=free.num_pages * page)  # all the budget holds: allowed, and all of it
    assert exact.num_pages == free.num_pages


def test_max_total_tokens_caps_the_window_group_at_as_many_pages():
    full_page, window_page = 3 * CELL * 16, 5 * CELL * 16
    plan = plan_memory(R, full_page, P, max_running_requests=64, window_page_bytes=window_page,
                       sliding_window=4096, page_size=16, max_num_batched_tokens=8192, max_total_tokens=16 * 1000)
    assert plan.num_pages == plan.num_window_pages == 1000  # fewer than the 17,024 window pages reserved otherwise


def test_max_total_tokens_above_what_the_budget_holds_is_refused_by_name():
    free = plan_memory(R, CELL, P, max_running_requests=64)
    with pytest.raises(ValueError, match=rf"max_total_tokens={free.num_pages + 1} \(--max-total-tokens\): the cache "
                                         rf"budget holds only {free.num_pages} KV tokens"):
        plan_memory(R, CELL, P, max_running_requests=64, max_total_tokens=free.num_pages + 1)
