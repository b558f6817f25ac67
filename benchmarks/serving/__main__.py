"""Serving benchmark: `hybridserve serve` driven by guidellm (vllm-project's OpenAI-compatible load generator) at
fixed concurrencies; TTFT and inter-token-latency percentiles and throughput per level.

The server runs as a subprocess on a free localhost port (a random model of `--model-type`, as the offline
benchmarks make one: ZAYA1-8B widths with 40 layers, or Ling-2.6-flash widths; `--load-format dummy`
by default, so nothing is written to disk and start-up takes seconds; or `--model DIR`). After /health answers and
one warm-up request, guidellm runs once with one benchmark per concurrency level ("concurrent" profile: exactly c
requests in flight; `--num-prompts` requests per level, default max(4c, 16)) over /v1/completions with streaming.
Its synthetic prompts have exactly `--input-len` tokens of the model's tokenizer, and every request asks for
`max_tokens = --output-len` with `ignore_eos: true` (guidellm's own way of fixing the output length, which the
server honours), so each generates exactly that many tokens; the script checks both from guidellm's per-request
counts and exits 1 if any request failed or had other lengths.

guidellm's definitions: TTFT = first streamed token - request sent; ITL = (last token - first token) / (output
tokens - 1), one value per request; output tok/s and req/s = completed output tokens / requests over the level's
wall time (ramp-up and tail included: no warm-up or cool-down trimming). Results go to `--out` as JSON (one entry
per level) and to stdout as a markdown table; `--raw DIR` keeps guidellm's own report and the server's log, and
`--report DIR/guidellm.json` summarizes such a report again without running anything. `--dry-run` prints the
resolved options (levels, requests per level) and exits.

    python -m benchmarks.serving --out serving.json                        # H200: a few minutes
    python -m benchmarks.serving --model-type ling --layers 16 --concurrency 1 16 64
    python -m benchmarks.serving --smoke                                   # CPU, tiny model

guidellm is not a dependency of hybridserve: `pip install guidellm==0.8.1` (or, on a machine without internet, the
wheels of benchmarks/fetch_serving_wheels.sh).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cli import add_model_options
from benchmarks.serving.guidellm import guidellm_scenario, markdown_table, summarize

SERVED_NAME = "bench"
# --smoke: the whole pipeline on CPU in well under a minute (explicit options still override these).
SMOKE = dict(width="demo", layers=2, concurrency=[1, 2], num_prompts=[4], input_len=64, output_len=8,
             device="cpu", dtype="float32")


def default_requests(concurrency: int) -> int:
    """Requests per level: four waves of the concurrency (at least 16, so that p90 means something at c=1)."""
    return max(4 * concurrency, 16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    parser.add_argument("--load-format", default=None, choices=["auto", "dummy"],
                        help="dummy: the server draws random weights from config.json (default for the random "
                             "model); auto: the checkpoint's weights (default for --model; for the random model a "
                             "random safetensors checkpoint is written first)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256], help="levels, in order")
    parser.add_argument("--num-prompts", type=int, nargs="+", default=None,
                        help="requests per level: one number for every level or one per level "
                             "(default: max(4 x concurrency, 16))")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens of every request")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens of every request")
    parser.add_argument("--seed", type=int, default=0, help="guidellm's prompt generator seed")
    parser.add_argument("--device", default="auto", help="the server's --device")
    parser.add_argument("--dtype", default="auto", help="the server's --dtype")
    parser.add_argument("--max-running-requests", type=int, default=256, help="the server's option of that name")
    parser.add_argument("--server-args", default="", help="more `hybridserve serve` options, one shell-quoted "
                                                          "string (e.g. '--enforce-eager')")
    parser.add_argument("--guidellm", default=f"{shlex.quote(sys.executable)} -m guidellm",
                        help="the guidellm command (default: this Python's guidellm module)")
    parser.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for /health")
    parser.add_argument("--request-timeout", type=float, default=600, help="guidellm's per-request read timeout")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check of the whole pipeline: tiny 2-layer model, concurrency 1 and 2, 4 requests "
                             "of 64 + 8 tokens, float32 (explicit options still override)")
    parser.add_argument("--raw", default=None, metavar="DIR", help="keep guidellm's report and the server log here")
    parser.add_argument("--report", default=None, metavar="FILE", type=Path,
                        help="summarize this guidellm report (e.g. DIR/guidellm.json of --raw) against --input-len "
                             "and --output-len instead of running the benchmark")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved options as JSON and exit")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.model is not None and args.layers is not None:
        parser.error("--layers applies to the random model only, not to --model")
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.input_len < 1 or args.output_len < 1:
        parser.error("--concurrency, --input-len and --output-len must be >= 1")
    if args.num_prompts is not None and (len(args.num_prompts) not in (1, len(args.concurrency))
                                         or min(args.num_prompts) < 1):
        parser.error("--num-prompts takes one count >= 1 for every level or one per --concurrency level")
    args.load_format = args.load_format or ("auto" if args.model else "dummy")
    return args


def level_requests(args: argparse.Namespace) -> list[int]:
    if args.num_prompts is None:
        return [default_requests(c) for c in args.concurrency]
    return args.num_prompts * len(args.concurrency) if len(args.num_prompts) == 1 else args.num_prompts


def run(args: argparse.Namespace) -> int:
    """The server started, probed and driven by guidellm; the summary's exit status (1: problems)."""
    from benchmarks.serving.client import Server, probe_ttft  # here: the option checks need no torch
    from hybridserve.demo import fill_tokenizer_vocab, make_random_model

    guidellm = shlex.split(args.guidellm)
    if guidellm[1:3] == ["-m", "guidellm"] and importlib.util.find_spec("guidellm") is None:
        raise SystemExit("guidellm is not installed: pip install guidellm==0.8.1, or install the wheels of "
                         "benchmarks/fetch_serving_wheels.sh")
    work = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    model_dir = args.model or make_random_model(args.model_type, args.width, args.layers, args.load_format)
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if args.model is None:
            fill_tokenizer_vocab(Path(model_dir), config["vocab_size"])
        model = args.model or f"random {args.model_type} ({args.width} widths)"
        scenario = (f"{model}, {config['num_hidden_layers']} layers, prompt {args.input_len}, "
                    f"output {args.output_len}")
        server_args = [model_dir, "--served-model-name", SERVED_NAME, "--load-format", args.load_format,
                       "--device", args.device, "--dtype", args.dtype,
                       "--max-running-requests", str(args.max_running_requests), *shlex.split(args.server_args)]
        report = work / "guidellm.json"
        with Server(server_args, work / "server.log", SERVED_NAME) as server:
            start = time.perf_counter()
            server.wait_ready(args.startup_timeout)
            print(f"server ready in {time.perf_counter() - start:.1f} s: {shlex.join(server.command)}", flush=True)
            server.complete([1000 + i % 1000 for i in range(args.input_len)], min(args.output_len, 8))  # warm-up
            probe = probe_ttft(server, args.input_len, args.output_len)
            print("lone-request TTFT: client p50 {client_ttft_ms_p50:.1f} ms, mean {client_ttft_ms_mean:.1f} ms; "
                  "server mean {server_ttft_ms_mean:.1f} ms".format(**probe), flush=True)
            (work / "scenario.json").write_text(json.dumps(guidellm_scenario(
                server.url, SERVED_NAME, model_dir, args.concurrency, level_requests(args), args, report), indent=2))
            subprocess.run([*guidellm, "run", "--scenario", str(work / "scenario.json"),
                            "--disable-console-interactive"], check=True)
        return summarize_report(json.loads(report.read_text()), scenario, args, {
            "model": model, "layers": config["num_hidden_layers"], "load_format": args.load_format,
            "server_args": server_args[1:], "lone_request_ttft": probe})
    finally:
        if args.raw:
            Path(args.raw).mkdir(parents=True, exist_ok=True)
            for name in ("guidellm.json", "scenario.json", "server.log"):
                if (work / name).exists():
                    shutil.copy(work / name, Path(args.raw) / name)
        shutil.rmtree(work, ignore_errors=True)
        if args.model is None:
            shutil.rmtree(model_dir, ignore_errors=True)


def summarize_report(report: dict, scenario: str, args: argparse.Namespace, details: dict) -> int:
    """The table of guidellm's `report` on stdout, its entries (with `details`) in --out, its problems on stderr;
    the exit status: 1 if there were problems."""
    entries, problems = summarize(report, scenario, args.input_len, args.output_len)
    print(f"\n## serving benchmark: {scenario}\n{markdown_table(entries)}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "scenario": scenario, **details,
            "load_generator": f"guidellm {report['metadata']['guidellm_version']}",
            "input_len": args.input_len, "output_len": args.output_len, "results": entries,
            "problems": problems}, indent=2))
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main() -> None:
    args = parse_args()
    if args.dry_run:
        print(json.dumps({**vars(args), "requests_per_level": level_requests(args)}, indent=1, default=str))
        return
    if args.report is not None:
        sys.exit(summarize_report(json.loads(args.report.read_text()), f"guidellm report {args.report}", args, {}))
    # `timeout` and the device tool stop a run with SIGTERM: unwind so that the server is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(run(args))


if __name__ == "__main__":
    main()
