"""Two-layer checkpoints at the real widths, shared by the GPU engine tests."""
from __future__ import annotations

from pathlib import Path

from hybridserve.demo import write_random_checkpoint
from tests.gpu.test_ling_gpu import FLASH
from tests.gpu.test_zaya_gpu import ZAYA1_8B_SHAPED
from tests.helpers import add_tokenizer
from tests.reference.ling_naive import random_ling_checkpoint, write_checkpoint


def write_two_layer_model(model: str, directory: Path) -> None:
    """ZAYA1-8B widths (2 layers) or Ling-2.6-flash widths (one lightning + one MLA layer), random, with a
    tokenizer."""
    if model == "zaya":
        write_random_checkpoint(directory, ZAYA1_8B_SHAPED | {"num_hidden_layers": 2})
    else:
        write_checkpoint(directory, FLASH, random_ling_checkpoint(FLASH, 0))
    add_tokenizer(directory)


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
