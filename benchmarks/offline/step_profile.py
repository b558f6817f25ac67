"""Where one engine step's time goes: wall time per step, split into prefill and decode steps, and a torch.profiler
table of a few decode steps (host time by op, device time by kernel), on the offline benchmark's workload.

The model is the offline benchmark's random one at full widths (ZAYA1-8B, or Ling-2.6-flash with `--model-type ling`;
`--layers` of them, its MTP layer with `--mtp-layer`) with random weights drawn on the device (`load_format="dummy"`:
the timing does not depend on the values; FP8 ones with `--quantization fp8` or `--fp8-checkpoint channel|block`)
and the workload its scenario (`--scenario`, seeded sampling at temperature 0.6), so the numbers explain that
benchmark's rates. The profiled steps are decode steps in the middle of a run, or for the prefill scenario the first
steps (all prefill). The summary's
`device_busy_ms_per_step` (kernel time summed over the profiled steps) next to `wall_ms_per_step` says whether a
step is bound by the GPU or by the host; so does `host` (decode scenarios): steady steps of the overlapped loop
timed unsynchronised, split into time blocked on the device and the host's own work, and a cProfile of it; and
`first_token`, the same split for one prompt alone until its first token, and its kernels by device time; for
the prefill scenario `host` is that split for the whole scenario's prompts (its prefill steps).
`--json-grammar` puts the offline benchmark's JSON grammar on every request
(where the time of a constrained step goes). Prefix caching is off, as in the offline benchmark.

    python -m benchmarks.offline profile --layers 40 --scenario b64 [--json-grammar] [--out profile.json]
    python -m benchmarks.offline profile --model-type ling --mtp-layer --fp8-checkpoint block --scenario b1
"""
from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import pstats
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.offline.scenarios import BENCH_GRAMMAR, SCENARIOS, workload
from hybridserve import LLM, SamplingParams
from hybridserve.demo import make_random_model
from hybridserve.models.released import FP8_CHECKPOINTS
from hybridserve.outputs import RequestOutputKind


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_steps(llm: LLM, prompts: list[list[int]], outputs: list[int], temperature: float, grammar
                 ) -> list[float]:
    """Run the workload with every engine step timed (synchronised): seconds per step, in order."""
    engine, steps = llm.engine, []
    original = engine.step

    def timed_step():
        _sync()
        start = time.perf_counter()
        result = original()
        _sync()
        steps.append(time.perf_counter() - start)
        return result

    engine.step = timed_step
    try:
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i,
                                 structured_output=grammar) for i, n in enumerate(outputs)]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        engine.step = original
    return steps


def _host_share(run_once: Callable[[], None], times: int) -> dict:
    """Whether `run_once` (some engine steps) is bound by the host: `times` runs unsynchronised (the engine's
    overlapped loop as the benchmark runs it) with the time spent blocked on the device (CUDA event waits) split
    from the host's own work, then the same runs under cProfile for where the host's work goes (cProfile slows
    Python, so its times are only shares). Times are per run; near-zero blocked time means the GPU waits for the
    host, not the other way round."""
    blocked = [0.0]
    original_wait = torch.cuda.Event.synchronize

    def timed_wait(event):
        start = time.perf_counter()
        original_wait(event)
        blocked[0] += time.perf_counter() - start

    torch.cuda.Event.synchronize = timed_wait
    try:
        runs = []
        for _ in range(times):
            start = time.perf_counter()
            run_once()
            runs.append(time.perf_counter() - start)
        wall = sum(runs)
    finally:
        torch.cuda.Event.synchronize = original_wait
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(times):
        run_once()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:40]  # by own time
    total = sum(row[2] for row in stats.stats.values())
    ours = sorted(((key, value) for key, value in stats.stats.items() if "hybridserve" in key[0]),
                  key=lambda item: item[1][3], reverse=True)[:40]  # our functions by time inside them

    def named(key: tuple) -> str:
        return f"{Path(key[0]).name}:{key[1]}:{key[2]}"

    return {"per_run_ms": {"wall": 1e3 * wall / times, "blocked_on_device": 1e3 * blocked[0] / times,
                           "host_work": 1e3 * (wall - blocked[0]) / times},
            "runs_ms": [round(1e3 * run, 2) for run in runs],
            "cprofile_own_time_share": [(named(key), value[1] / times, round(value[2] / total, 4))
                                        for key, value in rows],
            "cprofile_inclusive_share": [(named(key), value[1] / times, round(value[3] / total, 4))
                                         for key, value in ours]}


