"""Host-side size arithmetic for kernel launches (grids, tiles).

Triton 3.6's `triton.cdiv` and `triton.next_power_of_2` are constexpr functions: called from host code, each goes
through Triton's argument unwrapping, 2.7 us a call on the CPU VM against 0.03 us for the arithmetic. An eager
40-layer ZAYA1 prefill step made about 2,200 such calls (cProfile on the H200 host), some 6 ms of a step whose
host work was 45 ms. Same results for the non-negative ints the launchers pass.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
