"""`hybridserve serve` options: every contract option is documented, and unsupported values fail clearly."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hybridserve.cli import _engine_kwargs, build_parser


def test_serve_help_documents_every_contract_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for option in ("MODEL", "--host", "--port", "--tp", "--tensor-parallel-size", "--max-model-len",
                   "--max-running-requests", "--chunked-prefill-size", "--enable-prefix-caching",
                   "--disable-prefix-caching", "--state-dtype", "--state-to-kv-ratio", "--max-state-slots",
                   "--gpu-memory-utilization", "--served-model-name", "--dtype", "--device", "--enforce-eager",
                   "--cuda-graph-max-bs", "--load-format", "--disable-overlap-schedule"):
        assert option in help_text, option
    assert "no CUDA graphs" in " ".join(help_text.split())  # --enforce-eager says what it does


def test_serve_passes_the_tensor_parallel_size_and_refuses_unshardable_ones(zaya_dir):
    args = build_parser().parse_args(["serve", "/m", "--tp", "2"])
    assert _engine_kwargs(args)["tensor_parallel_size"] == 2
    result = subprocess.run([sys.executable, "-m", "hybridserve.cli", "serve", str(zaya_dir), "--tp", "4",
                             "--device", "cpu", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "num_key_value_heads = 2 is not divisible" in result.stderr


def test_serve_exits_with_the_reason_when_the_model_cannot_load(tmp_path):
    """The engine loads after the port opens; a failure there still ends the process with a clear message."""
    (tmp_path / "config.json").write_text("{}")  # a checkpoint by its files, but no model the engine knows
    (tmp_path / "model.safetensors").write_bytes(b"")
    result = subprocess.run([sys.executable, "-m", "hybridserve.cli", "serve", str(tmp_path), "--device",
                             "cpu", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "the engine could not start" in result.stderr
    assert str(tmp_path) in result.stderr


def test_serve_options_reach_the_engine_config():
    args = build_parser().parse_args(["serve", "/m", "--disable-prefix-caching", "--chunked-prefill-size", "64",
                                      "--state-to-kv-ratio", "0.5", "--tensor-parallel-size", "1", "--enforce-eager",
                                      "--disable-overlap-schedule"])
    kwargs = _engine_kwargs(args)
    assert (kwargs["enable_prefix_caching"], kwargs["chunked_prefill_size"], kwargs["state_to_kv_ratio"]) == \
        (False, 64, 0.5)
    assert kwargs["enforce_eager"] and kwargs["disable_overlap_schedule"]
    assert not _engine_kwargs(build_parser().parse_args(["serve"]))["disable_overlap_schedule"]
    assert build_parser().parse_args(["serve"]).enable_prefix_caching is True


@pytest.mark.parametrize("option", ["--tool-call-parser", "--reasoning-parser"])
def test_an_unknown_parser_name_is_a_start_up_error_listing_the_valid_ones(option, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", option, "hermes"])
    error = capsys.readouterr().err
    assert f"argument {option}: invalid choice: 'hermes'" in error
    assert ("'ling', 'zaya'" if option == "--tool-call-parser" else "'ling', 'qwen3', 'zaya'") in error
