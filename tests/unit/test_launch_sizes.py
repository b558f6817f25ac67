"""The host-side launch arithmetic equals Triton's own (`triton.cdiv`, `triton.next_power_of_2`) wherever the
launchers use it: non-negative sizes."""
from __future__ import annotations

import pytest

from hybridserve.ops.triton.sizes import cdiv, next_power_of_2

triton = pytest.importorskip("triton")


def test_sizes_match_triton() -> None:
    for n in [*range(0, 1100), 4095, 4096, 4097, 65535, 65536, 262272, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 7, 16, 64, 127, 128, 4096):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
