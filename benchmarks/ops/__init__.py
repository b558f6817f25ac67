"""The kernel benchmarks (`python -m benchmarks.ops MODE`, __main__.py). Each public module is one op's
micro-benchmark cases, `cases(device) -> list[OpCase]` (benchmarks/op_microbench.py times them); the `_` modules are
the other modes."""
