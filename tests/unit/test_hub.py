"""Model ids through huggingface_hub (hybridserve/hub.py), offline against a cache laid out by its conventions
(tests/unit/hub_cache.py): ids and revisions resolve to their snapshots, LLM() takes an id, and each way of not
finding a model is one clear error before anything starts."""
from __future__ import annotations

import shutil

import pytest
from huggingface_hub import constants

from hybridserve import LLM, SamplingParams
from hybridserve.cli import main
from hybridserve.config import EngineConfig
from hybridserve.hub import ModelNotFoundError, local_checkpoint
from tests.unit.hub_cache import cache_repo


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def cache(zaya_dir, tmp_path):
    cache_repo(tmp_path / "hub", "org/tiny-zaya", zaya_dir)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(zaya_dir / "config.json", config_only)
    cache_repo(tmp_path / "hub", "org/tiny-zaya", config_only, revision="no-weights")
    return tmp_path / "hub"


def test_ids_and_revisions_resolve_to_their_cached_snapshots(offline, cache):
    config = local_checkpoint(EngineConfig(model="org/tiny-zaya", download_dir=str(cache), tokenizer="org/tiny-zaya"))
    main_commit = (cache / "models--org--tiny-zaya" / "refs" / "main").read_text()
    assert config.model == str(cache / "models--org--tiny-zaya" / "snapshots" / main_commit)
    assert config.tokenizer == config.model
    by_commit = local_checkpoint(EngineConfig(model="org/tiny-zaya", download_dir=str(cache), revision=main_commit))
    assert by_commit.model == config.model
    dummy = local_checkpoint(EngineConfig(model="org/tiny-zaya", download_dir=str(cache), revision="no-weights",
                                          load_format="dummy"))
    no_weights = (cache / "models--org--tiny-zaya" / "refs" / "no-weights").read_text()
    assert dummy.model.endswith(no_weights)


def test_llm_takes_a_hub_id(offline, cache):
    llm = LLM("org/tiny-zaya", download_dir=str(cache), device="cpu", dtype="float32", use_tqdm=False,
              kv_cache_memory_bytes=16 << 20)
    (out,) = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("name, message", [
    ("org/not-cached", "neither a local directory nor in the Hugging Face cache .*HF_HUB_OFFLINE is set"),
    ("./no/such/dir", "the local path ./no/such/dir does not exist"),
    ("/no/such/dir", "the local path /no/such/dir does not exist"),
])
def test_a_model_that_is_not_found_says_which_case_it_is(offline, cache, name, message):
    with pytest.raises(ModelNotFoundError, match=message):
        local_checkpoint(EngineConfig(model=name, download_dir=str(cache)))


def test_a_directory_that_is_not_a_checkpoint_is_named(tmp_path):
    with pytest.raises(ModelNotFoundError, match=f"{tmp_path} is not a Hugging Face checkpoint: .* no config.json"):
        local_checkpoint(EngineConfig(model=str(tmp_path)))


def test_serve_checks_the_model_before_it_opens_the_port(offline, cache, capsys):
    """A model that cannot be found ends `hybridserve serve` at once (exit 2, the reason on stderr), before the
    port is bound or the engine starts."""
    assert main(["serve", "org/not-cached", "--download-dir", str(cache), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "org/not-cached is neither a local directory nor in the Hugging Face cache" in err
    assert "cannot listen" not in err  # port 1 would have been refused: it was never tried
