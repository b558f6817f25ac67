"""Session-wide fixtures: one tiny ZAYA1 checkpoint (HF layout, with a real tokenizer) for engine tests."""
from __future__ import annotations

import os
from pathlib import Path

import torch

# Before anything imports Triton (torch._dynamo does, through transformers): `triton.language` decorates its own
# helpers (tl.sum, tl.sigmoid, ...) for the interpreter only if this is set when it is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _patch_the_language_once_a_launch() -> None:
    """Triton's interpreter re-patches triton.language (an inspect.getmembers walk of three modules, about 1.5 ms)
    on every call of a @triton.jit helper inside a kernel, though the launch patched the same module objects already
    and restores them when it ends: our kernels call helpers thousands of times a launch, half an interpreted
    test's time. Here a helper's call inside a launch skips the patch where the launch patched its language modules;
    what runs is unchanged."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
        patch, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    except (ImportError, AttributeError):  # another Triton: keep its own behaviour
        return
    patched: list[set[int]] = []  # per running launch, the language modules it patched

    def languages(fn) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}

    def patch_once(fn):
        if patched and patched[-1] and languages(fn) <= patched[-1]:
            return interpreter._LangPatchScope()
        scope = patch(fn)
        if patched:
            patched[-1] |= languages(fn)
        return scope

    def launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_a_launch()

# The suite runs in two pytest-xdist workers (pyproject's addopts) on CI's two cores: one intra-op thread each, so
# the workers do not oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

import hybridserve.engine.engine  # noqa: E402
import hybridserve.tokenizer  # noqa: E402
from tests.helpers import add_tokenizer  # noqa: E402
from tests.models.zaya_fixtures import random_hf_zaya, save_hf, tiny_config  # noqa: E402


def _share_engine_tokenizers() -> None:
    """Engines built in one test process share one tokenizer object per tokenizer files. transformers 5 builds the
    Qwen3 tokenizer from its tokenizer.json in Python, about 0.7 s a load, and most engine tests build several
    engines. Keyed by the directory's file names, sizes and modification times (a rewritten file loads
    afresh); a failed load is not kept. Engines only read their tokenizer; the server side, which sets its
    chat_template, keeps loading its own."""
    load = hybridserve.tokenizer.load_tokenizer
    loaded = {}

    def shared(path):
        directory = Path(path).resolve()
        if not directory.is_dir():  # the loader's own error
            return load(path)
        key = (directory, tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                       for f in os.scandir(directory) if f.is_file())))
        if key not in loaded:
            loaded[key] = load(path)
        return loaded[key]

    hybridserve.tokenizer.load_tokenizer = shared
    hybridserve.engine.engine.load_tokenizer = shared


_share_engine_tokenizers()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked `gpu` (pyproject's markers) is skipped on a machine with fewer CUDA GPUs than it asks for.
    Files marked `heavy` go first (a stable sort: their order and the rest's are kept), so that pytest-xdist hands
    them out first and the two CI workers end together instead of one finishing a long file alone."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
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