def _prompts_alone(engine, prompts: list[list[int]], temperature: float, grammar) -> Callable[[], None]:
    """One run: `prompts` on the idle engine, stepped until each has its first (and only) token, then the device
    drained. One prompt: a batch-1 request's time to first token (one prefill step and its sampling); the prefill
    scenario's 64: its prefill steps as the offline benchmark runs them."""
    serial = itertools.count()

    def run_once() -> None:
        for prompt in prompts:
            params = SamplingParams(temperature=temperature, max_tokens=1, ignore_eos=True, seed=0,
                                    structured_output=grammar)
            engine.add_request(f"first-token-{next(serial)}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        _sync()
    return run_once


def _graph_pool(llm: LLM) -> dict[str, float]:
    """MiB the decode and prefill graphs' captures added to their shared pool, and what the memory plan reserved."""
    runner = llm.engine.runner
    return {name: round(value / 2**20, 1) for name, value in (
        ("decode", runner.graphs.memory_bytes if runner.graphs is not None else 0),
        ("prefill", runner.prefill_graphs.memory_bytes if runner.prefill_graphs is not None else 0),
        ("reserved", runner.graph_reserve))}


def _table(trace, key: str, limit: int) -> list[tuple[str, int, float]]:
    rows = sorted(trace.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:limit]
    return [(e.key[:100], e.count, getattr(e, key) / 1e3) for e in rows]


def _kernel_gains(trace) -> list[tuple[object, float]]:
    """The device events in start order, each with the time it adds to the device's timeline (us): its end minus
    the latest end before it (0 when it ends inside an earlier kernel). With PDL a kernel starts while the one
    before runs, so its own duration includes the wait; what it adds to the step is this."""
    kernels = sorted((e for e in trace.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    gains, latest = [], None
    for event in kernels:
        start, end = event.time_range.start, event.time_range.end
        gains.append((event, max(end - max(latest if latest is not None else start, start), 0.0)))
        latest = end if latest is None else max(latest, end)
    return gains


def _exposed(trace, limit: int) -> list[tuple[str, int, float]]:
    """Kernels by the time each adds to the device's timeline (`_kernel_gains`), summed by name."""
    added: dict[str, list] = {}
    for event, gain in _kernel_gains(trace):
        entry = added.setdefault(event.name[:100], [0, 0.0])
        entry[0] += 1
        entry[1] += gain
    rows = sorted(added.items(), key=lambda item: item[1][1], reverse=True)[:limit]
    return [(name, count, us / 1e3) for name, (count, us) in rows]


def _timeline(trace) -> list[tuple[str, float, float, float]]:
    """Every profiled device event in start order: (name, start us from the first, own us, us added)."""
    gains = _kernel_gains(trace)
    first = gains[0][0].time_range.start if gains else 0.0
    return [(event.name[:80], round(event.time_range.start - first, 2),
             round(event.time_range.end - event.time_range.start, 2), round(gain, 2)) for event, gain in gains]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="zaya", choices=["zaya", "ling"])
    parser.add_argument("--layers", type=int, default=None, help="default: the model's real depth")
    parser.add_argument("--mtp-layer", action="store_true", help="the Ling model carries its MTP layer")
    parser.add_argument("--quantization", default=None, choices=["fp8"], help="online FP8 (random FP8 weights)")
    parser.add_argument("--fp8-checkpoint", default=None, choices=sorted(FP8_CHECKPOINTS),
                        help="the random model is an FP8 checkpoint of this layout")
    parser.add_argument("--scenario", default="b64", choices=list(SCENARIOS))
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--host-steps", type=int, default=24, help="steady decode steps timed unsynchronised "
                        "(blocked-on-device vs host work), then under cProfile")
    parser.add_argument("--first-token-runs", type=int, default=5, help="one prompt alone until its first token "
                        "(an eager prefill step), timed like --host-steps, then under cProfile")
    parser.add_argument("--json-grammar", action="store_true", help="every request under the offline benchmark's "
                        "JSON grammar")
    parser.add_argument("--timeline", action="store_true", help="write every profiled kernel in order (start, own "
                        "and added time) into the JSON too: the decode steps' and the first token's")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    grammar = BENCH_GRAMMAR if args.json_grammar else None

    directory = make_random_model(args.model_type, "full", args.layers, "dummy", args.mtp_layer, args.fp8_checkpoint)
    try:
        llm = LLM(directory, use_tqdm=False, dtype="bfloat16", load_format="dummy", quantization=args.quantization,
                  device="cuda" if torch.cuda.is_available() else "cpu", enable_prefix_caching=False)
        prompts, outputs = workload(SCENARIOS[args.scenario], 0)
        _timed_steps(llm, prompts[:2], [4] * len(prompts[:2]), args.temperature, grammar)  # warm-up, compile
        seconds = _timed_steps(llm, prompts, outputs, args.temperature, grammar)
        late = sorted(seconds if args.scenario == "prefill" else seconds[-(min(outputs) - 2):])
        summary = {"steps": len(seconds), "total_s": sum(seconds), "median_late_step_ms": 1e3 * late[len(late) // 2],
                   "first_steps_ms": [round(1e3 * s, 2) for s in seconds[:8]], "graph_pool_mib": _graph_pool(llm)}
        print(json.dumps(summary, indent=1))

        # Profile a few decode steps in the middle of a run (prefill: the first steps).
        tokens = 16 + args.profile_steps + 2 * args.host_steps  # through every profiled step
        params = [SamplingParams(temperature=args.temperature, max_tokens=tokens, ignore_eos=True, seed=i,
                                 output_kind=RequestOutputKind.DELTA, structured_output=grammar)
                  for i in range(len(prompts))]  # DELTA: as the server
        engine = llm.engine
        prompts, _ = workload(SCENARIOS[args.scenario], 1)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"profile-{i}", p, sp)
        for _ in range(0 if args.scenario == "prefill" else 12):  # through the prefill into steady decode
            engine.step()
        _sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            start = time.perf_counter()
            for _ in range(args.profile_steps):
                engine.step()
            _sync()
            wall = time.perf_counter() - start
        if args.scenario != "prefill":
            summary["host"] = _host_share(engine.step, args.host_steps)
            print("host share of steady decode steps:", json.dumps(summary["host"]["per_run_ms"]))
        while engine.has_unfinished_requests():
            engine.step()
        if args.scenario != "prefill":
            alone = _prompts_alone(engine, prompts[:1], args.temperature, grammar)
            summary["first_token"] = _host_share(alone, args.first_token_runs)
            print(f"host share of a {len(prompts[0])}-token prompt's first token:",
                  json.dumps(summary["first_token"]["per_run_ms"]))
            with profile(activities=[ProfilerActivity.CUDA]) as first:
                alone()
            summary["first_token"]["device"] = _table(first, "self_device_time_total", 30)
            summary["first_token"]["device_added"] = _exposed(first, 30)
            print("device self time of that first token (ms), and the time each adds to its timeline:")
            for name, count, ms in summary["first_token"]["device"]:
                print(f"  {ms:9.2f}  {count:6d}  {name}")
            for name, count, ms in summary["first_token"]["device_added"]:
                print(f"  {ms:9.2f}  {count:6d}  {name}  (added)")
            if args.timeline:
                summary["first_token"]["timeline"] = _timeline(first)
        else:  # the whole scenario, unsynchronised: is the overlapped loop bound by the host or the device?
            summary["host"] = _host_share(_prompts_alone(engine, prompts, args.temperature, grammar),
                                          args.first_token_runs)
            print(f"host share of the {len(prompts)} prompts' prefill:", json.dumps(summary["host"]["per_run_ms"]))
        host = _table(trace, "self_cpu_time_total", 30)
        device = _table(trace, "self_device_time_total", 30)
        exposed = _exposed(trace, 30)
        busy = sum(e.self_device_time_total for e in trace.key_averages()) / 1e3
        summary.update(wall_ms_per_step=1e3 * wall / args.profile_steps,  # under the profiler: an upper bound
                       device_busy_ms_per_step=busy / args.profile_steps)
        print(f"profiled: {summary['wall_ms_per_step']:.2f} ms wall, "
              f"{summary['device_busy_ms_per_step']:.2f} ms of kernels per step")
        print(f"host self time over {args.profile_steps} decode steps (ms):")
        for name, count, ms in host:
            print(f"  {ms:9.2f}  {count:6d}  {name}")
        print("device self time (ms):")
        for name, count, ms in device:
            print(f"  {ms:9.2f}  {count:6d}  {name}")
        print("device time added to the timeline (ms; PDL overlaps a kernel's wait with the one before):")
        for name, count, ms in exposed:
            print(f"  {ms:9.2f}  {count:6d}  {name}")
        if args.out:
            tables = {"summary": summary, "host": host, "device": device, "device_added": exposed}
            if args.timeline:
                tables["timeline"] = _timeline(trace)
            Path(args.out).write_text(json.dumps(tables, indent=1))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
