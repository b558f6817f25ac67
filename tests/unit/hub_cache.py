"""A Hugging Face Hub cache written as huggingface_hub lays it out, for tests that run offline: under CACHE,
`models--ORG--NAME/blobs/<sha256>` holds each file, `snapshots/<commit>/<file>` links to its blob and
`refs/<revision>` names the commit."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_repo(cache: Path, repo_id: str, files: Path, revision: str = "main") -> str:
    """Put every file of the directory `files` in `cache` as repo `repo_id` at `revision`; its commit hash."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in sorted(files.iterdir()):
        if not path.is_file():
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit
