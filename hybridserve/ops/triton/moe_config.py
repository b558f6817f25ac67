"""Launch configurations of the fused-MoE kernels (`ops.triton.moe`): tuned tables or a heuristic.

A table is a JSON file in `moe_configs/` per (experts E, local intermediate N, hidden H, dtype, device name),
written by `python -m benchmarks.ops tune-moe`: token count -> {BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps,
num_stages, SPLIT_K_UP, SPLIT_K_DOWN}. The SPLIT_K keys are optional (an entry without them means 1: the unsplit
kernels). A call takes the entry of the nearest tuned token count; shapes without a table (another model, another TP
degree, another GPU) use `heuristic_config`. The choice is a pure function of host-known sizes, so a captured CUDA
graph always replays the configuration it was captured with.

BLOCK_N is the width of an output tile in both GEMMs: the gate/up GEMM computes BLOCK_N / 2 gate columns and the
matching BLOCK_N / 2 up columns (BLOCK_N / 2 intermediate columns); the down GEMM BLOCK_N hidden columns.
SPLIT_K_UP / SPLIT_K_DOWN > 1 split the reduction dimension of the gate/up (H) / down (I) GEMM into that many
programs per output tile (fp32 partial sums, then one reduce launch for that GEMM that sums them in a fixed order and
applies its epilogue): more programs, and more weight bytes in flight, when decode batches give too few output tiles
to fill the GPU.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SPLIT_K_UP", "SPLIT_K_DOWN")
OPTIONAL = {"SPLIT_K_UP": 1, "SPLIT_K_DOWN": 1}  # keys a table entry may leave out, and what that means
MAX_SPLIT_K = 16
CONFIG_DIR = Path(__file__).with_name("moe_configs")
_TARGET_PROGRAMS = 256  # about two per SM on an H100/H200: enough tiles in flight to stream the weights
_MIN_SPLIT_TILES = 4  # K tiles per split at least: a shorter pipeline does not pay for its fp32 partial sums


def config_file_name(experts: int, intermediate: int, hidden: int, dtype: torch.dtype, device_name: str) -> str:
    return (f"E={experts},N={intermediate},H={hidden},dtype={str(dtype).removeprefix('torch.')},"
            f"device={device_name.replace(' ', '_')}.json")


def check_config(config: dict, where: str) -> dict[str, int]:
    """The keys (optional ones filled in), powers of two where the kernels need them; a clear error naming `where`
    otherwise."""
    full = {**OPTIONAL, **config}
    if set(full) != set(KEYS) or not all(type(full[k]) is int and full[k] > 0 for k in KEYS):
        raise ValueError(f"{where}: a MoE config needs positive integers {', '.join(KEYS)} (the SPLIT_K keys "
                         f"optional); got {config}")
    for key in OPTIONAL:
        if full[key] > MAX_SPLIT_K:
            raise ValueError(f"{where}: {key} must be at most {MAX_SPLIT_K}; got {full[key]}")
    for key, low in (("BLOCK_M", 16), ("BLOCK_N", 32), ("BLOCK_K", 16)):
        value = config[key]
        if value < low or value & (value - 1):
            raise ValueError(f"{where}: {key} must be a power of two >= {low}; got {value}")
    return full


def heuristic_config(tokens: int, experts: int, intermediate: int, hidden: int, top_k: int) -> dict[str, int]:
    """A reasoned default for H100/H200-class GPUs from the mean number of rows each expert gets.

    Up to 16 rows per expert the op streams weights (memory bound): one 16-row block per used expert, long K
    tiles, and N tiles narrow enough that the used experts give ~256 programs; where even the narrowest tiles
    give at most half that (one or two used experts), split-K doubles a GEMM's programs until they do, while
    every split keeps _MIN_SPLIT_TILES K tiles (so tiny test models never split). From 16 to 64 rows: mid-size
    tiles. Beyond: compute bound, 128-row tiles grouped so that blocks sharing an expert reuse its tiles in L2.
    """
    rows = tokens * top_k / experts
    if rows <= 16:
        used = min(experts, tokens * top_k)
        block_n = 128
        while block_n > 32 and used * -(-intermediate // (block_n // 2)) < _TARGET_PROGRAMS:
            block_n //= 2
        return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4,
                    SPLIT_K_UP=_split(used * -(-intermediate // (block_n // 2)), hidden, 128),
                    SPLIT_K_DOWN=_split(used * -(-hidden // block_n), intermediate, 128))
    if rows <= 64:
        return dict(BLOCK_M=32 if rows <= 32 else 64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4,
                    SPLIT_K_UP=1, SPLIT_K_DOWN=1)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K_UP=1,
                SPLIT_K_DOWN=1)


def _split(programs: int, depth: int, block_k: int) -> int:
    """A GEMM's split: doubled (up to 8) while twice its programs stay within _TARGET_PROGRAMS and every split
    keeps _MIN_SPLIT_TILES tiles of the reduction dimension `depth`."""
    split = 1
    while split < 8 and 2 * programs * split <= _TARGET_PROGRAMS and depth >= 2 * split * _MIN_SPLIT_TILES * block_k:
        split *= 2
    return split


@functools.cache
def load_table(name: str) -> dict[int, dict[str, int]] | None:
    """token count -> config from `moe_configs/<name>`, or None when there is no such file."""
    path = CONFIG_DIR / name
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    table = {int(tokens): check_config(config, f"{path.name}[{tokens}]")
             for tokens, config in raw.items() if not tokens.startswith("_")}
    if not table:
        raise ValueError(f"{path}: no token counts")
    return table


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def moe_config(tokens: int, experts: int, intermediate: int, hidden: int, top_k: int, dtype: torch.dtype,
               device: torch.device) -> dict[str, int]:
    """The tuned entry of the nearest token count for this shape and GPU, else `heuristic_config`."""
    if device.type == "cuda":
        name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
        table = load_table(config_file_name(experts, intermediate, hidden, dtype, name))
        if table is not None:
            return table[min(table, key=lambda tuned: (abs(tuned - tokens), tuned))]
    return heuristic_config(tokens, experts, intermediate, hidden, top_k)
