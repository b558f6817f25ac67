"""generation_config.json, as `--generation-config` (EngineConfig.generation_config, vLLM's option) picks it.

A model's generation_config.json says which tokens end a sequence (`eos_token_id`) and may recommend sampling
settings. `auto` reads the model directory's file: its end ids stop generation and its sampling settings are the
defaults of requests that leave those fields unset. `vllm` keeps the model's end ids but none of its sampling
settings (requests get SamplingParams' own defaults). A directory path reads that directory's file instead of the
model's, for both. Only these sampling keys are read (as vLLM reads them); `do_sample` and the rest are not.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridserve.config import EngineConfig
from hybridserve.options import option_flag
from hybridserve.sampling import SamplingParamError, SamplingParams

FILE_NAME = "generation_config.json"
MODEL_FILE = "auto"  # the model directory's file, sampling settings included
ENGINE_DEFAULTS = "vllm"  # the model's end ids only; SamplingParams' defaults for sampling
# generation_config.json key -> the SamplingParams field whose default it sets
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationConfig:
    """What the engine takes from the chosen generation_config.json (`source`: its path, None without one)."""

    source: Path | None = None
    eos_token_ids: tuple[int, ...] = ()
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> default value

    def describe(self) -> str:
        """The defaults for a start-up log line."""
        return ", ".join(f"{name}={value!r}" for name, value in self.sampling_defaults.items())


def _fail(choice: str, why: str) -> ValueError:
    flag = option_flag(EngineConfig, "generation_config")
    return ValueError(f"invalid engine option generation_config={choice!r} ({flag}): {why} (give auto, vllm or a "
                      f"directory holding {FILE_NAME})")


def generation_config_file(choice: str, model_dir: str) -> Path | None:
    """The file `choice` names: the model's (None where it has none) for auto and vllm; a directory's, which must
    exist, otherwise."""
    if choice in (MODEL_FILE, ENGINE_DEFAULTS):
        path = Path(model_dir) / FILE_NAME
        return path if path.is_file() else None
    directory = Path(choice).expanduser()
    if not directory.is_dir():
        raise _fail(choice, "no such directory")
    path = directory / FILE_NAME
    if not path.is_file():
        raise _fail(choice, f"the directory has no {FILE_NAME}")
    return path


def _read(path: Path, choice: str) -> dict:
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise _fail(choice, f"{path} cannot be read as JSON: {err}") from None
    if not isinstance(values, dict):
        raise _fail(choice, f"{path} must hold a JSON object")
    return values


def _eos_ids(values: dict, path: Path, choice: str) -> tuple[int, ...]:
    eos = values.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise _fail(choice, f"{path}: eos_token_id must be a token id or a list of them, not {eos!r}")
    return tuple(ids)


def _sampling_defaults(values: dict, path: Path, choice: str) -> dict[str, Any]:
    """The sampling keys the file sets (null ones are unset), each checked as SamplingParams checks a request's."""
    defaults = {SAMPLING_KEYS[key]: value for key, value in values.items()
                if key in SAMPLING_KEYS and value is not None}
    for key, name in SAMPLING_KEYS.items():
        if name in defaults:
            try:
                SamplingParams(**{name: defaults[name]})
            except SamplingParamError as err:
                raise _fail(choice, f"{path}: {key}={defaults[name]!r} {err.why}") from None
    return defaults


def load_generation_config(choice: str, model_dir: str) -> GenerationConfig:
    """The end ids and sampling defaults `choice` (auto, vllm or a directory) gives for the model in `model_dir`;
    a ValueError naming generation_config for a missing directory or file, or a file that does not parse."""
    path = generation_config_file(choice, model_dir)
    if path is None:
        return GenerationConfig()
    values = _read(path, choice)
    sampling = {} if choice == ENGINE_DEFAULTS else _sampling_defaults(values, path, choice)
    return GenerationConfig(path, _eos_ids(values, path, choice), sampling)
