"""Finished Responses-API responses, kept in memory for `previous_response_id` and GET /v1/responses/{id}.

Bounded two ways: at most `capacity` responses (the oldest stored is dropped first) and each for `ttl_s` seconds
after it was stored. Nothing survives a restart, and replicas behind one server share this one store.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as it was sent
    items: list[dict]  # the conversation so far as input items: earlier turns, this input, this output
    expires: float


class ResponseStore:
    def __init__(self, capacity: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if capacity < 0 or ttl_s <= 0:
            raise ValueError(f"the response store needs capacity >= 0 and a positive expiry (got {capacity}, "
                             f"{ttl_s} s)")
        self.capacity, self.ttl_s, self._clock = capacity, ttl_s, clock
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict, items: list[dict]) -> None:
        if self.capacity == 0:
            return
        self._expire()
        self._responses[response["id"]] = StoredResponse(response, items, self._clock() + self.ttl_s)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._responses.get(response_id)

    def __len__(self) -> int:
        return len(self._responses)

    def _expire(self) -> None:
        now = self._clock()
        while self._responses and next(iter(self._responses.values())).expires <= now:
            self._responses.popitem(last=False)
