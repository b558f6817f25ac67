"""guidellm (vllm-project's OpenAI-compatible load generator) as the serving benchmark drives it: the scenario file
of one run (one "concurrent" benchmark per level), and the summary of its report (TTFT and inter-token-latency
percentiles and throughput per level, and the problems that make a run invalid)."""
from __future__ import annotations

import argparse
from pathlib import Path

PERCENTILES = ("p50", "p90", "p99")


def guidellm_scenario(url: str, model: str, tokenizer: str, levels: list[int], requests: list[int],
                      args: argparse.Namespace, report: Path) -> dict:
    """One guidellm run: one "concurrent" benchmark per level, `requests[i]` requests in level i (guidellm takes a
    list of per-benchmark limits), synthetic prompts of exactly input_len tokens of `tokenizer`."""
    return {
        "spec": {
            "backend": {"kind": "openai_http", "target": url, "model": model,
                        "request_format": "/v1/completions", "stream": True, "timeout": args.request_timeout},
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
            "profile": {"kind": "concurrent"},
            "data": [{"kind": "synthetic_text", "prompt_tokens": args.input_len, "output_tokens": args.output_len}],
            "constraints": [{"kind": "max_requests", "count": requests}],
            "seed": {"kind": "static", "value": args.seed},
            "outputs": [{"kind": "json", "path": str(report)}],
        },
        "benchmarks": [{"profile.streams": c} for c in levels],
    }


def _stats(metric: dict) -> dict[str, float]:
    values = metric["successful"]
    return {p: values["percentiles"][p] for p in PERCENTILES} | {"mean": values["mean"]}


def summarize(report: dict, scenario: str, input_len: int, output_len: int) -> tuple[list[dict], list[str]]:
    """One entry per guidellm benchmark (level) and the problems found: failed or unfinished requests, prompts or
    outputs of other lengths than asked for (guidellm's per-request counts, the server's usage when it sends it)."""
    entries, problems = [], []
    for bench in report["benchmarks"]:
        c = bench["config"]["strategy"]["streams"]
        m = bench["metrics"]
        totals = m["request_totals"]
        ok = bench["requests"]["successful"]
        prompt_lens = {r["input_metrics"]["text_tokens"] for r in ok}
        output_lens = {r["output_metrics"]["text_tokens"] for r in ok}
        if totals["errored"] or totals["incomplete"]:
            problems.append(f"c={c}: {totals['errored']} errored and {totals['incomplete']} incomplete requests")
        if prompt_lens - {input_len} or output_lens - {output_len}:
            problems.append(f"c={c}: prompt lengths {sorted(prompt_lens)} and output lengths {sorted(output_lens)} "
                            f"(asked for {input_len} and {output_len})")
        entries.append({
            "scenario": scenario, "concurrency": c, "requests": totals["successful"], "errored": totals["errored"],
            "incomplete": totals["incomplete"], "duration_s": bench["duration"],
            "ttft_ms": _stats(m["time_to_first_token_ms"]), "itl_ms": _stats(m["inter_token_latency_ms"]),
            "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "req_s": m["requests_per_second"]["successful"]["mean"],
        })
    return entries, problems


def markdown_table(entries: list[dict]) -> str:
    def triple(stats: dict) -> str:
        return " / ".join(f"{stats[p]:.1f}" for p in PERCENTILES)
    lines = ["| concurrency | requests | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | output tok/s | req/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {e['concurrency']} | {e['requests']} | {triple(e['ttft_ms'])} | {triple(e['itl_ms'])} | "
              f"{e['output_tok_s']:.1f} | {e['req_s']:.2f} |" for e in entries]
    return "\n".join(lines)
