"""The Responses API's in-memory store: bounded in count (oldest dropped first) and in time."""
from __future__ import annotations

import pytest

from hybridserve.server.response_store import ResponseStore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_store_keeps_at_most_capacity_responses_for_ttl_seconds():
    clock = Clock()
    store = ResponseStore(capacity=2, ttl_s=10, clock=clock)
    for i in range(3):
        clock.now = i
        store.put({"id": f"resp_{i}"}, [{"turn": i}])
    assert store.get("resp_0") is None and len(store) == 2  # the oldest went first
    assert store.get("resp_1").items == [{"turn": 1}] and store.get("resp_2").response == {"id": "resp_2"}
    clock.now = 11  # resp_1 was stored at 1: expired; resp_2 (stored at 2) lives until 12
    assert store.get("resp_1") is None and store.get("resp_2") is not None
    clock.now = 12
    assert store.get("resp_2") is None and len(store) == 0


def test_a_store_of_size_zero_keeps_nothing_and_bad_bounds_are_refused():
    store = ResponseStore(capacity=0, ttl_s=1)
    store.put({"id": "resp_0"}, [])
    assert store.get("resp_0") is None
    with pytest.raises(ValueError, match="positive expiry"):
        ResponseStore(capacity=1, ttl_s=0)
