"""`python -m benchmarks.serving`: option checks, the tokenizer filler of the random model, the summary of a
guidellm report (and the problems it must flag), and end-to-end smoke runs on CPU. The benchmark runs as a command
(its --dry-run prints the resolved options, --report summarizes a report): the tests import nothing from
benchmarks/.

guidellm is not a test dependency (its closure is large, and the benchmark only runs on the GPU machine with
carried wheels): one smoke run drives the server with a stand-in load generator (`stand_in_load_generator.py`, which
writes guidellm's report), always; the other with guidellm itself, skipped unless `import guidellm` works
(`pip install guidellm==0.8.1`). Each takes ~25 s on 2 cores."""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from hybridserve.demo import copy_bundled_tokenizer, fill_tokenizer_vocab

ROOT = Path(__file__).resolve().parents[2]
SERVING = [sys.executable, "-m", "benchmarks.serving"]
BUNDLED_TOKENS = 151669  # the bundled Qwen3 tokenizer: 151643 BPE entries + 26 added tokens


def _serving(*options: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The benchmark, and the server it starts, with one intra-op thread (as tests/server/conftest.py's servers):
    they share CI's two cores with the other test worker, where oversubscribed OpenMP threads spin and slowed the
    smoke run (and the worker beside it) fivefold."""
    return subprocess.run([*SERVING, *options], timeout=timeout, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _options(*options: str) -> dict:
    """The options the benchmark resolves from `options` (its --dry-run)."""
    run = _serving(*options, "--dry-run")
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_default_levels_and_request_counts():
    options = _options()
    assert options["concurrency"] == [1, 16, 64, 256] and options["load_format"] == "dummy"
    assert options["requests_per_level"] == [16, 64, 256, 1024]
    assert _options("--concurrency", "2", "8", "--num-prompts", "5")["requests_per_level"] == [5, 5]
    assert _options("--concurrency", "2", "8", "--num-prompts", "5", "7")["requests_per_level"] == [5, 7]


def test_smoke_defaults_yield_to_explicit_options():
    options = _options("--smoke", "--concurrency", "3", "--output-len", "5")
    assert [options[k] for k in ("width", "layers", "device", "dtype")] == ["demo", 2, "cpu", "float32"]
    assert options["concurrency"] == [3] and options["output_len"] == 5 and options["input_len"] == 64
    assert _options("--model", "/some/dir")["load_format"] == "auto"  # a real checkpoint's own weights


@pytest.mark.parametrize("argv", [["--concurrency", "0"], ["--concurrency", "1", "2", "--num-prompts", "1", "2", "3"],
                                  ["--num-prompts", "0"], ["--output-len", "0"], ["--model", "/m", "--layers", "2"],
                                  ["--smoke", "--model", "/m", "--layers", "2"]])
def test_bad_options_are_refused(argv):
    run = _serving(*argv, "--dry-run")
    assert run.returncode == 2 and "error:" in run.stderr


def test_filled_tokenizer_decodes_every_model_id_and_encodes_as_before(tmp_path):
    copy_bundled_tokenizer(tmp_path)
    before = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert before.get_vocab_size() == BUNDLED_TOKENS
    assert fill_tokenizer_vocab(tmp_path, BUNDLED_TOKENS + 40) == 40
    after = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert after.get_vocab_size() == BUNDLED_TOKENS + 40
    for i in range(BUNDLED_TOKENS, BUNDLED_TOKENS + 40):
        assert after.decode([i]) == f" t{i}"
    assert [after.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "</think>")] == \
        [151643, 151644, 151645, 151668]  # the special tokens keep their ids
    text = "The quick brown fox t151680 jumps over 1234 lazy dogs. Grüße, 世界! <|im_start|>x<|im_end|>"
    assert after.encode(text).ids == before.encode(text).ids
    ids = list(range(0, BUNDLED_TOKENS, 997)) + [151643, 151645, 151668]
    assert after.decode(ids, skip_special_tokens=False) == before.decode(ids, skip_special_tokens=False)
    assert fill_tokenizer_vocab(tmp_path, BUNDLED_TOKENS + 40) == 0  # idempotent


def _benchmark(streams: int, output_lens: list[int], errored: int = 0) -> dict:
    """A guidellm 0.8.1 report entry, trimmed to the fields the summary reads."""
    def dist(p50: float, p90: float, p99: float, mean: float) -> dict:
        return {"successful": {"mean": mean, "percentiles": {"p10": 0.0, "p50": p50, "p90": p90, "p99": p99}}}
    return {
        "config": {"strategy": {"type_": "concurrent", "streams": streams}},
        "duration": 2.5,
        "metrics": {
            "request_totals": {"successful": len(output_lens), "errored": errored, "incomplete": 0,
                               "total": len(output_lens) + errored},
            "time_to_first_token_ms": dist(10.0, 20.0, 30.0, 12.0),
            "inter_token_latency_ms": dist(4.0, 5.0, 6.0, 4.5),
            "output_tokens_per_second": {"successful": {"mean": 1234.5}},
            "requests_per_second": {"successful": {"mean": 9.75}},
        },
        "requests": {"successful": [{"input_metrics": {"text_tokens": 64}, "output_metrics": {"text_tokens": n}}
                                    for n in output_lens]},
    }


def _summary(tmp_path: Path, benchmarks: list[dict]) -> tuple[subprocess.CompletedProcess, dict]:
    """The benchmark's summary (--report) of a guidellm report of `benchmarks`, for prompts of 64 and outputs of 8
    tokens: the run and its --out JSON."""
    report, out = tmp_path / "guidellm.json", tmp_path / "summary.json"
    report.write_text(json.dumps({"metadata": {"guidellm_version": "0.8.1"}, "benchmarks": benchmarks}))
    run = _serving("--report", str(report), "--input-len", "64", "--output-len", "8", "--out", str(out))
    return run, json.loads(out.read_text())


def test_summary_of_a_clean_report(tmp_path):
    run, summary = _summary(tmp_path, [_benchmark(4, [8] * 6)])
    assert run.returncode == 0 and summary["problems"] == [] and summary["load_generator"] == "guidellm 0.8.1"
    assert summary["results"] == [{
        "scenario": f"guidellm report {tmp_path / 'guidellm.json'}", "concurrency": 4, "requests": 6, "errored": 0,
        "incomplete": 0, "duration_s": 2.5, "ttft_ms": {"p50": 10.0, "p90": 20.0, "p99": 30.0, "mean": 12.0},
        "itl_ms": {"p50": 4.0, "p90": 5.0, "p99": 6.0, "mean": 4.5}, "output_tok_s": 1234.5, "req_s": 9.75}]
    assert "| 4 | 6 | 10.0 / 20.0 / 30.0 | 4.0 / 5.0 / 6.0 | 1234.5 | 9.75 |" in run.stdout


def test_summary_flags_failed_requests_and_wrong_lengths(tmp_path):
    run, summary = _summary(tmp_path, [_benchmark(1, [8, 8]), _benchmark(2, [8, 7], errored=1)])
    problems = summary["problems"]
    assert run.returncode == 1 and [e["concurrency"] for e in summary["results"]] == [1, 2]
    assert len(problems) == 2 and all(p.startswith("c=2:") for p in problems)
    assert "1 errored" in problems[0] and "[7, 8]" in problems[1]
    assert run.stderr.count("PROBLEM: c=2:") == 2


def _smoke_run(tmp_path: Path, *options: str) -> None:
    out = tmp_path / "serving.json"
    run = _serving("--smoke", "--out", str(out), *options, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["problems"] == [] and result["load_generator"].startswith("guidellm ")
    assert [(e["concurrency"], e["requests"], e["errored"]) for e in result["results"]] == [(1, 4, 0), (2, 4, 0)]
    for entry in result["results"]:
        for stats in (entry["ttft_ms"], entry["itl_ms"]):
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
        assert entry["output_tok_s"] > 0 and entry["req_s"] > 0
    assert "| concurrency | requests |" in run.stdout and "lone-request TTFT" in run.stdout


def test_smoke_run_drives_the_server_with_a_stand_in_load_generator(tmp_path):
    stand_in = ROOT / "tests" / "unit" / "stand_in_load_generator.py"
    _smoke_run(tmp_path, "--guidellm", shlex.join([sys.executable, str(stand_in)]))


@pytest.mark.skipif(importlib.util.find_spec("guidellm") is None, reason="guidellm is not installed")
def test_smoke_run_drives_the_server_with_guidellm(tmp_path):
    _smoke_run(tmp_path)
