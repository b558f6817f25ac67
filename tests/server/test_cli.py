"""`hybridserve serve` options: every contract option is documented with its default, the names vLLM and SGLang users
type reach the fields they name, a --config file gives options, and unsupported values fail clearly."""
from __future__ import annotations

import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hybridserve.cli import _engine_kwargs, _server_options, build_parser, parse_args


def test_serve_help_documents_every_contract_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for option in ("MODEL", "--host", "--port", "--tp", "--tensor-parallel-size", "--max-model-len",
                   "--max-running-requests", "--chunked-prefill-size", "--enable-prefix-caching",
                   "--disable-prefix-caching", "--state-to-kv-ratio", "--max-state-slots",
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


def test_every_option_shows_its_default_and_python_dash_m_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "hybridserve", "serve", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0
    parser = build_parser().subcommands["serve"]
    for action in parser._actions:
        if action.option_strings and action.dest != "help" and not action.help.startswith("the opposite of"):
            assert "default" in action.help, action.option_strings
    for flag in ("--max-num-seqs", "--context-length", "--mem-fraction-static", "--tp-size", "--trust-remote-code",
                 "--model-path", "--config", "--log-level", "--disable-log-requests", "--enable-log-requests",
                 "--disable-uvicorn-access-log", "--max-logprobs", "--revision", "--download-dir", "--quantization"):
        assert flag in result.stdout, flag


def test_the_habitual_flag_names_reach_the_config_they_name():
    args = parse_args(["serve", "--model-path", "org/m", "--max-num-seqs", "8", "--context-length", "512",
                       "--mem-fraction-static", "0.5", "--tp-size", "1", "--trust-remote-code", "--served-model-name",
                       "a", "b", "--disable-radix-cache", "-q", "fp8", "--max-logprobs", "5", "--log-level", "debug",
                       "--enable-auto-tool-choice", "--enable-prompt-tokens-details", "--enable-chunked-prefill",
                       "--enable-metrics"])  # the last four: what the server always does
    kwargs = _engine_kwargs(args)
    assert (kwargs["max_running_requests"], kwargs["max_model_len"], kwargs["gpu_memory_utilization"],
            kwargs["tensor_parallel_size"], kwargs["enable_prefix_caching"], kwargs["quantization"],
            kwargs["max_logprobs"]) == (8, 512, 0.5, 1, False, "fp8", 5)
    options = _server_options(args, "org/m")
    assert options.served_model_names == ("a", "b") and options.served_model_name == "a"
    assert args.model_option == "org/m" and args.log_level == "debug"
    default = _server_options(parse_args(["serve", "org/m"]), "org/m")
    assert default.served_model_names == ("org/m",) and default.log_stats_interval_s == 10.0
    assert _server_options(parse_args(["serve", "--demo", "ling"]), "d").served_model_names == \
        ("hybridserve-demo-ling", "hybridserve-demo")  # README examples name the zaya demo: either demo answers


def test_a_config_file_gives_options_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: org/m\nmax-num-seqs: 4\nmax_model_len: 256\nenable-prefix-caching: false\n"
                      "enforce-eager: true\nserved-model-name: [x, y]\nport: 9001\n")
    args = parse_args(["serve", "--config", str(config), "--max-num-seqs", "6"])
    kwargs = _engine_kwargs(args)
    assert (kwargs["max_running_requests"], kwargs["max_model_len"], kwargs["enable_prefix_caching"],
            kwargs["enforce_eager"]) == (6, 256, False, True)
    assert (args.model_option, args.served_model_name, args.port) == ("org/m", ["x", "y"], 9001)
    config.write_text("max-num-seqz: 4\n")
    with pytest.raises(ValueError, match="unknown option 'max-num-seqz'"):
        parse_args(["serve", "--config", str(config)])
    config.write_text("enforce-eager: 1\n")
    with pytest.raises(ValueError, match="enforce-eager takes true or false"):
        parse_args(["serve", "--config", str(config)])


