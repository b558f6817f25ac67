"""Check the e4m3 linears' decode forms and tiles on this GPU, at the weight-only decode sizes, the FP8 micro's
ZAYA1-8B and Ling-2.6-flash shapes and Ling's dense layer, each timed as one CUDA graph over enough weight copies to
stream from HBM (as `python -m benchmarks.ops fp8` times them), in us a call:
- the GEMV at `ops.triton.linear.linear_tiles`' choice against candidate tiles (BN rows x BK lanes a chunk,
  pipeline stages, warps; `--rows` with no value: none);
- the weight-only tl.dot GEMM (`fp8_linear.gemm(weight_only=True)`) at `gemm_config`'s tiles and at BLOCK_N
  candidates (`--block-n`), and the W8A8 GEMM (quantization launch included) at `gemm_config`'s;
- which form `fp8_linear.fp8_linear` takes there (`linear.E4M3_GEMV_MAX_TOKENS`), and the fastest.
What ships is `linear_tiles`, `gemm_config` and that bound; this prints whether something else is faster (change
them by hand, and confirm it in the engine: a kernel alone and between its PDL neighbours have disagreed).

    python -m benchmarks.ops tune-fp8-linear [--tokens 1 4 16] [--schemes blocks rows] [--rows 8 16 32]
                                             [--chunks 256 512] [--stages 4 8] [--warps 4] [--block-n 16 32 64]
                                             [--out FILE]
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
from hybridserve.ops.triton import fp8_linear, gemv
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


def gemm_candidates(tokens: int, n: int, block_n: list[int]) -> dict[str, dict[str, int]]:
    """The weight-only GEMM's tiles to time: `gemm_config`'s, and it with each BLOCK_N of `block_n`."""
    shipped = fp8_linear.gemm_config(tokens, n, weight_only=True)
    return {"shipped": shipped} | {f"BLOCK_N={b}": shipped | {"BLOCK_N": b} for b in block_n if b != shipped["BLOCK_N"]}


def per_call_us(calls: list) -> float:
    """Device time of one call: the calls replayed as one CUDA graph, over their count."""
    return time_ms(graphed(calls), repeat=20) * 1e3 / len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--schemes", nargs="+", default=["blocks"], choices=sorted(SCHEMES))
    parser.add_argument("--shapes", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES), metavar="SHAPE",
                        help=f"of {sorted(SHAPES)}")
    parser.add_argument("--rows", type=int, nargs="*", default=[4, 8, 16, 32], help="GEMV BN candidates")
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024], help="BK candidates")
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8], help="pipeline depth candidates")
    parser.add_argument("--warps", type=int, nargs="+", default=[4], help="num_warps candidates")
    parser.add_argument("--block-n", type=int, nargs="*", default=[16, 32, 64],
                        help="the weight-only GEMM's BLOCK_N candidates")
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
                    times[tiles] = per_call_us([lambda w=w, s=s, t=tiles: kernel.linear(x, w, config=t, fp8=s)
                                                for w, s in quantized])
                best = min(times, key=times.get)
                gemms = {tiles_name: per_call_us([lambda w=w, s=s, c=config: fp8_linear.gemm(x, w, s, config=c,
                                                                                          weight_only=True)
                                              for w, s in quantized])
                         for tiles_name, config in gemm_candidates(tokens, n, args.block_n).items()}
                w8a8 = per_call_us([lambda w=w, s=s: fp8_linear.gemm(x, w, s) for w, s in quantized])
                best_gemm = min(gemms, key=gemms.get)
                forms = {"gemv": times[shipped], "weight-only gemm": gemms["shipped"], "w8a8 gemm": w8a8}
                taken = "gemv" if fp8_linear.takes_gemv(x) else "weight-only gemm"
                fastest = min(forms, key=forms.get)
                case = {"shape": name, "scheme": label, "tokens": tokens, "shipped": vars(shipped),
                        "shipped_us": times[shipped], "best": vars(best), "best_us": times[best],
                        "all_us": {f"{t.BN}x{t.BK}/{t.STAGES}/{t.num_warps}w": v for t, v in sorted(
                            times.items(), key=lambda item: item[1])},
                        "weight_only_gemm_us": gemms, "w8a8_gemm_us": w8a8, "form_taken": taken,
                        "fastest_form": fastest}
                cases.append(case)
                print(f"{name:<22} {label:<6} T={tokens:<3} gemv {shipped.BN}x{shipped.BK}/{shipped.STAGES} "
                      f"{times[shipped]:8.2f} us (best {best.BN}x{best.BK}/{best.STAGES}/{best.num_warps}w "
                      f"{times[best]:8.2f})   weight-only gemm {gemms['shipped']:7.2f} (best {best_gemm} "
                      f"{gemms[best_gemm]:7.2f})   w8a8 {w8a8:7.2f}   taken: {taken} ({forms[taken]:.2f}), "
                      f"fastest: {fastest}", flush=True)
        del weights, quantized
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
