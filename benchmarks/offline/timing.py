"""How the offline benchmarks time a call: synchronized with the device around it, and what else happened in it
(Python's garbage collections, the caching allocator's retries, the GPU's clocks), which explain a slow repeat."""
from __future__ import annotations

import gc
import time

import torch


def sync(device: str) -> None:
    """Wait for the work queued on `device` (nothing to wait for off CUDA)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()



def copy_rate(device: str, size: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s a device-to-device copy of `size` bytes moves on `device` (each byte read and written: 2 * size a
    copy), the best of `repeats` after a warm-up: the HBM rate the decode floor divides by, measured on the GPU the
    benchmark runs on (an H100's is about 3.0e12 against an H200's 4.3e12)."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del source, target
    torch.cuda.empty_cache()
    return 2 * size / best


class GCPauses:
    """Python's garbage collections during a timed call (gc.callbacks): per generation, how many and how long. A
    full (generation 2) collection walks every tracked object of a process that imported torch and transformers
    (83 ms for 214k objects on a CPU test machine): one inside a timed call moves its rate."""

    def __init__(self):
        self.runs: list[tuple[int, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.runs.append((info["generation"], time.perf_counter() - self._start))

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        """{"gen0": [count, ms], "gen1": ..., "gen2": ...}"""
        return {f"gen{g}": [sum(1 for k, _ in self.runs if k == g),
                            round(1e3 * sum(s for k, s in self.runs if k == g), 3)] for g in range(3)}


def gpu_state(device: str) -> dict | None:
    """Right after a timed run: the caching allocator's counters so far (retries = a failed cudaMalloc that freed
    the cache and tried again; device allocs / frees = cudaMalloc / cudaFree calls) and, through NVML, the SM clock
    (MHz), power (W) and temperature (C): whether a slower repeat thrashed the allocator or ran at lower clocks (the
    40-layer prefill gave 144k, then 99k and 99k tok/s). None off CUDA."""
    if not device.startswith("cuda"):
        return None
    stats = torch.cuda.memory_stats(device)
    state = {"alloc_retries": stats.get("num_alloc_retries"), "device_allocs": stats.get("num_device_alloc"),
             "device_frees": stats.get("num_device_free")}
    try:
        state |= {"sm_clock_mhz": torch.cuda.clock_rate(device), "power_w": torch.cuda.power_draw(device) / 1000,
                  "temperature_c": torch.cuda.temperature(device)}
    except Exception:  # NVML missing or refused (e.g. in a container): the allocator's counters stand alone
        pass
    return state
