"""The unsorted inverse-CDF draw (`ops.reference.sampling.draw_unsorted`) in three launches.

The reference inverts each row's CDF in two levels (blocks of CDF_BLOCK entries, then one block's entries). Here
the same blocks are the programs' tiles: (1) each block's maximum of logits / temperature; (2) each block's kept
mass, exp(x - row max) summed in float64 over the entries that pass min-p; (3) one program per row scans the block
masses, finds the block that holds u * total and scans that block's entries. The unnormalised masses invert the
same CDF as the reference's softmax (its probabilities are these divided by the row's sum, and min-p's test
p >= min_p * p_max is exp(x - max) >= min_p), so the picks agree up to rounding at a CDF step's edge; the clamps
keep a pick on a kept entry as the reference's do. A row of the batch never reads another row. `draw_params` rows
hold 5 values (temperature, top-k, top-p, min-p, u), read by offset; the kernels' argument is not named `params`,
which Triton's launcher uses for its own binding (a kernel argument of that name fails to launch on the GPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.ops.reference.sampling import CDF_BLOCK
from hybridserve.ops.triton import pdl
from hybridserve.ops.triton.pdl import wait_for_previous
from hybridserve.ops.triton.sizes import cdiv, next_power_of_2


@triton.jit
def _tempered(logits, draw_params, row, offsets, vocab, logits_stride):
    temperature = tl.load(draw_params + row * 5).to(tl.float32)
    x = tl.load(logits + row * logits_stride + offsets, mask=offsets < vocab, other=float("-inf"))
    return x / temperature


@triton.jit
def _row_max(block_max, row, blocks, BLOCKS_P2: tl.constexpr):
    index = tl.arange(0, BLOCKS_P2)
    return tl.max(tl.load(block_max + row * blocks + index, mask=index < blocks, other=float("-inf")), axis=0)


@triton.jit
def _kept(tempered, min_p, row_max, offsets, vocab):
    """exp(x - row max) of the `_tempered` entries at `offsets`, 0 where min-p (or the padding) drops them."""
    weight = tl.exp(tempered - row_max)
    return tl.where((weight >= min_p) & (offsets < vocab), weight, 0.0)


@triton.jit
def _block_max_kernel(logits, draw_params, block_max, vocab, logits_stride, blocks, BLOCK: tl.constexpr,
                      USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    tl.store(block_max + row * blocks + block,
             tl.max(_tempered(logits, draw_params, row, offsets, vocab, logits_stride), axis=0))


@triton.jit
def _block_mass_kernel(logits, draw_params, block_max, block_mass, vocab, logits_stride, blocks,
                       BLOCK: tl.constexpr, BLOCKS_P2: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    # The logits and draw_params are the block maxima's inputs, a launch further back: before the wait (after the
    # maxima's reduction they would be an L2 round trip of their own).
    tempered = _tempered(logits, draw_params, row, offsets, vocab, logits_stride)
    min_p = tl.load(draw_params + row * 5 + 3).to(tl.float32)
    wait_for_previous(USE_PDL)
    weight = _kept(tempered, min_p, _row_max(block_max, row, blocks, BLOCKS_P2), offsets, vocab)
    tl.store(block_mass + row * blocks + block, tl.sum(weight.to(tl.float64), axis=0))


@triton.jit
def _pick_kernel(logits, draw_params, block_max, block_mass, out, vocab, logits_stride, blocks,
                 BLOCK: tl.constexpr, BLOCKS_P2: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, BLOCKS_P2)
    # Before the wait: all but the block masses (the launch before) and the picked block's logits (known after).
    u = tl.load(draw_params + row * 5 + 4)
    min_p = tl.load(draw_params + row * 5 + 3).to(tl.float32)
    row_max = _row_max(block_max, row, blocks, BLOCKS_P2)
    wait_for_previous(USE_PDL)
    mass = tl.load(block_mass + row * blocks + index, mask=index < blocks, other=0.0)
    cdf = tl.cumsum(mass, axis=0)
    target = u * tl.max(cdf, axis=0)
    # The first block whose CDF exceeds the target (searchsorted, right), never past the last block with mass.
    block = tl.sum(((cdf <= target) & (index < blocks)).to(tl.int32), axis=0)
    block = tl.minimum(block, tl.max(tl.where(mass > 0, index, 0), axis=0))
    before = tl.sum(tl.where(index == block, cdf - mass, 0.0), axis=0)
    entry = tl.arange(0, BLOCK)
    weight = _kept(_tempered(logits, draw_params, row, block * BLOCK + entry, vocab, logits_stride), min_p, row_max,
                   block * BLOCK + entry, vocab)
    entry_cdf = tl.cumsum(weight.to(tl.float64), axis=0) + before
    chosen = tl.sum((entry_cdf <= target).to(tl.int32), axis=0)
    chosen = tl.minimum(chosen, tl.max(tl.where(weight > 0, entry, 0), axis=0))
    tl.store(out + row, (block * BLOCK + chosen).to(tl.int64))


def draw_unsorted(logits: torch.Tensor, draw_params: torch.Tensor) -> torch.Tensor:
    """fp32 logits [rows, V], float64 draw_params [rows, 5] -> token ids [rows] int64; see `ops.sampling`."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    draw_params = draw_params.to(torch.float64).contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    blocks = cdiv(vocab, CDF_BLOCK)
    block_max = torch.empty(rows, blocks, dtype=torch.float32, device=logits.device)
    block_mass = torch.empty(rows, blocks, dtype=torch.float64, device=logits.device)
    common = dict(BLOCK=CDF_BLOCK, **pdl.launch(logits.device))
    shape = (vocab, logits.stride(0), blocks)
    _block_max_kernel[(rows, blocks)](logits, draw_params, block_max, *shape, num_warps=4, **common)
    blocks_p2 = next_power_of_2(blocks)
    _block_mass_kernel[(rows, blocks)](logits, draw_params, block_max, block_mass, *shape, BLOCKS_P2=blocks_p2,
                                       num_warps=4, **common)
    _pick_kernel[(rows,)](logits, draw_params, block_max, block_mass, out, *shape, BLOCKS_P2=blocks_p2,
                          num_warps=8, **common)
    return out
