"""Serving benchmark: `hybridserve serve` driven by guidellm (vllm-project's OpenAI-compatible load generator) at
fixed concurrencies; TTFT and inter-token-latency percentiles and throughput per level.

The server runs as a subprocess on a free localhost port (a random model of `--model-type`, as
offline_throughput.py makes one: ZAYA1-8B widths with 40 layers, or Ling-2.6-flash widths; `--load-format dummy`
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
per level) and to stdout as a markdown table; `--raw DIR` keeps guidellm's own report.

    python benchmarks/serving_benchmark.py --out benchmarks/results/serving.json            # H200: a few minutes
    python benchmarks/serving_benchmark.py --model-type ling --layers 16 --concurrency 1 16 64
    python benchmarks/serving_benchmark.py --smoke                                          # CPU, tiny model

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
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: benchmarks, hybridserve

from benchmarks.offline_throughput import add_model_options, make_random_model  # noqa: E402
from benchmarks.server_process import ServerProcess  # noqa: E402

SERVED_NAME = "bench"
PERCENTILES = ("p50", "p90", "p99")
# --smoke: the whole pipeline on CPU in well under a minute (explicit options still override these).
SMOKE = dict(width="demo", layers=2, concurrency=[1, 2], num_prompts=[4], input_len=64, output_len=8,
             device="cpu", dtype="float32")


def default_requests(concurrency: int) -> int:
    """Requests per level: four waves of the concurrency (at least 16, so that p90 means something at c=1)."""
    return max(4 * concurrency, 16)


def fill_tokenizer_vocab(model_dir: Path, vocab_size: int) -> int:
    """Give every model token id below `vocab_size` a text in the model directory's tokenizer.json; return how many
    ids were added. A random model samples all of its vocabulary (ZAYA1-8B's 262272 ids, Ling's 157184), but the
    bundled tokenizer has 151669: ids past it decode to "", the server streams nothing for them, and the load
    generator would see a late first token (TTFT) and fewer chunks. The fillers (" t<id>") are byte-level BPE
    entries that no merge produces, so prompts encode exactly as before. The added (special) tokens go into the BPE
    vocabulary too, at their ids: the tokenizers library numbers added tokens that the model vocabulary lacks from
    its size up, so a larger vocabulary would otherwise move them."""
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab.update({token["content"]: token["id"] for token in tokenizer["added_tokens"]})
    used = set(vocab.values())
    missing = [i for i in range(vocab_size) if i not in used]
    vocab.update({f"\u0120t{i}": i for i in missing})  # \u0120 (Ġ) is the byte-level alphabet's space
    path.write_text(json.dumps(tokenizer, ensure_ascii=False))
    return len(missing)


class Server(ServerProcess):
    """The benchmarked server, stopped on leaving the `with` block."""

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def ttft_sum_count(self) -> tuple[float, float]:
        """The server's own time-to-first-token histogram (arrival to the first token reaching the event loop):
        (sum in seconds, count)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        values = {}
        for line in text.splitlines():
            for field in ("sum", "count"):
                if line.startswith(f"hybridserve:time_to_first_token_seconds_{field}{{"):  # {model_name="..."}
                    values[field] = float(line.split()[-1])
        return values["sum"], values["count"]

    def first_token_ms(self, prompt: list[int], max_tokens: int) -> float:
        """Milliseconds from sending a streaming completion to its first data line (read to the end)."""
        body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True})
        request = urllib.request.Request(f"{self.url}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        start, first = time.perf_counter(), None
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if first is None and line.startswith(b"data: "):
                    first = time.perf_counter()
        return (first - start) * 1e3

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        request = urllib.request.Request(f"{self.url}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())


def probe_ttft(server: Server, input_len: int, output_len: int, requests: int = 16) -> dict:
    """TTFT of lone streaming requests seen two ways, to tell the server's share from the client's: by a plain
    urllib client here, and by the server's own histogram (arrival to the first token reaching the event loop; its
    mean over these requests, from the /metrics sum and count before and after)."""
    before = server.ttft_sum_count()
    client = sorted(server.first_token_ms([2000 + (i * 7 + j) % 5000 for j in range(input_len)], output_len)
                    for i in range(requests))
    after = server.ttft_sum_count()
    return {"requests": requests, "client_ttft_ms_p50": client[len(client) // 2],
            "client_ttft_ms_mean": sum(client) / len(client),
            "server_ttft_ms_mean": (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3}


def guidellm_scenario(url: str, tokenizer: str, levels: list[int], requests: list[int], args,
                      report: Path) -> dict:
    """One guidellm run: one "concurrent" benchmark per level, `requests[i]` requests in level i (guidellm takes a
    list of per-benchmark limits), synthetic prompts of exactly input_len tokens of `tokenizer`."""
    return {
        "spec": {
            "backend": {"kind": "openai_http", "target": url, "model": SERVED_NAME,
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        with Server(server_args, work / "server.log") as server:
            start = time.perf_counter()
            server.wait_ready(args.startup_timeout)
            print(f"server ready in {time.perf_counter() - start:.1f} s: {shlex.join(server.command)}", flush=True)
            server.complete([1000 + i % 1000 for i in range(args.input_len)], min(args.output_len, 8))  # warm-up
            probe = probe_ttft(server, args.input_len, args.output_len)
            print("lone-request TTFT: client p50 {client_ttft_ms_p50:.1f} ms, mean {client_ttft_ms_mean:.1f} ms; "
                  "server mean {server_ttft_ms_mean:.1f} ms".format(**probe), flush=True)
            (work / "scenario.json").write_text(json.dumps(guidellm_scenario(
                server.url, model_dir, args.concurrency, level_requests(args), args, report), indent=2))
            subprocess.run([*guidellm, "run", "--scenario", str(work / "scenario.json"),
                            "--disable-console-interactive"], check=True)
        guidellm_report = json.loads(report.read_text())
        entries, problems = summarize(guidellm_report, scenario, args.input_len, args.output_len)
        print(f"\n## serving benchmark: {scenario}\n{markdown_table(entries)}")
        if args.out:
            Path(args.out).write_text(json.dumps({
                "scenario": scenario, "model": model, "layers": config["num_hidden_layers"],
                "load_format": args.load_format, "server_args": server_args[1:],
                "load_generator": f"guidellm {guidellm_report['metadata']['guidellm_version']}",
                "input_len": args.input_len, "output_len": args.output_len, "lone_request_ttft": probe,
                "results": entries,
                "problems": problems}, indent=2))
        for problem in problems:
            print(f"PROBLEM: {problem}", file=sys.stderr)
        return 1 if problems else 0
    finally:
        if args.raw:
            Path(args.raw).mkdir(parents=True, exist_ok=True)
            for name in ("guidellm.json", "scenario.json", "server.log"):
                if (work / name).exists():
                    shutil.copy(work / name, Path(args.raw) / name)
        shutil.rmtree(work, ignore_errors=True)
        if args.model is None:
            shutil.rmtree(model_dir, ignore_errors=True)


def main() -> None:
    # `timeout` and the device tool stop a run with SIGTERM: unwind so that the server is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(run(parse_args()))


if __name__ == "__main__":
    main()
