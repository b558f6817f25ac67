"""Compile the Triton kernels a test run launches for Hopper (sm_90) on a machine without a GPU.

The interpreter never runs a kernel's GPU-only branches: under `USE_PDL` the griddepcontrol wait and the L2
prefetches' inline PTX (ops/triton/pdl.py). This module is a pytest plugin (`-p tests.ops.sm90_compile`) that
records the signature and constexprs of the first launch of every kernel variant the interpreted tests make, and a
command (`python -m tests.ops.sm90_compile RECORDS`, run without TRITON_INTERPRET) that compiles each variant with
USE_PDL (and the other GPU_ONLY constexprs) on through Triton's own compiler and its bundled ptxas: a kernel that
would not build on the GPU fails here. The variants compiled are a cover: each constexpr value any launch of a
kernel used appears in one of them.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys

import torch

RECORDS_ENV = "SM90_LAUNCH_RECORDS"
GPU_ONLY = ("USE_PDL", "PREFETCH")  # constexprs that are on only on the GPU: compiled on
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
           torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
           torch.float8_e4m3fn: "fp8e4nv"}


def _arg_type(value) -> str:
    """Triton's signature string of a launch argument (16-byte aligned pointers and ints, as the launcher sees them
    in these tests' tensors, are not assumed: the compile is the conservative one)."""
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if not -2**31 <= value < 2**31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton signature for {type(value).__name__}")


def _constexpr_names(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.annotation in ("tl.constexpr", "triton.language.constexpr")]


def pytest_configure(config) -> None:
    """Wrap the interpreter's launch to record each kernel variant once (the plugin's entry)."""
    from triton.runtime.interpreter import InterpretedFunction

    records: dict[str, dict] = {}
    launch = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        constexprs = _constexpr_names(self.fn)
        bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        values = {name: bound[name] for name in constexprs if name in bound}
        key = json.dumps([self.fn.__module__, self.fn.__name__, sorted(map(str, values.items()))])
        if key not in records:
            records[key] = {"module": self.fn.__module__, "name": self.fn.__name__, "constexprs": values,
                            "signature": {n: _arg_type(bound[n]) for n in names if n not in constexprs},
                            "num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages", 1)}
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    config._sm90_records = records


def pytest_unconfigure(config) -> None:
    records = getattr(config, "_sm90_records", None)
    if records is not None and os.environ.get(RECORDS_ENV):
        with open(os.environ[RECORDS_ENV], "w") as f:
            json.dump(list(records.values()), f)


def compile_for_sm90(record: dict) -> None:
    """Build one recorded variant for sm_90 (PTX, then ptxas to a cubin), the GPU_ONLY constexprs on where the
    kernel has them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(record["module"]), record["name"])
    constexprs = dict(record["constexprs"])
    for name in GPU_ONLY:
        if name in constexprs:
            constexprs[name] = True
    signature = dict(record["signature"]) | {name: "constexpr" for name in constexprs}
    triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": record["num_warps"], "num_stages": record["num_stages"]})


def covering(records: list[dict]) -> list[dict]:
    """Records that between them give every constexpr of every kernel each value it was launched with (greedy),
    so every branch a launch took is compiled without compiling every combination."""
    missing = set().union(*map(_pairs, records))
    chosen = []
    while missing:
        best = max(records, key=lambda r: len(_pairs(r) & missing))
        chosen.append(best)
        missing -= _pairs(best)
    return chosen


def _pairs(record: dict) -> set[tuple]:
    return {(record["module"], record["name"], key, repr(value)) for key, value in record["constexprs"].items()}


def main(path: str) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    failed = 0
    records = covering(json.load(open(path)))
    for record in records:
        try:
            compile_for_sm90(record)
        except Exception as err:  # every failure is reported, then the exit status says so
            failed += 1
            print(f"FAILED {record['module']}.{record['name']} {record['constexprs']}\n{err}", flush=True)
    print(f"compiled {len(records) - failed} of {len(records)} kernel variants for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
