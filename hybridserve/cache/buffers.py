"""Zero-filled cache buffers that cost nothing until written, on the CPU.

The KV and state pools take the whole cache budget up front (1 GiB on the CPU by default). `torch.zeros` writes
every byte of it, a few hundred milliseconds at each engine start on the CPU, for pages most runs never touch. An
anonymous memory map is zero by the operating system's guarantee and gets its pages on first write, so the CPU
pools are views of one. Other devices allocate as before.
"""
from __future__ import annotations

import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous zero tensor; on the CPU backed by an anonymous memory map (the tensor keeps it alive)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
