"""Linear layers with e4m3 weights on CUDA: `ops.reference.fp8.fp8_linear`'s product, in three forms chosen by the
host-known token count (no device->host sync, grids from sizes only: CUDA-graph capturable).

- One to `linear.E4M3_GEMV_MAX_TOKENS` tokens, weight-only: the GEMV launch of `ops.triton.linear`, which streams
  each e4m3 weight byte once and multiplies it, widened to fp32, with x as it is: one launch a projection, half
  the bytes of a 16-bit one.
- Up to `core.quant.WEIGHT_ONLY_MAX_ROWS` tokens, still weight-only: the tiled GEMM below with x as it is (16-bit
  tensor-core tl.dot, each e4m3 weight tile widened to x's dtype, exactly). The GEMV's product tile holds every
  token, so its rows per program shrink as tokens grow and each program re-reads all of x for a few KB of weights:
  at 16 tokens Ling-2.6-flash's Q|K|V|G took 30x its one-token time; a tl.dot tile reads x once per 128 weight rows.
- Otherwise W8A8 in two launches: `fp8_quant.quantize_activations` (e4m3 x and its scales), then the same GEMM of
  e4m3 tl.dot products (Hopper's FP8 tensor cores).

The GEMM accumulates in fp32 (`scaled_dot`): each BLOCK_K tile's dot starts from zero and is added to the fp32
accumulator, because the FP8 MMA keeps fewer bits than fp32 while it accumulates (DeepSeek-V3 adds to fp32 every
128 products for that reason); the tile's block scales (weight blocks, activation groups) multiply it there,
per-row, per-token and static scales the sum, then the bias in fp32 and one rounding to x's dtype.

The e4m3 values are the reference's bit for bit (`ops.triton.fp8_quant`); results differ from it by the fp32 sum
order and where the scales multiply, then one rounding each.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.core.quant import WEIGHT_ONLY_MAX_ROWS, Fp8Scales, Fp8Scheme, linear_weight_only
from hybridserve.ops.triton import linear, pdl
from hybridserve.ops.triton.fp8_quant import JIT_SCALE_BLOCK, SCALE_BLOCK, block_stride, check_scales, check_scheme, \
    constexprs, group_stride, quantize_activations
from hybridserve.ops.triton.moe import grouped_tile
from hybridserve.ops.triton.pdl import wait_for_previous
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2

assert linear.E4M3_GEMV_MAX_TOKENS <= min(WEIGHT_ONLY_MAX_ROWS, linear.MAX_TOKENS), "the GEMV's rows are weight-only"
_TARGET_PROGRAMS = 128  # GEMM programs to aim for at decode-like sizes: about one per H200 SM
# The widest column tile of the weight-only form (x unquantized: the decode sizes). On an H100
# (`python -m benchmarks.ops tune-fp8-linear`, 3-16 tokens, block scales), us a call at BLOCK_N 16 / 32 / 64 / 128:
# Ling-2.6-flash's Q|K|V|G (16384 rows) - / 32.3 / 33.0 / 44.2, dense gate|up (18432) - / 40.7 / 44.0 / 59.4, dense
# down (4096) 35.0 / 32.1 / 51.8 / -, shared gate|up (2048) 12.9 / 14.6 / 23.3 / 39.9
_WEIGHT_ONLY_MAX_BLOCK_N = 32
_MIN_BLOCK_K = 32  # the K step of an e4m3 MMA
_COUNTS = ("GROUP_M", "num_warps", "num_stages")


@triton.jit
def scaled_dot(a_ptr, a_rows, a_ok, xs_ptr, stride_xs, w_ptr, w_rows, w_ok, ws_ptr, stride_ws, K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr,
               W_BLOCK: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32: rows `a_rows` of the e4m3 activations a [., K] times rows `w_rows` of the e4m3
    weight w [., K], both scaled: activation scales at xs_ptr ([rows] "token", [rows, stride_xs] "group", 0-d
    "static"; ACT "": a is 16-bit or fp32 x as it is, unscaled, and each weight tile is widened to its dtype,
    exactly), weight scales at ws_ptr (per row, or W_BLOCK: [row // 128, stride_ws] blocks; BLOCK_K then divides
    128). Rows outside a_ok / w_ok give 0."""
    k = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + a_rows.to(tl.int64)[:, None] * K + k[None, :]
    w_tile = w_ptr + w_rows.to(tl.int64)[None, :] * K + k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k < K - k0
        a = tl.load(a_tile, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_tile, mask=k_ok[:, None] & w_ok[None, :], other=0.0)
        if ACT == "":  # weight-only: an fp32 x keeps fp32 products (no TF32 rounding of its mantissa)
            part = tl.dot(a, w.to(a.dtype), input_precision="ieee")
        else:
            part = tl.dot(a, w)  # from zero: the MMA's own accumulation spans one tile
        if W_BLOCK:
            scale = tl.load(ws_ptr + (w_rows // JIT_SCALE_BLOCK) * stride_ws + k0 // JIT_SCALE_BLOCK, mask=w_ok,
                            other=0.0)[None, :]
            if ACT == "group":
                scale = scale * tl.load(xs_ptr + a_rows * stride_xs + k0 // JIT_SCALE_BLOCK, mask=a_ok,
                                        other=0.0)[:, None]
            part = part * scale
        acc += part
        a_tile += BLOCK_K
        w_tile += BLOCK_K
    if ACT == "token":
        acc = acc * tl.load(xs_ptr + a_rows, mask=a_ok, other=0.0)[:, None]
    if ACT == "static":
        acc = acc * tl.load(xs_ptr)
    if not W_BLOCK:
        acc = acc * tl.load(ws_ptr + w_rows, mask=w_ok, other=0.0)[None, :]
    return acc


@triton.jit(do_not_specialize=["tokens"])
def _gemm_kernel(q_ptr, xs_ptr, stride_xs, w_ptr, ws_ptr, stride_ws, b_ptr, out_ptr, tokens, n, stride_o,
                 K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, ACT: tl.constexpr, W_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of out = q @ w^T, scaled (`scaled_dot`), + b, rounded to out's dtype."""
    wait_for_previous(USE_PDL)
    block, tile = grouped_tile(tl.program_id(0), tl.cdiv(tokens, BLOCK_M), tl.cdiv(n, BLOCK_N), GROUP_M)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < tokens, cols < n
    acc = scaled_dot(q_ptr, rows, row_ok, xs_ptr, stride_xs, w_ptr, cols, col_ok, ws_ptr, stride_ws, K, BLOCK_M,
                     BLOCK_N, BLOCK_K, ACT, W_BLOCK)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def check_tiles(config: dict, scheme: Fp8Scheme) -> dict[str, int]:
    """`config` if its tiles suit `scaled_dot`: positive integers, power-of-two blocks of at least 16 rows and
    columns and a BLOCK_K of whole e4m3 MMA steps (32) that, with block scales, divides their 128 columns (a K tile
    then lies in one block); else a clear error."""
    blocks = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
    widest_k = SCALE_BLOCK if scheme.weight == "block" else 1 << 30
    if not all(type(config.get(key)) is int and config[key] > 0 for key in (*blocks, *_COUNTS)) \
            or any(config[key] & (config[key] - 1) or config[key] < 16 for key in blocks) \
            or not _MIN_BLOCK_K <= config["BLOCK_K"] <= widest_k:
        raise ValueError(f"FP8 GEMM config: {', '.join(blocks)} powers of two >= 16, BLOCK_K from "
                         f"{_MIN_BLOCK_K}{f' to {SCALE_BLOCK}' if widest_k == SCALE_BLOCK else ''}, and positive "
                         f"{', '.join(_COUNTS)} needed; got {config}")
    return config


def gemm_config(tokens: int, n: int, weight_only: bool = False) -> dict[str, int]:
    """Tiles by token count: up to 64 tokens the weight streams (memory bound), so one row block takes every token
    and the column tiles narrow (down to 16) until about `_TARGET_PROGRAMS` programs read it, from 128 columns (W8A8)
    or `_WEIGHT_ONLY_MAX_BLOCK_N` (`weight_only`: the form `gemm` takes x unquantized in); beyond, 128 x 128 tiles,
    GROUP_M row blocks sharing each weight tile in L2."""
    if tokens > 64:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)
    block_n = _WEIGHT_ONLY_MAX_BLOCK_N if weight_only else 128
    while block_n > 16 and cdiv(n, block_n) < _TARGET_PROGRAMS:
        block_n //= 2
    return dict(BLOCK_M=max(16, next_power_of_2(tokens)), BLOCK_N=block_n, BLOCK_K=128, GROUP_M=1, num_warps=4,
                num_stages=4)


def launch_args(tiles: dict[str, int], scheme: Fp8Scheme, device: torch.device, weight_only: bool = False) -> dict:
    """The keyword arguments of a `scaled_dot` GEMM launch: its tiles, the scheme's constexprs (`weight_only`: x
    unquantized, ACT ""), PDL."""
    kinds = constexprs(scheme) | ({"ACT": ""} if weight_only else {})
    return dict(BLOCK_M=tiles["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"], BLOCK_K=tiles["BLOCK_K"], GROUP_M=tiles["GROUP_M"],
                **kinds, num_warps=tiles["num_warps"], num_stages=tiles["num_stages"], **pdl.launch(device))


def takes_gemv(x: torch.Tensor) -> bool:
    """Whether the GEMV form runs x [..., K]: at most `linear.E4M3_GEMV_MAX_TOKENS` rows (host sizes only)."""
    return x.numel() <= linear.E4M3_GEMV_MAX_TOKENS * x.shape[-1]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K] (e4m3, `scale` per row or block)^T (+ bias [N]) -> [..., N] in x's dtype, x
    quantized per `scheme` beyond the decode sizes (`input_scale`: the static scheme's 0-d scale):
    `ops.reference.fp8.fp8_linear`."""
    fp8 = Fp8Scales(scale, scheme, input_scale)
    if takes_gemv(x):
        return linear.linear(x if x.stride(-1) == 1 else x.contiguous(), weight, bias, fp8=fp8)
    return gemm(x, weight, fp8, bias, weight_only=linear_weight_only(x))


def gemm(x: torch.Tensor, weight: torch.Tensor, fp8: Fp8Scales, bias: torch.Tensor | None = None,
         config: dict[str, int] | None = None, weight_only: bool = False) -> torch.Tensor:
    """The GEMM form of `fp8_linear` for any token count, x quantized per the scheme (W8A8) or, `weight_only`,
    taken as it is; `config` overrides `gemm_config` (tests, tuning)."""
    n, k = weight.shape
    scheme = fp8.scheme
    check_scheme(scheme, fp8.input_scale)
    check_scales(weight, fp8.scale, scheme)
    if x.shape[-1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"FP8 linear: x {tuple(x.shape)}, bias {None if bias is None else tuple(bias.shape)} do "
                         f"not match a weight [{n}, {k}]")
    flat = x.reshape(-1, k)
    tokens = flat.shape[0]
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if tokens:
        tiles = check_tiles(config or gemm_config(tokens, n, weight_only), scheme)
        if weight_only:  # x itself, rows K apart (scaled_dot's layout), no activation scales
            q, x_scales = flat.contiguous(), flat
        else:
            q, x_scales = quantize_activations(flat, scheme, fp8.input_scale)
        grid = (cdiv(tokens, tiles["BLOCK_M"]) * cdiv(n, tiles["BLOCK_N"]),)
        _gemm_kernel[grid](
            q, x_scales, group_stride(x_scales), weight, fp8.scale,
            block_stride(fp8.scale, scheme), bias if bias is not None else weight, out, tokens, n, out.stride(0), K=k,
            HAS_BIAS=bias is not None, **launch_args(tiles, scheme, x.device, weight_only))
    return out.view(*x.shape[:-1], n)
