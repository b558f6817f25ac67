"""The memory planner against the Ling-2.6-flash TP=4 worked example (spec ling2_6.md §8.3)."""
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
