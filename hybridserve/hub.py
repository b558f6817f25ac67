"""Model ids from the Hugging Face Hub: `hybridserve serve Zyphra/ZAYA1-8B` and `LLM("inclusionAI/Ling-2.6-flash")`.

A model that is not a local directory is an id, resolved by huggingface_hub itself into a snapshot of its cache
(`models--ORG--NAME/snapshots/COMMIT`, reached through `refs/REVISION`): `snapshot_download` fetches only what the
engine reads (config, safetensors and their index, tokenizer files; no weights for `load_format="dummy"`) with
its progress bars, or, when HF_HUB_OFFLINE is set, finds the snapshot already cached. The token is
huggingface_hub's own (HF_TOKEN, or a `hf auth login`); `revision` and `download_dir` (its `cache_dir`) pass
through. Everything is checked before the engine starts, and a failure says which case it is: a local path that
does not exist, an id that is not in the cache while offline, an id the Hub does not know (or will not show
without a token), a directory that is not an HF checkpoint (no config.json).
"""
from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

from hybridserve.config import EngineConfig

logger = logging.getLogger(__name__)

CONFIG_FILES = ["config.json", "generation_config.json"]
WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json"]
_REPO_ID = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)?")  # NAME or ORG/NAME, as the Hub allows them


class ModelNotFoundError(ValueError):
    """The model (or tokenizer) cannot be found: the message says why and what to do."""


def looks_like_repo_id(name: str) -> bool:
    return _REPO_ID.fullmatch(name) is not None and not name.endswith((".", "-"))


def local_checkpoint(config: EngineConfig) -> EngineConfig:
    """`config` with its model (and tokenizer) as local directories, downloaded first if they are Hub ids."""
    weights = WEIGHT_FILES if config.load_format != "dummy" else []
    model = checkpoint_dir(config.model, config.revision, config.download_dir,
                           CONFIG_FILES + weights + TOKENIZER_FILES, config.use_tqdm)
    check_checkpoint(model, config.model)
    tokenizer = config.tokenizer
    if tokenizer is not None:
        tokenizer = str(checkpoint_dir(tokenizer, config.revision, config.download_dir, TOKENIZER_FILES,
                                       config.use_tqdm))
    return replace(config, model=str(model), tokenizer=tokenizer)


def checkpoint_dir(name: str, revision: str | None, download_dir: str | None, patterns: list[str],
                   progress: bool) -> Path:
    """A local directory as it is, or a Hub id's snapshot (the files matching `patterns`)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{name} is a file; give the checkpoint's directory (or a Hugging Face Hub id)")
    if not looks_like_repo_id(name):
        raise ModelNotFoundError(f"the local path {name} does not exist (and it is not a Hugging Face Hub id, "
                                 "which is NAME or ORG/NAME)")
    return _snapshot(name, revision, download_dir, patterns, progress)


def _snapshot(repo_id: str, revision: str | None, download_dir: str | None, patterns: list[str],
              progress: bool) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    cache = download_dir or constants.HF_HUB_CACHE
    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    offline = constants.HF_HUB_OFFLINE
    logger.info("%s: not a local directory, %s the Hugging Face Hub cache %s", repo_id,
                "looking it up (HF_HUB_OFFLINE is set) in" if offline else "fetching it into", cache)
    silence = not progress and not are_progress_bars_disabled()
    if silence:
        disable_progress_bars()
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns,
                                 local_files_only=offline)
    except LocalEntryNotFoundError:
        if offline:
            raise ModelNotFoundError(f"{where} is neither a local directory nor in the Hugging Face cache {cache}, "
                                     "and HF_HUB_OFFLINE is set: download it once without HF_HUB_OFFLINE (or give "
                                     "--download-dir where it is cached, or a local path)") from None
        raise ModelNotFoundError(f"{where} is not in the Hugging Face cache {cache} and the Hub cannot be reached; "
                                 "check the network, or give a local path") from None
    except GatedRepoError:
        raise ModelNotFoundError(f"{repo_id} is gated on the Hugging Face Hub: accept its terms on its page and set "
                                 "HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{repo_id} is neither a local directory nor a model on the Hugging Face Hub (a "
                                 "private one needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{repo_id} has no revision {revision!r} on the Hugging Face Hub") from None
    finally:
        if silence:
            enable_progress_bars()
    logger.info("%s: using the snapshot %s", where, path)
    return Path(path)


def check_checkpoint(path: Path, name: str) -> None:
    """An HF-layout checkpoint has a config.json (its weights are the loader's to find: it names what is missing)."""
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{name} is not a Hugging Face checkpoint: {path} has no config.json")
