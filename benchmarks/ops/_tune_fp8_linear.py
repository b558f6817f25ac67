"""Check the e4m3 GEMV linear's tiles on this GPU: device time per call of `ops.triton.linear.linear_tiles`' choice
against candidate tiles (BN rows x BK lanes a chunk, pipeline stages, warps) at the weight-only decode sizes, the
FP8 micro's ZAYA1-8B and Ling-2.6-flash shapes and Ling's dense layer, timed as one CUDA graph over enough weight
copies to stream from HBM (as `python -m benchmarks.ops fp8` times them), and the fastest per case. The tiles
`linear_tiles` picks are what ships; this prints whether a candidate is faster (change the rule by hand, and
confirm it in the engine: a kernel alone and between its PDL neighbours have disagreed).

    python -m benchmarks.ops tune-fp8-linear [--tokens 1 4 16] [--schemes blocks rows] [--rows 8 16 32]
                                             [--chunks 256 512] [--stages 4 8] [--warps 4] [--out FILE]
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.ops._micro import graphed, time_ms
from benchmarks.ops.fp8 import LINEAR_SHAPES, SCHEMES, _quantized, weight_copies
from hybridserve.core.quant import WEIGHT_ONLY_MAX_ROWS, Fp8Scales
from hybridserve.ops.triton import gemv
from hybridserve.ops.triton import linear as kernel
from hybridserve.ops.triton.sizes import next_power_of_2

SHAPES = LINEAR_SHAPES | {"ling dense gate|up": (4096, 18432), "ling dense down": (9216, 4096)}  # name: (K, N)


def candidates(tokens: int, k: int, fp8: Fp8Scales, rows: list[int], chunks: list[int], stages: list[int],
               warps: list[int]) -> list[gemv.Tiles]:
    """The candidate tiles the kernel can take here: chunks of whole scale blocks (`gemv.min_chunk`) no longer than
    the padded row, a product tile of at most twice `gemv.TILE_ELEMENTS` (its registers), one stage for one chunk."""
    bt, depth = next_power_of_2(tokens), next_power_of_2(k)
    out = set()
    for bn, bk, depth_stages, num_warps in itertools.product(rows, chunks, stages, warps):
        if gemv.min_chunk(fp8) <= bk <= depth and bt * bn * bk <= 2 * gemv.TILE_ELEMENTS:
            out.add(gemv.Tiles(bt, bn, bk, depth_stages if bk < k else 1, num_warps))
    return sorted(out, key=lambda t: (t.BN, t.BK, t.STAGES, t.num_warps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--schemes", nargs="+", default=["blocks"], choices=sorted(SCHEMES))
    parser.add_argument("--shapes", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES), metavar="SHAPE",
                        help=f"of {sorted(SHAPES)}")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32], help="BN candidates")
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024], help="BK candidates")
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8], help="pipeline depth candidates")
    parser.add_argument("--warps", type=int, nargs="+", default=[4], help="num_warps candidates")
    parser.add_argument("--out", default=None, help="write the cases as JSON here")
    args = parser.parse_args()
    if max(args.tokens) > WEIGHT_ONLY_MAX_ROWS or min(args.tokens) < 1:
        parser.error(f"--tokens: the GEMV runs e4m3 linears of 1 to {WEIGHT_ONLY_MAX_ROWS} tokens")
    device, cases = torch.device("cuda"), []
    for name in args.shapes:
        k, n = SHAPES[name]
        weights = [(torch.randn(n, k, device=device) / k**0.5).bfloat16() for _ in range(weight_copies(n, k))]
        for label in args.schemes:
            quantized = [_quantized(w, SCHEMES[label]) for w in weights]
            for tokens in args.tokens:
                x = torch.randn(tokens, k, device=device).bfloat16()
                shipped = kernel.linear_tiles(tokens, n, k, quantized[0][1])
                times = {}
                for tiles in {shipped, *candidates(tokens, k, quantized[0][1], args.rows, args.chunks, args.stages,
                                                   args.warps)}:
                    calls = [lambda w=w, s=s, t=tiles: kernel.linear(x, w, config=t, fp8=s) for w, s in quantized]
                    times[tiles] = time_ms(graphed(calls), repeat=20) * 1e3 / len(quantized)
                best = min(times, key=times.get)
                case = {"shape": name, "scheme": label, "tokens": tokens, "shipped": vars(shipped),
                        "shipped_us": times[shipped], "best": vars(best), "best_us": times[best],
                        "all_us": {f"{t.BN}x{t.BK}/{t.STAGES}/{t.num_warps}w": v for t, v in sorted(
                            times.items(), key=lambda item: item[1])}}
                cases.append(case)
                print(f"{name:<22} {label:<6} T={tokens:<3} shipped {shipped.BN}x{shipped.BK}/{shipped.STAGES} "
                      f"{times[shipped]:8.2f} us   best {best.BN}x{best.BK}/{best.STAGES}/{best.num_warps}w "
                      f"{times[best]:8.2f} us ({times[best] / times[shipped]:.2f}x)", flush=True)
        del weights, quantized
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
