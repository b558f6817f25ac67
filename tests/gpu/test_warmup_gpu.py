"""The start-up warm-up leaves nothing to compile: after `LLM(...)` returns, a run with prompts of many lengths,
several batch sizes, chunked prefill, prefix hits and decode (also speculative: verify steps, MTP drafting) adds no
compiled variant to any Triton kernel of ours.

Each `triton.jit` function keeps its compiled variants per device (`device_caches[device][0]`, triton 3.x); the test
counts them over every kernel in `hybridserve.ops.triton` before and after the run and names any new one.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from tests.gpu.models import write_two_layer_model

pytestmark = pytest.mark.gpu(engine=True)


def _compiled_variants() -> dict[str, set]:
    """Each kernel's compiled variants, as Triton keys them: (per-argument (type, specialization), options)."""
    from triton.runtime.jit import JITFunction

    import hybridserve.ops.triton as package

    variants = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction):
                variants[f"{info.name}.{name}"] = (fn, {key for cache in fn.device_caches.values() for key in cache[1]})
    return variants


def _why(fn, key: tuple, known: set) -> str:
    """The arguments in which a new variant differs from the nearest variant compiled at start-up."""
    def differences(old: tuple) -> list[str]:
        changed = [f"{name}: {a}->{b}" for name, a, b in zip(fn.arg_names, old[0], key[0]) if a != b]
        return changed + (["options"] if old[1] != key[1] else [])
    return ", ".join(min((differences(old) for old in known), key=len)) if known else "no variant at start-up"


@pytest.mark.parametrize("model, speculative", [
    ("zaya", None), ("ling", None),
    ("zaya", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}),
    ("ling", {"method": "mtp", "num_speculative_tokens": 3}),
], ids=["zaya", "ling", "zaya-ngram", "ling-mtp"])
def test_no_kernel_compiles_after_start_up(model: str, speculative: dict | None, tmp_path: Path) -> None:
    write_two_layer_model(model, tmp_path, mtp=speculative is not None and speculative["method"] == "mtp", bf16=True)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", max_num_batched_tokens=512, max_running_requests=24,
              max_model_len=2048, gpu_memory_utilization=0.2, use_tqdm=False, speculative_config=speculative)
    before = _compiled_variants()
    assert any(keys for _, keys in before.values())  # the warm-up compiled something
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 2, 7, 15, 16, 17, 31, 33, 64, 100, 127, 129, 300, 511, 700, 1500]
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in lengths]
    shared = prompts[-1][:600]
    prompts += [shared + [5] * 20, shared + [6] * 3]  # prefix hits on the cached 1500-token prompt
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=25, ignore_eos=True, seed=1)
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    for batch in (1, 3, 17):
        llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], sampled)
    after = _compiled_variants()
    new = [f"{name} ({_why(fn, key, before[name][1])})" for name, (fn, keys) in after.items()
           for key in keys - before[name][1]]
    assert not new, "compiled after start-up:\n" + "\n".join(new)
