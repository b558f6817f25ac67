"""Launches per decoder layer of one decode step, counted on CPU through Triton's interpreter
(tests/ops/launch_counts.py, whose budgets tests/ops/test_layer_launches.py pins): the counts by layer and op.

    python -m benchmarks.ops layer-launches [--model ling|zaya] [--layers 4] [--batch 4] [--quantization fp8]
"""
from __future__ import annotations

import argparse
import os

from tests.ops.launch_counts import MODELS, decode_step_launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="ling")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="decode rows")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="the engine's online FP8 (projections and experts)")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    by_layer = decode_step_launches(args.model, args.layers, args.batch, args.quantization)
    for label, counts in by_layer.items():
        print(f"{label}: {sum(counts.values())} launches")
        for op, count in sorted(counts.items()):
            print(f"    {count:4d}  {op}")
    print(f"total {sum(sum(c.values()) for c in by_layer.values())} per step over {args.layers} layers")
