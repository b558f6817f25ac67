"""Memory-bound matrix-vector products for decode sizes: the shared inner loop and launch tiles of the dense small-M
linear (`ops.triton.linear`) and the routed experts' decode form (`ops.triton.moe_gemv`).

At a few tokens a step a 16-bit weight is read once and used for a handful of multiply-adds, so what costs is how
many of its bytes are in flight, not arithmetic. Each launch is cut over output columns into about `PROGRAMS`
programs (two per SM of an H200, 132 SMs), each streaming only its rows of the weight. No program pads its tokens to
tl.dot's 16 rows: products are broadcast multiply-adds into a [tokens, columns, K chunk] fp32 register tile of
about `TILE_ELEMENTS`, summed over K once at the end (a reduction per chunk would cost more shuffles than the
multiply-adds). Operands are widened to fp32 before the multiply (a product of two bf16 or fp16 values is exact in
fp32), so results differ from an fp32 reference only by the order of the sum, and are rounded once by the caller.
A loop of several chunks pipelines their loads (cp.async, `PIPELINE_STAGES` deep, twice that for e4m3 rows:
`pipeline_stages`); one chunk (K small against the tile) has every load in flight at once. Every choice is a pure
function of host-known sizes: the same tiles at every CUDA-graph replay, one compiled variant per token-count bucket.

e4m3 weights (`W_SCALES` set, `fp8_args`) are weight-only, as `ops.reference.fp8` defines the decode sizes: the
same loop reads a byte a weight element, widens it to fp32 exactly by integer ops (`e4m3_pairs`) and multiplies it
with x as it is (no quantization), so a projection stays one launch of half the 16-bit bytes. Per-row scales
multiply the sum, 128x128 block scales each K lane's products (gathered a lane, so a chunk spans several blocks in
one tile, the same loop as 16-bit rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridserve.core.quant import Fp8Scales
from hybridserve.ops.triton.fp8_quant import JIT_SCALE_BLOCK, SCALE_BLOCK, block_stride, check_scales, check_scheme
from hybridserve.ops.triton.norm import pending_rstd, pending_sums, rms_normed
from hybridserve.ops.triton.pdl import prefetch_rows, wait_for_previous
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2

PROGRAMS = 256  # programs per launch to aim for: about two per SM of an H200
TILE_ELEMENTS = 8192  # a program's [tokens, columns, K chunk] fp32 product tile: 64 registers a thread at 4 warps
PIPELINE_STAGES = 4  # K chunks in flight per program when its loop has several
E4M3_PIPELINE_STAGES = 2 * PIPELINE_STAGES  # e4m3 rows' depth (`pipeline_stages`)
MAX_COLUMNS = 64  # output columns (weight rows) per program at most: wider tiles give too few programs anyway
MIN_CHUNK = 64  # K lanes of a chunk at least (128 bytes of a 16-bit row): fewer tokens*columns where it would not fit
FP8_MIN_CHUNK = 128  # the same for e4m3 rows (128 bytes), and whole 128-column scale blocks per chunk
# e4m3 rows with 128x128 block scales: two scale blocks a chunk at least (on an H200, Ling-2.6-flash's rows streamed
# about a fifth faster in (32 rows, 256) tiles than in (64, 128)).
FP8_BLOCK_MIN_CHUNK = 256
MIN_PROGRAM_ELEMENTS = 8192  # weight elements a program streams at least (16 KB of bf16): no finer split pays
NUM_WARPS = 4


@dataclass(frozen=True)
class Tiles:
    """Launch tiles of one GEMV launch: BT tokens x BN weight rows per program, K chunks of BK, pipeline depth."""

    BT: int
    BN: int
    BK: int
    STAGES: int
    num_warps: int = NUM_WARPS

    def __post_init__(self):
        for name in ("BT", "BN", "BK"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GEMV tile {name} must be a power of two; got {value}")
        if self.STAGES < 1 or self.num_warps < 1:
            raise ValueError(f"GEMV STAGES and num_warps must be positive; got {self}")


def tiles(tokens: int, rows: int, depth: int, min_rows: int = 1, min_chunk: int = MIN_CHUNK,
          one_chunk: bool = False, stages: int = PIPELINE_STAGES, tile_elements: int = TILE_ELEMENTS) -> Tiles:
    """Tiles for `tokens` tokens against `rows` weight rows of length `depth`: the widest power-of-two BN up to
    MAX_COLUMNS (and keeping a K chunk of `min_chunk`) that still gives cdiv(rows, BN) >= PROGRAMS, but at least
    `min_rows` and the rows of MIN_PROGRAM_ELEMENTS (short rows: fewer, fuller programs); a K chunk filling
    `tile_elements` (TILE_ELEMENTS unless given less). Tokens count by the next power of two (BT), so the warm-up's
    power-of-two ladder compiles every variant a run needs, and a decode batch padded to its CUDA-graph size keeps
    the tiles, hence the sums, of the eager step. `one_chunk`: those least rows with the whole K in one chunk
    instead, where a tile of `tile_elements` holds them (one token of 2048-long rows: 4), so that every load of a
    program is in flight at once (`dot_rows` can then issue them before the PDL wait): more, thinner programs.
    `stages`: the pipeline's depth where the K loop has several chunks."""
    bt = next_power_of_2(max(tokens, 1))
    least = max(min_rows, next_power_of_2(cdiv(MIN_PROGRAM_ELEMENTS, depth)))
    if one_chunk and least <= MAX_COLUMNS and bt * least * next_power_of_2(depth) <= tile_elements:
        return Tiles(bt, least, next_power_of_2(depth), 1)
    widest = min(MAX_COLUMNS, tile_elements // (bt * min_chunk))
    bn = max(min_rows, min(widest, least))
    while 2 * bn <= widest and cdiv(rows, 2 * bn) >= PROGRAMS:
        bn *= 2
    bk = min(max(min_chunk, tile_elements // (bt * bn)), next_power_of_2(depth))
    return Tiles(bt, bn, bk, stages if bk < depth else 1)


def min_chunk(fp8: Fp8Scales | None) -> int:
    """The least K chunk of `tiles` for a weight of these FP8 scales (None: 16-bit)."""
    if fp8 is None:
        return MIN_CHUNK
    return FP8_BLOCK_MIN_CHUNK if fp8.scheme.weight == "block" else FP8_MIN_CHUNK


def pipeline_stages(fp8: Fp8Scales | None) -> int:
    """The pipeline depth of `tiles` for a weight of these FP8 scales (None: 16-bit), the experts' and the linears'.
    e4m3 twice as deep: a chunk is sized in elements, so an e4m3 one is half a 16-bit one's bytes, and twice the
    stages keep a program's bytes in flight. On an H100 (one token, docs/performance.md) Ling-2.6-flash's 8
    block-scaled experts a token streamed 13% faster in the micro and its 16-layer batch-1 decode ran 8.5% faster
    (32 x 256, 8 stages); ZAYA1-8B's FP8 batch 1 was level at 6 stages of its 16 x 512 and at 8 of Ling's 32 x 256.
    8 stages of 8 KB take about 64 KB of shared memory a program. The linears take it for one token's pipelined
    e4m3 rows only, in half-sized tiles (`linear.linear_tiles`)."""
    return PIPELINE_STAGES if fp8 is None else E4M3_PIPELINE_STAGES


X_SHIFT = tl.constexpr(2.0 ** 64)  # x's factor on the word path (its words widen to 2^-120 of their value)
SUM_SHIFT = tl.constexpr(2.0 ** 56)  # the sum's, with the scales: X_SHIFT * SUM_SHIFT = 2^120
NO_ROW = tl.constexpr(2 ** 31 - 1)  # `_block_scales`' lowest kept row where none is kept


@triton.jit
def e4m3_pairs(words):
    """Four e4m3 values of each 32-bit word as fp32 bit patterns of 2^-120 times their value, exactly, in integer
    ops on bf16 pairs: byte b's sign and 7 exponent|mantissa bits placed where bf16 keeps them make a bf16 of 2^-120
    times the e4m3 value (same exponent range as fp32, so e4m3 subnormals become subnormals, exactly). Bytes 0 and 2
    need the same shifts for their bf16 lanes, bytes 1 and 3 too, so a word is two bf16 pairs in 7 ops, and a pair
    splits into its two fp32 values in one op each: 11 integer ops for 4 values, against the GPU's conversion
    through fp16 (two instructions a value on a pipe of 16 a clock per SM, about 3 TB/s of e4m3 a GEMV)."""
    even = ((words << 4) & 0x07F007F0) | ((words << 8) & 0x80008000)  # bytes 2 | 0
    odd = ((words >> 4) & 0x07F007F0) | (words & 0x80008000)  # bytes 3 | 1
    high = 0xFFFF0000
    return ((even << 16).to(tl.float32, bitcast=True), (odd << 16).to(tl.float32, bitcast=True),
            (even & high).to(tl.float32, bitcast=True), (odd & high).to(tl.float32, bitcast=True))


@triton.jit
def _x_loads(x_ptrs, mask, offsets, x_norm, NORM_BLOCK: tl.constexpr):
    """(x at `x_ptrs` as fp32, with NORM_BLOCK the norm weight at `offsets` (the K offsets, [1, chunk]) as fp32):
    the loads `_x_made` takes."""
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    w = 1.0
    if NORM_BLOCK > 0:
        w = tl.load(x_norm[1] + offsets, mask=mask, other=0.0).to(tl.float32)
    return x, w


@triton.jit
def _word_lanes(quads):
    """The 4 [BT, LANES] tensors of `quads` [BT, LANES, 2, 2] (x at 4 * word + 2a + b) by byte lane 2a + b. x is
    loaded so, 4 contiguous values a word: the loads are then vectors of 2 at least, which the pipelined loop turns
    into cp.async with the weights'; loaded a byte lane at a time (stride 4) they were 16-bit loads that it cannot,
    issued after each chunk's wait (an L2 round trip a chunk on the critical path)."""
    even, odd = tl.split(quads)
    return tl.split(even)[0], tl.split(odd)[0], tl.split(even)[1], tl.split(odd)[1]


@triton.jit
def _x_rstd(x_norm, K, BK: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """The tokens' rstd [BT] of a PendingNorm x (`x_norm`: (the partial sums, the norm weight's pointer, eps, rstd
    summed before the loop)): where the product is one chunk (BK >= K) summed here, after the chunk's x loads were
    issued (before them, the sum's barrier would hold them back a round trip: no load moves across it); a loop of
    chunks sums it once, before the loop. 1.0 (unused) without NORM_BLOCK."""
    rstd = 1.0
    if NORM_BLOCK > 0:
        if BK >= K:
            rstd = pending_rstd(x_norm[0], K, x_norm[2])
        else:
            rstd = x_norm[3]
    return rstd


@triton.jit
def _x_made(loaded, rstd, x_norm, NORM_BLOCK: tl.constexpr):
    """x of `_x_loads` as the products take it; with NORM_BLOCK, x is a PendingNorm's fp32 residual and this is its
    h (rstd [BT], `_x_rstd`; `x_norm` as there), as `norm.residual_norm_rows` rounds it."""
    x, w = loaded
    if NORM_BLOCK > 0:
        x = rms_normed(x, rstd, w, x_norm[1].dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _k_mask(ok, k, K, EVEN_K: tl.constexpr):
    """The load mask of a chunk's rows [rows, chunk] (weight rows or x rows, `ok` per row) at K offsets `k`:
    without the K bound where no chunk runs past it (EVEN_K), a compare and select fewer per element."""
    if EVEN_K:
        mask = ok[:, None]
    else:
        mask = ok[:, None] & (k < K)[None, :]
    return mask


@triton.jit
def _chunk_offsets(k0, LANES: tl.constexpr, WORDS: tl.constexpr):
    """The K offsets [LANES] a chunk at k0 is read at: 32-bit word indices (WORDS: 16-byte loads of e4m3 rows), else
    element indices."""
    if WORDS:
        offsets = tl.multiple_of(k0 // 4, LANES) + tl.arange(0, LANES)
    else:
        offsets = k0 + tl.arange(0, LANES)
    return offsets


@triton.jit
def _block_scales(ws_ptr, rows, row_ok, stride_ws, k0, K, LANES: tl.constexpr, WORDS: tl.constexpr,
                  ROW_BLOCKS: tl.constexpr):
    """The 128x128 block scales of `rows` at each K lane of the chunk at k0 ([BN, LANES], or [1, LANES] for rows of
    one row block, ROW_BLOCKS 1); 0 past K (those weights are masked zeros). Rows of one or two blocks load a scale
    a lane from the lowest row's block and the highest's, instead of one a row and lane: the lowest and highest of
    the rows `row_ok` keeps, and none where it keeps none (the experts' dead pair, `moe_gemv._weighted_down`, which
    masks its loads off: its expert's scales are not read, as its weights are not)."""
    offsets = _chunk_offsets(k0, LANES, WORDS)
    kb = offsets // (JIT_SCALE_BLOCK // 4 if WORDS else JIT_SCALE_BLOCK)
    k_ok = offsets < (K // 4 if WORDS else K)
    if ROW_BLOCKS == 0:
        scale = tl.load(ws_ptr + (rows // JIT_SCALE_BLOCK)[:, None] * stride_ws + kb[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    else:
        first = tl.min(tl.where(row_ok, rows, NO_ROW))
        some = first != NO_ROW  # (tl.where, not &: the interpreter cannot AND a mask with a scalar)
        low = tl.where(some, first, 0) // JIT_SCALE_BLOCK
        read = tl.where(some, k_ok, False)
        scale = tl.load(ws_ptr + low * stride_ws + kb, mask=read, other=0.0)[None, :]
        if ROW_BLOCKS == 2:
            high = tl.max(tl.where(row_ok, rows, 0)) // JIT_SCALE_BLOCK
            high = tl.load(ws_ptr + high * stride_ws + kb, mask=read, other=0.0)
            scale = tl.where((rows // JIT_SCALE_BLOCK == low)[:, None], scale, high[None, :])
    return scale


@triton.jit
def _weight_chunk(w_rows, w_words, row_ok, k0, K, LANES: tl.constexpr, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """The raw weights of `rows` at K offset k0 as `dot_rows` reads them: [BN, LANES] elements, or [BN, LANES]
    32-bit words of 4 e4m3 values (WORDS)."""
    offsets = _chunk_offsets(k0, LANES, WORDS)
    if WORDS:
        raw = tl.load(w_words + offsets[None, :], mask=_k_mask(row_ok, offsets, K // 4, EVEN_K), other=0)
    else:
        raw = tl.load(w_rows + offsets[None, :], mask=_k_mask(row_ok, offsets, K, EVEN_K), other=0.0)
    return raw


@triton.jit
def _chunk_products(raw, x_rows, token_ok, k0, K, scale, x_norm, BK: tl.constexpr, LANES: tl.constexpr,
                    WORDS: tl.constexpr, EVEN_K: tl.constexpr, W_SCALES: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """[BT, BN, LANES] fp32 products of the tokens' x (`_x_loads`, `_x_made`) at K offset k0 with the chunk's raw
    weights (`_weight_chunk`), times their block scales where W_SCALES is "block" (`_block_scales`); a PendingNorm
    x's rstd comes after the x loads (`_x_rstd`)."""
    offsets = _chunk_offsets(k0, LANES, WORDS)
    if WORDS:
        x_ok = _k_mask(token_ok, offsets, K // 4, EVEN_K)[:, :, None, None]
        pair = tl.arange(0, 2)
        quads = 4 * offsets[None, :, None, None] + 2 * pair[None, None, :, None] + pair[None, None, None, :]
        x, w = _x_loads(x_rows[:, :, None, None] + quads, x_ok, quads, x_norm, NORM_BLOCK)
        xs = _word_lanes(x)
        ws = _word_lanes(w) if NORM_BLOCK > 0 else (w, w, w, w)
        rstd = _x_rstd(x_norm, K, BK, NORM_BLOCK)
        lanes = e4m3_pairs(raw)
        # x times X_SHIFT (exact: a power of two, for |x| < 2^64), the word path's half of 2^120
        piece = (_x_made((xs[0], ws[0]), rstd, x_norm, NORM_BLOCK) * X_SHIFT)[:, None, :] * lanes[0][None, :, :]
        for lane in tl.static_range(1, 4):
            piece += ((_x_made((xs[lane], ws[lane]), rstd, x_norm, NORM_BLOCK) * X_SHIFT)[:, None, :]
                      * lanes[lane][None, :, :])
        if W_SCALES == "block":
            piece = piece * (scale * SUM_SHIFT)[None, :, :]
    else:
        x_ok = _k_mask(token_ok, offsets, K, EVEN_K)
        loaded = _x_loads(x_rows + offsets[None, :], x_ok, offsets[None, :], x_norm, NORM_BLOCK)
        x = _x_made(loaded, _x_rstd(x_norm, K, BK, NORM_BLOCK), x_norm, NORM_BLOCK)
        w = raw.to(tl.float32)
        if W_SCALES == "block":
            w = w * scale
        piece = x[:, None, :] * w[None, :, :]
    return piece


@triton.jit
def dot_rows(x_ptr, stride_x, tokens, token_ok, w_ptr, stride_w, rows, row_ok, ws_ptr, stride_ws, K: tl.constexpr,
             BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, W_SCALES: tl.constexpr,
             ROW_BLOCKS: tl.constexpr = 0, WAIT: tl.constexpr = False, pending=None, NORM_BLOCK: tl.constexpr = 0):
    """[BT, BN] fp32: sum over k < K of x[tokens, k] * w[rows, k] (rows `stride_x` / `stride_w` apart, unit K
    stride; masked tokens and rows give 0), products in fp32 accumulated per K lane and summed once at the end.

    W_SCALES: "" for a 16-bit w; for an e4m3 w its scales, "row" (ws_ptr[row] on the sum) or "block"
    (ws_ptr[row // 128 * stride_ws + k // 128] on each K lane's products: a chunk of several blocks is one tile,
    whose weights, x and scales the loop's pipeline streams as it does 16-bit rows'). e4m3 rows
    whose length and stride are multiples of 4 are read as 32-bit words, 4 values each (`e4m3_pairs`, 2^-120 of
    their value), multiplied with the x values 4 apart that match each byte lane times X_SHIFT, and the 4 products'
    sum of a word scaled once: by its block scale times SUM_SHIFT, or (row scales) the whole sum by the row's. So
    the only fp32 work a weight takes is its multiply-add; x's dynamic range on this path is |x| < 2^64. x is loaded
    4 values a word (`_word_lanes`), in the loop's cp.async pipeline.
    ROW_BLOCKS (block scales): how many 128-row scale blocks `rows` fall in, 1 or 2 (a scale or two a lane, from
    the lowest and highest row `row_ok` keeps; none read where it keeps none), or 0 (any: a scale a row).

    WAIT (programmatic dependent launch, ops/triton/pdl.py): x is the kernel before's output, w is no kernel's, so
    the weights' stream starts before `wait_for_previous`: a tile of one chunk (the common decode shape) is loaded
    into registers, streaming in while the kernel before finishes; a longer one has its first bytes asked of L2
    (`pdl.prefetch_rows`).

    NORM_BLOCK > 0: x is a PendingNorm's fp32 residual (ops/norm.py) and the product is taken with its h, made here
    (`norm.rms_normed`): `pending` = (its sums of squares' pointer and row stride, their count a row (at most
    NORM_BLOCK, a power of two), the norm weight's pointer, the norm's eps); the partial sums are loaded after the
    wait, and summed into the tokens' rstd after the x loads where the product is one chunk (one round trip after
    the wait, not two), else once before the loop (`_x_rstd`)."""
    WORDS: tl.constexpr = W_SCALES != "" and K % 4 == 0 and stride_w % 4 == 0 and BK % 4 == 0
    LANES: tl.constexpr = BK // 4 if WORDS else BK
    EVEN_K: tl.constexpr = K % BK == 0  # no chunk runs past K: the loads need only the row / token masks
    PRELOAD: tl.constexpr = WAIT and BK >= K
    acc = tl.zeros((BT, BN, LANES), dtype=tl.float32)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    w_words = w_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + rows.to(tl.int64)[:, None] * (stride_w // 4)
    # Scales are weights too, loaded before the wait: the row scales' load would otherwise go out only after the
    # sum (the compiler moves no load across its reduction's barrier), an L2 round trip of its own.
    if W_SCALES == "row":
        row_scale = tl.load(ws_ptr + rows, mask=row_ok, other=0.0)
    if PRELOAD:
        start = tl.full((), 0, tl.int32)  # (a tensor, as the loop's K offsets: `tl.multiple_of` hints it)
        first = _weight_chunk(w_rows, w_words, row_ok, start, K, LANES, WORDS, EVEN_K)
        if W_SCALES == "block":
            first_scale = _block_scales(ws_ptr, rows, row_ok, stride_ws, start, K, LANES, WORDS, ROW_BLOCKS)
    elif WAIT:
        prefetch_rows(w_ptr, rows, row_ok, stride_w, K)
    wait_for_previous(WAIT)
    x_norm = None
    if NORM_BLOCK > 0:
        sums_ptr, sums_s0, parts, nw_ptr, eps = pending
        sums = pending_sums(sums_ptr, sums_s0, parts, tokens, token_ok, NORM_BLOCK)
        rstd = 1.0  # (a one-chunk product sums it after its x loads: `_x_rstd`)
        if BK < K:
            rstd = pending_rstd(sums, K, eps)
        x_norm = (sums, nw_ptr, eps, rstd)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        scale = 1.0
        if PRELOAD:
            raw = first
            if W_SCALES == "block":
                scale = first_scale
        else:
            raw = _weight_chunk(w_rows, w_words, row_ok, k0, K, LANES, WORDS, EVEN_K)
            if W_SCALES == "block":
                scale = _block_scales(ws_ptr, rows, row_ok, stride_ws, k0, K, LANES, WORDS, ROW_BLOCKS)
        acc += _chunk_products(raw, x_rows, token_ok, k0, K, scale, x_norm, BK, LANES, WORDS, EVEN_K, W_SCALES,
                               NORM_BLOCK)
    out = tl.sum(acc, axis=2)
    if W_SCALES == "row":
        scale = row_scale
        if WORDS:
            scale = scale * SUM_SHIFT
        out = out * scale[None, :]
    return out


def fp8_args(fp8: Fp8Scales | None, weight: torch.Tensor, tiles: Tiles, row_blocks: int = 0) -> tuple[tuple, dict]:
    """`dot_rows`' FP8 arguments for `weight` ([..., N, K]) launched with `tiles`: (weight scales, their stride
    between 128-row blocks) and the W_SCALES and ROW_BLOCKS constexprs (`row_blocks`: how many 128-row scale
    blocks a program's rows fall in, as `consecutive_row_blocks` says, 0 if unknown); for a 16-bit weight (`fp8`
    None) unread placeholders and W_SCALES = ''."""
    if fp8 is None:
        return (weight, 0), {"W_SCALES": "", "ROW_BLOCKS": 0}
    check_scheme(fp8.scheme, fp8.input_scale)
    check_scales(weight, fp8.scale, fp8.scheme)
    if fp8.scheme.weight == "block" and tiles.BK < min(SCALE_BLOCK, weight.shape[-1]):
        raise ValueError(f"GEMV tiles {tiles} split the {SCALE_BLOCK}-column scale blocks of an FP8 weight")
    block = fp8.scheme.weight == "block"
    return (fp8.scale, block_stride(fp8.scale, fp8.scheme)), {"W_SCALES": "block" if block else "row",
                                                              "ROW_BLOCKS": row_blocks if block else 0}


def consecutive_row_blocks(rows: int) -> int:
    """ROW_BLOCKS of programs that each take `rows` consecutive weight rows from a multiple of `rows`: one 128-row
    scale block (a power of two up to 128 never straddles two), else unknown (0)."""
    return 1 if rows <= SCALE_BLOCK else 0