def test_uvicorn_log_level_reaches_uvicorns_config():
    """vLLM's --uvicorn-log-level: uvicorn's own level (default info, as vLLM's), set on its config."""
    from hybridserve.server.app import uvicorn_config

    def level(*flags: str) -> str:
        options = _server_options(parse_args(["serve", *flags]), "m")
        return uvicorn_config(None, options).log_level

    assert level() == "info" and level("--uvicorn-log-level", "warning") == "warning"
    assert level("--uvicorn-log-level", "trace") == "trace"
    with pytest.raises(SystemExit):
        parse_args(["serve", "--uvicorn-log-level", "loud"])


def test_sglangs_max_total_tokens_and_no_chunking_reach_the_engine_config():
    kwargs = _engine_kwargs(parse_args(["serve", "--max-total-tokens", "4096", "--chunked-prefill-size", "-1",
                                        "--generation-config", "vllm"]))
    assert (kwargs["max_total_tokens"], kwargs["chunked_prefill_size"], kwargs["generation_config"]) == \
        (4096, -1, "vllm")
    defaults = _engine_kwargs(parse_args(["serve"]))
    assert (defaults["max_total_tokens"], defaults["chunked_prefill_size"], defaults["generation_config"]) == \
        (None, None, "auto")


@pytest.mark.parametrize("flags, message", [
    (["--chunked-prefill-size", "0"], "chunked_prefill_size=0 (--chunked-prefill-size): must be >= 1, or -1 for no "
                                      "chunking"),
    (["--chunked-prefill-size", "-2"], "chunked_prefill_size=-2 (--chunked-prefill-size)"),
    (["--max-total-tokens", "100"], "max_total_tokens=100 (--max-total-tokens): must be a positive multiple of "
                                    "page_size (16)"),
    (["--max-total-tokens", "0"], "max_total_tokens=0 (--max-total-tokens)"),
])
def test_values_the_engine_cannot_honour_are_errors_naming_the_flag(flags, message):
    from hybridserve.config import EngineConfig

    with pytest.raises(ValueError) as err:
        EngineConfig(model="m", **_engine_kwargs(parse_args(["serve", *flags])))
    assert message in str(err.value)


def test_a_missing_generation_config_fails_before_the_port_is_bound(zaya_dir, tmp_path):
    """The port is held by another socket: the generation-config error comes first, so nothing tried to bind."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for folder, why in ((tmp_path / "nowhere", "no such directory"),
                            (tmp_path, "the directory has no generation_config.json")):
            result = subprocess.run([sys.executable, "-m", "hybridserve.cli", "serve", str(zaya_dir), "--device",
                                     "cpu", "--port", str(port), "--generation-config", str(folder)],
                                    capture_output=True, text=True, timeout=120)
            assert result.returncode == 2, result.stderr
            assert result.stderr.startswith(f"error: invalid engine option generation_config='{folder}' "
                                            f"(--generation-config): {why}"), result.stderr


def test_generate_takes_the_generation_configs_defaults_under_its_flags(monkeypatch, capsys):
    """`hybridserve generate`: a flag given wins, then the model's generation config, then generate's own greedy
    64-token default."""
    import hybridserve
    from hybridserve.cli import main

    seen = []

    class FakeLLM:
        def __init__(self, model, **options):
            self.engine = SimpleNamespace(generation_config=SimpleNamespace(
                sampling_defaults={"temperature": 0.6, "top_k": 20, "max_tokens": 9}))

        def generate(self, prompt, params):
            seen.append(params)
            return [SimpleNamespace(outputs=[SimpleNamespace(text="out")])]

    monkeypatch.setattr(hybridserve, "LLM", FakeLLM)
    assert main(["generate", "org/m", "--device", "cpu", "--prompt", "hi", "--top-k", "5"]) == 0
    assert capsys.readouterr().out == "out\n"
    assert (seen[0].temperature, seen[0].top_k, seen[0].max_tokens, seen[0].top_p) == (0.6, 5, 9, 1.0)
    FakeLLM.__init__ = lambda self, model, **options: setattr(self, "engine", SimpleNamespace(
        generation_config=SimpleNamespace(sampling_defaults={})))
    assert main(["generate", "org/m", "--device", "cpu", "--prompt", "hi"]) == 0
    assert (seen[1].temperature, seen[1].max_tokens) == (0.0, 64)
