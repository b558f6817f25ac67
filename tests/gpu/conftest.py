"""Each GPU test gives its device memory back before the next one starts: an engine kept alive by a reference cycle
(a test's patched method closing over its runner) still holds its caches, and the next engine's memory plan,
which counts what this process holds, would find nothing left."""
from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def release_device_memory() -> Iterator[None]:
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
