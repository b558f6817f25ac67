"""The kernel benchmarks (`python -m benchmarks.ops MODE`, __main__.py). Each public module is one op's
micro-benchmark cases, `cases(device) -> list[OpCase]`, which the `micro` mode (`_micro.py`) times; the `_`
modules are the other modes, and fp8.py is also the `fp8` mode."""
