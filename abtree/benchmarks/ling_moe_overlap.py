"""What the side-stream overlap of Ling's shared expert buys: one Ling-2.6-flash MoE block (4096 hidden, 256 experts
top-8, groups 8 keep 4, expert and shared width 1024; bf16, random weights), sequential vs overlapped, eager and
as a captured CUDA graph (how decode runs), per token count.

    python benchmarks/ling_moe_overlap.py [--tokens 1 16 64 256 1024]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.op_microbench import time_ms  # noqa: E402
from hybridserve.models.ling import LingMoE  # noqa: E402
from hybridserve.models.ling_config import parse_ling_config  # noqa: E402


def flash_moe(device: torch.device) -> LingMoE:
    config = parse_ling_config({"hidden_size": 4096, "moe_intermediate_size": 1024, "num_experts": 256,
                                "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                                "routed_scaling_factor": 2.5})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            moe = LingMoE(config)  # the router keeps its fp32 parameters
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5)
    return moe


def graphed(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--out", default=None, help="write the table here as JSON")
    args = parser.parse_args()
    results = {}
    device = torch.device("cuda")
    moe = flash_moe(device)
    print(f"{'tokens':>6} {'eager seq ms':>12} {'eager ovl ms':>12} {'graph seq ms':>12} {'graph ovl ms':>12} "
          f"{'graph gain':>10}")
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, 4096, device=device).bfloat16()
            row = []
            for graph_mode in (False, True):
                for overlap in (False, True):
                    moe.overlap_max_tokens = tokens if overlap else 0
                    fn = graphed(lambda: moe(x)).replay if graph_mode else (lambda: moe(x))
                    row.append(time_ms(fn, warmup=10, repeat=100))
            print(f"{tokens:>6} {row[0]:>12.4f} {row[1]:>12.4f} {row[2]:>12.4f} {row[3]:>12.4f} "
                  f"{row[2] / row[3] - 1:>9.1%}")
            results[tokens] = dict(zip(("eager_sequential_ms", "eager_overlap_ms", "graph_sequential_ms",
                                        "graph_overlap_ms"), row))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
