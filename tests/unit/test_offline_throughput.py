"""`python -m benchmarks.offline throughput`: runs end to end on CPU for both model types (tiny widths, config-only
directory, dummy weights), counts the experts its batched steps read, splits a decode scenario's rate at its first
tokens, and refuses draft tokens without an algorithm; the Ling bandwidth floor counts the model's weights, and a
floor at a counted expert spread differs from the uniform one by those experts' bytes alone. The benchmark runs as
a command: the tests import nothing from benchmarks/."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridserve.models.bandwidth_floor import decode_floor, expected_experts, ling_decode_bytes
from hybridserve.models.registry import model_family
from hybridserve.models.released import ling_flash_config, zaya1_8b_config

pytestmark = pytest.mark.heavy  # scheduled first: tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
THROUGHPUT = [sys.executable, "-m", "benchmarks.offline", "throughput"]


@pytest.mark.parametrize("model_type", ["zaya", "ling"])
def test_smoke_run_on_cpu_writes_the_results(tmp_path, model_type):
    out = tmp_path / "result.json"
    subprocess.run([*THROUGHPUT, "--device", "cpu", "--width", "demo", "--layers", "2", "--model-type", model_type,
                    "--load-format", "dummy", "--scenarios", "smoke", "--skip-hf", "--temperature", "0", "--dtype",
                    "float32", "--count-experts", "--out", str(out),
                    *(["--json-grammar"] if model_type == "zaya" else [])],
                   check=True, timeout=120, capture_output=True, cwd=ROOT)
    result = json.loads(out.read_text())
    smoke = result["scenarios"]["smoke"]
    assert result["layers"] == 2 and result["load_format"] == "dummy"
    assert smoke["output_tokens"] == 8 and smoke["ours_tok_s"] > 0 and smoke["floor_tok_s"] > 0
    # two requests: at most 2 (ZAYA1, top-1 of 4) or 4 (Ling, top-2 of 8) distinct experts a layer
    experts, per_token = (4, 1) if model_type == "zaya" else (8, 2)
    assert 0 < smoke["experts_touched"] <= 2 * per_token
    assert smoke["experts_expected"] == pytest.approx(experts * (1 - (1 - per_token / experts) ** 2))
    fewer = smoke["experts_touched"] < smoke["experts_expected"]
    assert (smoke["floor_tok_s_at_touched"] > smoke["floor_tok_s"]) == fewer
    assert (smoke["ours_json_tok_s"] > 0) if model_type == "zaya" else "ours_json_tok_s" not in smoke
    assert ("hf_tok_s" not in smoke) if model_type == "zaya" else smoke["hf_tok_s"] == "n/a"


def test_decode_scenarios_report_their_first_tokens_and_the_rate_after_them(tmp_path):
    """smoke (two requests of 4 tokens each, as b1's one of 128): their first tokens timed alone, and the rate of
    the 2 x 3 tokens after them, over the call's time less theirs (none where timing noise made them as long); the
    prefill scenario (one token a request) reports neither."""
    out = tmp_path / "result.json"
    subprocess.run([*THROUGHPUT, "--device", "cpu", "--width", "demo", "--layers", "2", "--load-format", "dummy",
                    "--scenarios", "smoke", "prefill", "--skip-hf", "--repeats", "1", "--dtype", "float32",
                    "--out", str(out)], check=True, timeout=240, capture_output=True, cwd=ROOT)
    smoke, prefill = (json.loads(out.read_text())["scenarios"][name] for name in ("smoke", "prefill"))
    assert smoke["ours_first_token_ms"] > 0 and smoke["floor_tok_s"] > 0
    rest = 2 * 4 / smoke["ours_tok_s"] - smoke["ours_first_token_ms"] / 1e3
    assert smoke["ours_decode_tok_s"] == (pytest.approx(2 * 3 / rest) if rest > 0 else None)
    assert "ours_decode_tok_s" not in prefill and "ours_first_token_ms" not in prefill


def test_speculative_smoke_run_reports_plain_speculative_and_forced_acceptance(tmp_path):
    """NEXTN on the demo-width Ling (the script gives it its MTP layer): the forced run accepts every draft."""
    out = tmp_path / "result.json"
    subprocess.run([*THROUGHPUT, "--device", "cpu", "--width", "demo", "--layers", "2", "--model-type", "ling",
                    "--load-format", "dummy", "--scenarios", "smoke", "--temperature", "0", "--dtype", "float32",
                    "--out", str(out), "--speculative-algorithm", "NEXTN", "--num-draft-tokens", "2"],
                   check=True, timeout=180, capture_output=True, cwd=ROOT)
    result = json.loads(out.read_text())
    smoke = result["scenarios"]["smoke"]
    assert result["speculative"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert smoke["spec_tok_s"] > 0 and smoke["forced_tok_s"] > 0 and smoke["spec_mean_accept_length"] >= 1
    assert smoke["forced_acceptance_rate"] == 1.0 and smoke["forced_mean_accept_length"] == 3.0


@pytest.mark.parametrize("flag", ["--speculative-num-draft-tokens", "--num-draft-tokens"])
def test_draft_tokens_without_an_algorithm_are_refused(tmp_path, flag):
    """`--num-draft-tokens K` alone used to be ignored (a plain run reported as if K drafts were asked for); the
    option check names both flags and stops the run before any model is written (the old spelling stays an
    alias)."""
    run = subprocess.run([*THROUGHPUT, "--device", "cpu", flag, "2", "--out", str(tmp_path / "result.json")],
                         timeout=120, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "TMPDIR": str(tmp_path)})  # where a random model would be written
    assert run.returncode == 2
    assert "--speculative-num-draft-tokens" in run.stderr and "needs --speculative-algorithm" in run.stderr, run.stderr
    assert list(tmp_path.iterdir()) == []  # no random model, no result


def test_counting_experts_under_tensor_parallelism_is_refused(tmp_path):
    """The count watches the experts' calls in the benchmark's process, which TP ranks do not all run in: refused
    before any model is written, not reported as no count."""
    run = subprocess.run([*THROUGHPUT, "--device", "cpu", "--tp", "2", "--count-experts", "--out",
                          str(tmp_path / "result.json")], timeout=120, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.returncode == 2 and "--count-experts" in run.stderr and "--tp 1" in run.stderr, run.stderr
    assert list(tmp_path.iterdir()) == []


def test_ling_floor_weights_are_the_model_parameters_when_every_expert_is_touched():
    config = ling_flash_config(16)
    family = model_family(config)
    with torch.device("meta"):
        model = family.model_class(family.parse_config(config))
    counted = sum(p.numel() * (2 if name.endswith("mlp.gate.weight") else 1) for name, p in model.named_parameters()
                  if p.dim() >= 2 and "word_embeddings" not in name)  # routers fp32 (2 bf16 units); no input lookup
    assert model.model.layers[7].attention.__class__.__name__ == "MultiLatentAttention"  # groups of 8
    weights = ling_decode_bytes(config, batch=10**6, context=0)["weights"] / 2  # in bf16 units
    assert weights == pytest.approx(counted, rel=1e-6)


@pytest.mark.parametrize("config, moe_layers", [(zaya1_8b_config(40), 40), (ling_flash_config(16), 15)])
@pytest.mark.parametrize("fp8", [False, True])
def test_floor_at_counted_experts_differs_by_their_bytes_alone(config, moe_layers, fp8):
    """Three experts a MoE layer fewer than the uniform expectation: the step's bytes (batch / floor at 1 byte/s)
    drop by three experts' gate, up and down weights in every MoE layer (Ling's layer 0 is dense), nothing else;
    at the expected count the floor is the default one."""
    batch, context = 64, 434
    expected = expected_experts(config, batch)
    assert expected == pytest.approx(config["num_experts"] * (1 - (1 - config["num_experts_per_tok"]
                                                                     / config["num_experts"]) ** batch))
    assert decode_floor(config, batch, context, fp8, experts_touched=expected) == \
        pytest.approx(decode_floor(config, batch, context, fp8), rel=1e-12)

    def step_bytes(touched):
        return batch / decode_floor(config, batch, context, fp8, bandwidth=1.0, experts_touched=touched)
    expert_bytes = 3 * config["hidden_size"] * config["moe_intermediate_size"] * (1 if fp8 else 2)
    assert step_bytes(expected) - step_bytes(expected - 3) == pytest.approx(3 * expert_bytes * moe_layers, rel=1e-9)
