"""Per-op micro-benchmark cases: each module exposes `cases(device) -> list[OpCase]` (see
benchmarks/op_microbench.py)."""
