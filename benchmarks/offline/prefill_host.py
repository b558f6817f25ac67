"""Where an eager prefill step spends its time: the host queueing the kernels, or the device running them. Steps of
several rows run eagerly (the offline benchmark's prefill scenario: 16 rows of 512 tokens a step), and so did the
one-row prefill that the b1 scenario pays once per request, before the prefill graphs (runtime/prefill_graphs.py).

For each prompt length the model's forward and logits run on one fresh row, or `--rows` of them (on the dummy page
and slot, as the warm-up does), timed three ways: the host's time to queue everything (no sync), the wall time to
the finished logits, and the device's own time (the work queued behind a long `torch.cuda._sleep`, so the device
never waits for the host). Triton's launch path (`JITFunction.run`) is timed and counted separately; a cProfile of
one run names the rest.

    python -m benchmarks.offline prefill-host --layers 40 --tokens 128 512 2048 [--rows 16] [--out prefill_host.json]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import statistics
import time
from pathlib import Path

import torch

from hybridserve import LLM
from hybridserve.core.batch import ScheduledChunk, build_forward_batch
from hybridserve.demo import make_random_model
from hybridserve.runtime.warmup import DUMMY_PAGE, DUMMY_SLOT

SLEEP_CYCLES = 400_000_000  # ~0.2 s at the H200's clocks: longer than the host needs to queue one prefill


class TritonLaunches:
    """Time and count every Triton kernel launch (JITFunction.run) while active."""

    def __init__(self):
        from triton.runtime.jit import JITFunction
        self._cls, self._original = JITFunction, JITFunction.run
        self.count, self.seconds = 0, 0.0

    def __enter__(self) -> TritonLaunches:
        original = self._original

        def timed(function, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(function, *args, **kwargs)
            finally:
                self.count += 1
                self.seconds += time.perf_counter() - start

        self._cls.run = timed
        return self

    def __exit__(self, *exc) -> None:
        self._cls.run = self._original


def _prefill(runner, tokens: int, rows: int = 1) -> None:
    """One eager prefill step of `rows` fresh rows of `tokens` tokens each, all on the dummy page and slot."""
    page = runner.config.page_size
    chunks = [ScheduledChunk([11] * tokens, 0, [DUMMY_PAGE] * -(-tokens // page), DUMMY_SLOT, False, [tokens - 1])
              for _ in range(rows)]
    batch = build_forward_batch(chunks, page, runner.device, runner.model.history_len)
    hidden = runner.model(batch)
    runner.model.compute_logits(hidden[batch.logits_indices])


def measure(runner, tokens: int, rows: int, repeats: int) -> dict:
    host, wall, device, launches, launch_s = [], [], [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with TritonLaunches() as triton_launches:
            _prefill(runner, tokens, rows)
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
        launches.append(triton_launches.count)
        launch_s.append(triton_launches.seconds)
        # The device's own time: everything queued behind a sleep, so no kernel waits for the host.
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        begin.record()
        _prefill(runner, tokens, rows)
        end.record()
        torch.cuda.synchronize()
        device.append(begin.elapsed_time(end) / 1e3)
    profiler = cProfile.Profile()
    profiler.enable()
    _prefill(runner, tokens, rows)
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = sum(row[2] for row in stats.stats.values())
    top = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:25]
    ms = {name: round(1e3 * statistics.median(values), 3) for name, values in
          (("host_queue_ms", host), ("wall_ms", wall), ("device_ms", device), ("triton_launch_ms", launch_s))}
    return {"tokens": tokens, "rows": rows, **ms, "triton_launches": launches[0],
            "cprofile_own_time_share": [(f"{Path(k[0]).name}:{k[1]}:{k[2]}", v[1], round(v[2] / total, 4))
                                        for k, v in top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--rows", type=int, default=1, help="rows of --tokens tokens each in the step (16 rows of "
                        "512: the offline benchmark's prefill scenario steps)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    directory = make_random_model("zaya", "full", args.layers, "dummy")
    try:
        llm = LLM(directory, use_tqdm=False, dtype="bfloat16", load_format="dummy", device="cuda",
                  enable_prefix_caching=False)
        runner = llm.engine.runner
        results = []
        with torch.inference_mode():
            for tokens in args.tokens:
                _prefill(runner, tokens, args.rows)  # any variant not yet compiled
                entry = measure(runner, tokens, args.rows, args.repeats)
                results.append(entry)
                print(json.dumps({k: v for k, v in entry.items() if k != "cprofile_own_time_share"}), flush=True)
                for name, calls, share in entry["cprofile_own_time_share"][:12]:
                    print(f"    {share:6.1%} {calls:6d}  {name}")
        if args.out:
            Path(args.out).write_text(json.dumps({"layers": args.layers, "results": results}, indent=1))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
