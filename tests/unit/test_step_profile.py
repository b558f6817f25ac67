"""The step profile's timeline arithmetic (benchmarks/offline/step_profile.py) on hand-made device events: what
each kernel adds to the device's timeline when PDL lets it start inside the one before."""
from __future__ import annotations

from types import SimpleNamespace

from torch.autograd import DeviceType

from benchmarks.offline.step_profile import _exposed, _timeline


def _event(name: str, start: float, end: float, device: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


class _Trace:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_kernels_add_what_ends_past_the_latest_end() -> None:
    trace = _Trace([
        _event("b", 12.0, 20.0),  # starts inside a (PDL wait), ends 8 past it: adds 8
        _event("a", 10.0, 12.0),  # first: adds its own 2
        _event("host", 0.0, 100.0, DeviceType.CPU),  # not a device event
        _event("c", 15.0, 18.0),  # ends inside b: adds nothing
        _event("a", 25.0, 26.0),  # after a 5 us gap: adds its own 1, not the gap
    ])
    assert _timeline(trace) == [("a", 0.0, 2.0, 2.0), ("b", 2.0, 8.0, 8.0), ("c", 5.0, 3.0, 0.0),
                                ("a", 15.0, 1.0, 1.0)]
    assert _exposed(trace, 10) == [("b", 1, 0.008), ("a", 2, 0.003), ("c", 1, 0.0)]
