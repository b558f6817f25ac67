"""FP8 (e4m3) W8A8 kernels vs the bf16 paths they replace, at ZAYA1-8B and Ling-2.6-flash shapes: the linear
layers (ops.triton.fp8_linear: the GEMV form up to 16 tokens, the GEMM beyond) against ops.linear on bf16 weights
(the GEMV kernel or cuBLAS, whichever it picks), and the routed experts (ops.triton.fp8_moe) against ops.moe on bf16
stacks. Per-row scales with per-token activations and 128x128 blocks with per-group ones.

Decode sizes run as one CUDA graph of calls over enough weight copies (linear) or routings (experts) that the
weights stream from HBM, as a decode step's layers do. Minimum bytes: the weights read once per call (e4m3 plus
scales for the kernel, bf16 for the reference) and x and the output. Its cases run in the `micro` mode
(`--ops fp8`); the `fp8` mode prints the achieved bandwidth of both paths and writes them as JSON:

    python -m benchmarks.ops fp8 [--out fp8.json]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from benchmarks.ops._micro import OpCase, graphed, time_ms
from benchmarks.ops.moe import routing
from hybridserve.core.quant import Fp8Scales, Fp8Scheme
from hybridserve.ops import linear as linear_op
from hybridserve.ops import moe as moe_op
from hybridserve.ops.reference.fp8 import quantize_weight

SCHEMES = {"rows": Fp8Scheme("channel", "token"), "blocks": Fp8Scheme("block", "group", (128, 128))}
LINEAR_SHAPES = {  # name: (K, N)
    "zaya1 q|k|v|v": (2048, 1536), "zaya1 o_proj": (1024, 2048), "ling Q|K|V|G": (4096, 16384),
    "ling shared gate|up": (4096, 2048), "ling shared down": (1024, 4096),
}
DECODE_TOKENS, PREFILL_TOKENS = (1, 4, 16), (64, 512, 4096)
MOE_SHAPES = {"zaya1-8b": (16, 1, 2048, 2048), "ling-2.6-flash": (256, 8, 4096, 1024)}  # E, K, H, I
MOE_DECODE_TOKENS = {"zaya1-8b": (1, 4, 8), "ling-2.6-flash": (1,)}
MOE_PREFILL_TOKENS = (64, 512, 4096)
STREAMED_BYTES = 256 * 2**20  # weight copies per decode graph: at least this many bf16 bytes, about 5x the L2
MAX_COPIES = 40
DECODE_CALLS = 16  # expert calls per decode graph, each with its own routing


@dataclass
class Fp8Case(OpCase):
    """An OpCase whose reference (the bf16 path) reads `reference_bytes` at the least."""

    reference_bytes: int = 0


def _quantized(weight: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, Fp8Scales]:
    """A bf16 weight [..., N, K] as e4m3 with its scales (an expert at a time for a stack)."""
    if weight.dim() == 2:
        values, scale = quantize_weight(weight, scheme)
        return values, Fp8Scales(scale, scheme)
    values, scales = zip(*(quantize_weight(w, scheme) for w in weight))
    return torch.stack(values), Fp8Scales(torch.stack(scales), scheme)


def weight_copies(n: int, k: int) -> int:
    """Copies of an [n, k] weight a decode graph streams: STREAMED_BYTES of bf16 at least, so that they come from
    HBM, not the L2."""
    return min(MAX_COPIES, max(2, -(-STREAMED_BYTES // (2 * n * k))))


def _timed(calls: list, tokens: int):
    """One CUDA graph of the calls at decode sizes (eager launches would time the host), else the calls in turn."""
    if tokens <= max(DECODE_TOKENS):
        return graphed(calls)
    return lambda: [call() for call in calls]


def linear_cases(device: torch.device, decode_only: bool = False) -> list[Fp8Case]:
    out = []
    token_counts = DECODE_TOKENS if decode_only else DECODE_TOKENS + PREFILL_TOKENS
    for name, (k, n) in LINEAR_SHAPES.items():
        copies = weight_copies(n, k)
        weights = [(torch.randn(n, k, device=device) / k**0.5).bfloat16() for _ in range(copies)]
        for label, scheme in SCHEMES.items():
            quantized = [_quantized(w, scheme) for w in weights]
            scale_bytes = quantized[0][1].scale.numel() * 4
            for tokens in token_counts:
                calls = copies if tokens <= max(DECODE_TOKENS) else 1
                x = torch.randn(tokens, k, device=device).bfloat16()
                io = tokens * (n + k) * 2
                out.append(Fp8Case(
                    "fp8", f"linear {name} {label} T={tokens}" + (f" x{calls} graph" if calls > 1 else ""),
                    _timed([partial(linear_op.linear, x, w, None, s) for w, s in quantized[:calls]], tokens),
                    _timed([partial(linear_op.linear, x, w) for w in weights[:calls]], tokens),
                    bytes=calls * (n * k + scale_bytes + io), flops=calls * 2 * tokens * n * k,
                    reference_bytes=calls * (2 * n * k + io)))
    return out


def moe_cases(device: torch.device, decode_only: bool = False) -> list[Fp8Case]:
    out = []
    for name, (experts, top_k, hidden, inter) in MOE_SHAPES.items():
        w13 = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).bfloat16()
        for label, scheme in SCHEMES.items():
            (q13, s13), (q2, s2) = _quantized(w13, scheme), _quantized(w2, scheme)
            scale_bytes = (s13.scale.numel() + s2.scale.numel()) * 4 // experts  # per expert
            for tokens in MOE_DECODE_TOKENS[name] + (() if decode_only else MOE_PREFILL_TOKENS):
                calls = DECODE_CALLS if tokens <= max(DECODE_TOKENS) else 1
                runs, touched = [], 0
                for call in range(calls):
                    ids, weights = routing(tokens, experts, top_k, device)
                    if tokens * top_k == 1:
                        ids.fill_(call % experts)
                    runs.append((torch.randn(tokens, hidden, device=device).bfloat16(), ids, weights))
                    touched += ids.unique().numel()
                io = calls * 2 * tokens * hidden * 2
                out.append(Fp8Case(
                    "fp8", f"moe {name} {label} T={tokens}" + (f" x{calls} graph" if calls > 1 else ""),
                    _timed([partial(moe_op.fused_experts, x, q13, q2, ids, weights, fp8=(s13, s2))
                            for x, ids, weights in runs], tokens),
                    _timed([partial(moe_op.fused_experts, x, w13, w2, ids, weights) for x, ids, weights in runs],
                           tokens),
                    bytes=touched * (3 * inter * hidden + scale_bytes) + io,
                    flops=calls * 2 * tokens * top_k * 3 * inter * hidden,
                    reference_bytes=touched * 3 * inter * hidden * 2 + io))
    return out


def cases(device: torch.device, decode_only: bool = False) -> list[OpCase]:
    return linear_cases(device, decode_only) + moe_cases(device, decode_only)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--decode-only", action="store_true", help="only the decode sizes (the GEMV forms)")
    args = parser.parse_args()
    rows = []
    print(f"{'case':<52} {'fp8 ms':>9} {'bf16 ms':>9} {'fp8 TB/s':>9} {'bf16 TB/s':>9} {'speed-up':>8}")
    for case in cases(torch.device("cuda"), args.decode_only):
        fp8_ms, bf16_ms = time_ms(case.kernel), time_ms(case.reference)
        row = {"case": case.name, "fp8_ms": fp8_ms, "bf16_ms": bf16_ms, "fp8_bytes": case.bytes,
               "bf16_bytes": case.reference_bytes, "flops": case.flops,
               "fp8_TBps": case.bytes / fp8_ms / 1e9, "bf16_TBps": case.reference_bytes / bf16_ms / 1e9}
        rows.append(row)
        print(f"{case.name:<52} {fp8_ms:>9.4f} {bf16_ms:>9.4f} {row['fp8_TBps']:>9.2f} {row['bf16_TBps']:>9.2f} "
              f"{bf16_ms / fp8_ms:>7.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": rows}, indent=1))

