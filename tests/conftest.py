"""Session-wide fixtures: one tiny ZAYA1 checkpoint (HF layout, with a real tokenizer) for engine tests."""
from __future__ import annotations

import pytest

from tests.helpers import add_tokenizer
from tests.models.zaya_fixtures import random_hf_zaya, save_hf, tiny_config


@pytest.fixture(scope="session")
def zaya_dir(tmp_path_factory):
    directory = save_hf(random_hf_zaya(tiny_config("base"), seed=21), tmp_path_factory.mktemp("zaya-engine"))
    add_tokenizer(directory)
    return directory
