"""The offline workloads: seeded random prompts of token ids and output lengths per scenario, shared by the
throughput and profile modes so that a profile explains the throughput's rates."""
from __future__ import annotations

import random
from dataclasses import dataclass

from hybridserve.structured import StructuredOutputParams


@dataclass(frozen=True)
class Scenario:
    requests: int
    min_input: int
    max_input: int
    min_output: int
    max_output: int
    prefill: bool = False  # rate = prompt tokens / s (else output tokens / s)


SCENARIOS = {"b1": Scenario(1, 512, 512, 128, 128), "b16": Scenario(16, 100, 512, 128, 128),
             "b64": Scenario(64, 100, 512, 128, 128),
             "nano": Scenario(256, 100, 1024, 100, 1024), "prefill": Scenario(64, 512, 512, 1, 1, prefill=True),
             "smoke": Scenario(2, 16, 32, 4, 4)}
# --json-grammar: a JSON language no output completes within the budgets above, so every draw is masked.
BENCH_GRAMMAR = StructuredOutputParams(json={"type": "array", "items": {"type": "string", "maxLength": 16},
                                             "minItems": 100000})


def workload(scenario: Scenario, seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) of `scenario`."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 20000) for _ in range(rng.randint(scenario.min_input, scenario.max_input))]
               for _ in range(scenario.requests)]
    return prompts, [rng.randint(scenario.min_output, scenario.max_output) for _ in prompts]


def counted_tokens(name: str, prompts: list[list[int]], outputs: list[int]) -> int:
    """The tokens scenario `name`'s rate counts: the prompts' for prefill, else the outputs'."""
    return sum(map(len, prompts)) if SCENARIOS[name].prefill else sum(outputs)


def unit(name: str) -> str:
    return "prefill tok/s" if SCENARIOS[name].prefill else "output tok/s"
