"""A stand-in for `guidellm run --scenario FILE` (`python -m benchmarks.serving --guidellm`), so that CI drives
the whole benchmark (model, server start, warm-up, probe, scenario, report, summary) without guidellm, whose closure
is too large for a test dependency. For each benchmark of the scenario it sends its requests `profile.streams` at a
time as streaming /v1/completions (prompts of token ids, exactly `prompt_tokens` long; `ignore_eos`) and writes
guidellm 0.8.1's report, trimmed to the fields the summary reads, from the times the chunks arrived."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def _percentiles(values: list[float]) -> dict:
    ordered = sorted(values) or [0.0]

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"successful": {"mean": statistics.fmean(ordered),
                           "percentiles": {"p10": at(0.1), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}}}


def _request(url: str, model: str, prompt_tokens: int, output_tokens: int, index: int) -> dict:
    """One streamed completion: its TTFT, inter-token gaps and token counts (ms)."""
    body = {"model": model, "prompt": [1000 + (index + i) % 1000 for i in range(prompt_tokens)],
            "max_tokens": output_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, arrivals, usage = time.perf_counter(), [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    return {"ttft": (arrivals[0] - start) * 1e3, "gaps": [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])],
            "prompt": usage["prompt_tokens"], "output": usage["completion_tokens"]}


def _benchmark(spec: dict, streams: int, count: int) -> dict:
    backend, data = spec["backend"], spec["data"][0]
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        done = list(pool.map(lambda i: _request(backend["target"], backend["model"], data["prompt_tokens"],
                                                data["output_tokens"], i), range(count)))
    duration = time.perf_counter() - start
    return {
        "config": {"strategy": {"type_": "concurrent", "streams": streams}},
        "duration": duration,
        "metrics": {
            "request_totals": {"successful": len(done), "errored": 0, "incomplete": 0, "total": len(done)},
            "time_to_first_token_ms": _percentiles([r["ttft"] for r in done]),
            "inter_token_latency_ms": _percentiles([g for r in done for g in r["gaps"]]),
            "output_tokens_per_second": {"successful": {"mean": sum(r["output"] for r in done) / duration}},
            "requests_per_second": {"successful": {"mean": len(done) / duration}},
        },
        "requests": {"successful": [{"input_metrics": {"text_tokens": r["prompt"]},
                                     "output_metrics": {"text_tokens": r["output"]}} for r in done]},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--disable-console-interactive", action="store_true")
    scenario = json.loads(Path(parser.parse_args().scenario).read_text())
    spec = scenario["spec"]
    counts = spec["constraints"][0]["count"]
    report = {"metadata": {"guidellm_version": "stand-in (tests/unit/stand_in_load_generator.py)"},
              "benchmarks": [_benchmark(spec, level["profile.streams"], count)
                             for level, count in zip(scenario["benchmarks"], counts)]}
    Path(spec["outputs"][0]["path"]).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
