"""Two-layer checkpoints at the real widths, shared by the GPU engine tests.

Each variant is generated once per machine (Ling-2.6-flash's two layers are 3.3 B random parameters: most of a
test's set-up time) into a cache directory (`HYBRIDSERVE_TEST_MODELS`, default under the system's temp directory),
under a file lock so that test files running in parallel wait for one writer, and linked file by file into the
directory a test asks for."""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from hybridserve.demo import write_random_checkpoint
from tests.gpu.test_zaya_gpu import ZAYA1_8B_SHAPED
from tests.helpers import add_tokenizer
from tests.reference.ling_naive import flash_config, random_ling_checkpoint, write_checkpoint

FLASH = flash_config()  # layer 0: lightning + dense FFN; layer 1: MLA + 256-expert MoE
# Ling-2.6-flash widths with the MTP layer (a third MoE layer): 64 experts in the same 8 groups instead of 256, so
# that the fp32 model stays near 10 GB and several such tests fit on one GPU side by side.
FLASH_MTP = FLASH | {"num_nextn_predict_layers": 1, "num_experts": 64}


def _generate(model: str, directory: Path, mtp: bool, bf16: bool) -> None:
    if model == "zaya":
        write_random_checkpoint(directory, ZAYA1_8B_SHAPED | {"num_hidden_layers": 2})  # bf16, routers fp32
    else:
        config = FLASH_MTP if mtp else FLASH
        tensors = random_ling_checkpoint(config, 0)
        write_checkpoint(directory, config, {n: t.bfloat16() for n, t in tensors.items()} if bf16 else tensors)
    add_tokenizer(directory)


def write_two_layer_model(model: str, directory: Path, *, mtp: bool = False, bf16: bool = False) -> None:
    """ZAYA1-8B widths (2 layers) or Ling-2.6-flash widths (one lightning + one MLA layer; `mtp`: with its MTP
    layer), random, with a tokenizer, in `directory`; `bf16`: Ling's tensors stored in bf16 (as released; ZAYA1's
    always are)."""
    name = f"{model}{'-mtp' if mtp and model == 'ling' else ''}{'-bf16' if bf16 and model == 'ling' else ''}"
    cache = Path(os.environ.get("HYBRIDSERVE_TEST_MODELS", Path(tempfile.gettempdir()) / "hybridserve-test-models"))
    cache.mkdir(parents=True, exist_ok=True)
    ready = cache / name
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer; the others wait and then find it ready
        if not ready.exists():
            partial = Path(tempfile.mkdtemp(dir=cache, prefix=f"{name}."))
            try:
                _generate(model, partial, mtp, bf16)
                partial.rename(ready)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    for path in ready.iterdir():
        (directory / path.name).symlink_to(path)


def largest_logprob_difference(expected: list, got: list) -> float:
    """Assert that two runs' greedy tokens are equal (first sequence of each output) and return the largest
    difference between their logprobs."""
    worst = 0.0
    for want, have in zip(expected, got, strict=True):
        a, b = want.outputs[0], have.outputs[0]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            worst = max([worst] + [abs(x[t] - y[t]) for t in x])
    return worst
