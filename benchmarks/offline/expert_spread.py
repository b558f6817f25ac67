"""The routed experts a decode step reads, counted. The bandwidth floor (hybridserve/models/bandwidth_floor.py)
counts the distinct experts a batch's independent, uniform choices would touch, what a load-balanced model
approaches. Random (dummy) weights route less evenly: ZAYA1-8B's random model at 64 tokens reads 12.8 of its 16
experts a layer (its first four layers on CPU, the b64 scenario), where the floor counts 15.7. Such a step moves
fewer expert bytes than the floor says, and its fraction of the floor overstates. `count_experts` runs a scenario
once more, eagerly, with every MoE layer's expert call watched (a host read of its choices: untimed), and returns
the mean number of distinct experts a layer read in the steps that held the whole batch; the throughput
benchmark's `--count-experts` reports the floor at that count beside the uniform one."""
from __future__ import annotations

import gc
import statistics
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybridserve.layers.moe import StackedExperts
from hybridserve.llm import LLM
from hybridserve.sampling import SamplingParams


def distinct_experts(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> int:
    """Experts whose weights a call with these choices reads: the distinct valid ids of nonzero weight (ZAYA1's
    MOD skip reads none)."""
    ids = topk_ids.reshape(-1).long()
    read = (topk_weights.reshape(-1) != 0) & (ids >= 0) & (ids < num_experts)
    return int(torch.unique(ids[read]).numel())


@contextmanager
def watched_experts(tokens: int) -> Iterator[list[int]]:
    """Within: every expert call of `tokens` tokens appends its `distinct_experts` (counted after the call, which
    writes the choices where the experts' launches make a deferred selection). A call inside another (the residual
    norm form's reduce under TP) is counted once."""
    counts: list[int] = []
    methods = {name: getattr(StackedExperts, name) for name in ("forward", "forward_residual_norm")}
    depth = [0]

    def watched(method):
        def call(self, x, topk_ids, topk_weights, *args, **kwargs):
            depth[0] += 1
            try:
                out = method(self, x, topk_ids, topk_weights, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0 and x.shape[0] == tokens:
                counts.append(distinct_experts(topk_ids, topk_weights, self.gate_up_proj.shape[0]))
            return out
        return call

    for name, method in methods.items():
        setattr(StackedExperts, name, watched(method))
    try:
        yield counts
    finally:
        for name, method in methods.items():
            setattr(StackedExperts, name, method)


def count_experts(model_dir: str, prompts: list[list[int]], params: list[SamplingParams],
                  engine_options: dict) -> float | None:
    """Mean distinct experts a MoE layer read in the steps of `prompts` (all running at once) of as many tokens
    as prompts: their decode steps (a prefill step of that length, were there one, would count too), on an eager
    engine (`engine_options`: the timed engine's, CUDA graphs off); None if no step held them all."""
    llm = LLM(model_dir, **(engine_options | dict(enforce_eager=True, max_running_requests=len(prompts))))
    try:
        with watched_experts(len(prompts)) as counts:
            llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return statistics.fmean(counts) if counts else None
