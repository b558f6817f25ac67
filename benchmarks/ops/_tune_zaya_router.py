"""Check the fused EDA router's tile constants on this GPU: device time per call of each candidate
(PROGRAMS, TILE_ELEMENTS, PIPELINE_STAGES of ops/triton/zaya_router.py) at the decode sizes, ZAYA1-8B widths, timed
as a CUDA graph of 40 layers' calls with their own weights (as a decode step runs them), and the fastest per size.
The module's constants are what it ships; this prints whether another candidate is faster (edit them by hand).

    python -m benchmarks.ops tune-zaya-router [--tokens 1 16 64 256] [--programs 64 128 256] [--tiles 4096 8192]
                                              [--stages 3 6]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.ops._micro import graphed, time_ms
from benchmarks.ops.zaya_router import LAYERS, _inputs
from hybridserve.ops.triton import zaya_router as kernel

KNOBS = ("PROGRAMS", "TILE_ELEMENTS", "PIPELINE_STAGES")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 64, 256])
    parser.add_argument("--programs", type=int, nargs="+", default=[64, 128, 256], help="PROGRAMS candidates")
    parser.add_argument("--tiles", type=int, nargs="+", default=[4096, 8192], help="TILE_ELEMENTS candidates")
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 6], help="PIPELINE_STAGES candidates")
    args = parser.parse_args()
    candidates = list(itertools.product(args.programs, args.tiles, args.stages))
    device = torch.device("cuda")
    shipped = tuple(getattr(kernel, name) for name in KNOBS)
    print("shipped:", dict(zip(KNOBS, shipped)))
    for tokens in args.tokens:
        layers = [_inputs(tokens, device) for _ in range(LAYERS)]
        times = {}
        for values in candidates:
            for name, value in zip(KNOBS, values):
                setattr(kernel, name, value)
            replay = graphed([lambda a=a: kernel.fused_route(**a) for a in layers])
            times[values] = time_ms(replay, repeat=20) * 1e3 / LAYERS
        for name, value in zip(KNOBS, shipped):
            setattr(kernel, name, value)
        best = min(times, key=times.get)
        print(f"T={tokens:<4} shipped {times.get(shipped, float('nan')):7.2f} us   best {times[best]:7.2f} us "
              f"{dict(zip(KNOBS, best))}   all: " + " ".join(f"{v}:{t:.1f}" for v, t in sorted(times.items())))
