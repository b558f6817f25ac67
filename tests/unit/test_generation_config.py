"""--generation-config (vLLM's): auto reads the model's generation_config.json for its end ids and sampling
defaults, vllm keeps the end ids only, a directory's file replaces the model's; a missing directory or file, or a
file that does not parse or holds an impossible default, is an error naming the option."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridserve.generation_config import load_generation_config

MODEL = {"eos_token_id": [5, 7], "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": None, "do_sample": True,
         "repetition_penalty": 1.1, "max_new_tokens": 12, "bos_token_id": 1}


def _directory(path: Path, values: dict | str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(values if isinstance(values, str) else json.dumps(values))
    return path


def test_auto_reads_the_models_end_ids_and_sampling_defaults(tmp_path):
    model = _directory(tmp_path / "model", MODEL)
    config = load_generation_config("auto", str(model))
    assert config.eos_token_ids == (5, 7) and config.source == model / "generation_config.json"
    # the five sampling keys and max_new_tokens (as max_tokens); null ones, do_sample and the rest are not read
    assert config.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                                        "max_tokens": 12}
    assert "temperature=0.6" in config.describe()


def test_vllm_keeps_the_end_ids_but_no_sampling_defaults(tmp_path):
    config = load_generation_config("vllm", str(_directory(tmp_path / "model", MODEL)))
    assert config.eos_token_ids == (5, 7) and config.sampling_defaults == {}


def test_a_model_without_the_file_has_no_defaults(tmp_path):
    (tmp_path / "model").mkdir()
    for choice in ("auto", "vllm"):
        config = load_generation_config(choice, str(tmp_path / "model"))
        assert (config.source, config.eos_token_ids, config.sampling_defaults) == (None, (), {})


def test_a_directory_replaces_the_models_file(tmp_path):
    model = _directory(tmp_path / "model", MODEL)
    other = _directory(tmp_path / "other", {"eos_token_id": 9, "temperature": 0.0})
    config = load_generation_config(str(other), str(model))
    assert config.eos_token_ids == (9,) and config.sampling_defaults == {"temperature": 0.0}


@pytest.mark.parametrize("make, why", [
    (lambda d: d / "missing", "no such directory"),
    (lambda d: d, "the directory has no generation_config.json"),
    (lambda d: _directory(d / "bad", "{not json"), "cannot be read as JSON"),
    (lambda d: _directory(d / "list", "[1]"), "must hold a JSON object"),
    (lambda d: _directory(d / "hot", {"temperature": 5.0}), "temperature=5.0 must be in [0, 2]"),
    (lambda d: _directory(d / "topp", {"top_p": 0}), "top_p=0 must be in (0, 1]"),
    (lambda d: _directory(d / "eos", {"eos_token_id": "x"}), "eos_token_id must be a token id"),
])
def test_bad_choices_are_errors_naming_the_option(tmp_path, make, why):
    (tmp_path / "model").mkdir()
    with pytest.raises(ValueError) as err:
        load_generation_config(str(make(tmp_path)), str(tmp_path / "model"))
    assert "generation_config=" in str(err.value) and "(--generation-config)" in str(err.value)
    assert why in str(err.value)


def test_requests_take_the_defaults_for_the_fields_they_leave_null():
    """The server's three generating routes: a field the request sets wins, a null one takes the model's default;
    max_tokens is left to ServerState.default_max_tokens (after completions' own 16)."""
    from hybridserve.server.protocol import ChatCompletionRequest, CompletionRequest
    from hybridserve.server.responses_protocol import ResponsesRequest

    defaults = {"temperature": 0.0, "top_p": 0.5, "repetition_penalty": 1.2, "max_tokens": 3}
    completion = CompletionRequest(prompt=[1], temperature=0.7).to_sampling_params(defaults)
    assert (completion.temperature, completion.top_p, completion.repetition_penalty, completion.max_tokens) == \
        (0.7, 0.5, 1.2, 16)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.9).to_sampling_params(defaults)
    assert (chat.temperature, chat.top_p, chat.repetition_penalty, chat.max_tokens) == (0.0, 0.9, 1.2, None)
    response = ResponsesRequest(input="hi").sampling_params(defaults)
    assert (response.temperature, response.top_p, response.max_tokens) == (0.0, 0.5, None)
    assert CompletionRequest(prompt=[1]).to_sampling_params({}).temperature == 1.0  # --generation-config vllm
