"""Programmatic dependent launch on a kernel chain shaped like batch-1 decode: `--layers` x (residual RMSNorm + a
dense GEMV of `--width`^2 bf16 weights, each layer its own weights so nothing stays in L2), captured in one CUDA
graph with PDL off and on (ops/triton/pdl.py). Prints and writes the replay time per step and per kernel of each,
and checks the two chains' outputs are bit-identical (these kernels have no order-dependent reductions).

    python benchmarks/pdl_chain.py --out pdl_chain.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.linear import linear
from hybridserve.ops.triton.norm import residual_rms_norm


def _capture(weights: list[torch.Tensor], norm: torch.Tensor, x0: torch.Tensor, use_pdl: bool):
    """The chain captured with PDL `use_pdl`; returns (graph, output tensor)."""
    os.environ["HYBRIDSERVE_PDL"] = "1" if use_pdl else "0"
    pdl._enabled.cache_clear()

    def chain() -> torch.Tensor:
        residual, update = None, x0
        for w in weights:
            residual, h, _ = residual_rms_norm(update, norm, 1e-6, residual=residual)
            update = linear(h, w)
        return update

    chain()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    return graph, out


def _time(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    """Median replay time in microseconds."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=120)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(args.width, args.width, device="cuda", generator=gen).bfloat16() * args.width ** -0.5
               for _ in range(args.layers)]
    norm = torch.ones(args.width, device="cuda", dtype=torch.bfloat16)
    x0 = torch.randn(1, args.width, device="cuda", generator=gen).bfloat16()
    result = {"layers": args.layers, "width": args.width, "kernels_per_step": 2 * args.layers}
    outputs = {}
    for use_pdl in (False, True, False, True):  # twice each, interleaved: the second pair shows the spread
        graph, out = _capture(weights, norm, x0, use_pdl)
        graph.replay()
        torch.cuda.synchronize()
        outputs[use_pdl] = out.clone()
        key = "pdl_us" if use_pdl else "plain_us"
        result.setdefault(key, []).append(_time(graph, args.repeats))
        del graph
    result["identical"] = bool(torch.equal(outputs[False], outputs[True]))
    plain, with_pdl = min(result["plain_us"]), min(result["pdl_us"])
    result["saved_us_per_kernel"] = (plain - with_pdl) / result["kernels_per_step"]
    print(f"{result['kernels_per_step']} kernels: plain {plain:.1f} us, PDL {with_pdl:.1f} us "
          f"({result['saved_us_per_kernel']:.2f} us a kernel saved), outputs identical: {result['identical']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    assert result["identical"], "PDL changed the chain's output"


if __name__ == "__main__":
    main()
