"""Session-wide fixtures: one tiny ZAYA1 checkpoint (HF layout, with a real tokenizer) for engine tests."""
from __future__ import annotations

import os

import torch

# Before anything imports Triton (torch._dynamo does, through transformers): `triton.language` decorates its own
# helpers (tl.sum, tl.sigmoid, ...) for the interpreter only if this is set when it is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# The suite runs in two pytest-xdist workers (pyproject's addopts) on CI's two cores: one intra-op thread each, so
# the workers do not oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from tests.helpers import add_tokenizer  # noqa: E402
from tests.models.zaya_fixtures import random_hf_zaya, save_hf, tiny_config  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked `gpu` (pyproject's markers) is skipped on a machine with fewer CUDA GPUs than it asks for."""
    gpus = torch.cuda.device_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        wanted = marker.kwargs.get("devices", 1) if marker is not None else 0
        if gpus < wanted:
            item.add_marker(pytest.mark.skip(reason=f"needs {wanted} CUDA GPUs" if wanted > 1 else "needs a CUDA GPU"))


@pytest.fixture(scope="session")
def zaya_dir(tmp_path_factory):
    directory = save_hf(random_hf_zaya(tiny_config("base"), seed=21), tmp_path_factory.mktemp("zaya-engine"))
    add_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def ling_dir(tmp_path_factory):
    from tests.reference.ling_naive import (
        random_ling_checkpoint,
        tiny_ling_config,
        write_checkpoint,
    )

    config = tiny_ling_config()
    directory = tmp_path_factory.mktemp("ling-engine")
    write_checkpoint(directory, config, random_ling_checkpoint(config, seed=22))
    add_tokenizer(directory)
    return directory
