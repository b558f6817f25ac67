"""The CPU cache pools' zeroed buffers (cache/buffers.py) and the CPU budget's check against the machine."""
from __future__ import annotations

import gc
import os

import pytest
import torch

from hybridserve import LLM
from hybridserve.cache.buffers import zeroed
from hybridserve.runtime.memory_profile import _available_cpu_bytes


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64])
def test_zeroed_is_a_contiguous_zero_tensor_that_keeps_writes(dtype):
    buffer = zeroed((3, 5, 7), dtype, torch.device("cpu"))
    assert buffer.shape == (3, 5, 7) and buffer.dtype == dtype and buffer.is_contiguous()
    assert not buffer.float().any()
    buffer[2, 4, 6] = 1
    view = buffer[2]
    del buffer
    gc.collect()
    assert view.float().sum().item() == 1  # the view keeps the mapping alive
    assert zeroed((0, 4), dtype, torch.device("cpu")).shape == (0, 4)


@pytest.mark.skipif(_available_cpu_bytes() is None, reason="reads Linux's /proc")
def test_zeroed_takes_memory_only_where_written():
    before = _resident_bytes()
    buffer = zeroed((512, 1 << 20), torch.uint8, torch.device("cpu"))  # 512 MiB
    assert _resident_bytes() - before < 64 << 20
    buffer[::64].fill_(1)  # one row in 64 written: about 8 MiB of pages
    grown = _resident_bytes() - before
    assert 8 << 20 <= grown < 72 << 20


@pytest.mark.skipif(_available_cpu_bytes() is None, reason="reads Linux's /proc")
def test_a_cpu_budget_beyond_the_machines_memory_is_refused_by_name(zaya_dir):
    budget = _available_cpu_bytes() + (1 << 40)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes: the CPU cache budget"):
        LLM(str(zaya_dir), use_tqdm=False, device="cpu", dtype="float32", kv_cache_memory_bytes=budget)
