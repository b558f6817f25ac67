"""No device->host sync while a step is queued (docs/architecture.md, "Ops and kernels"), checked on the H200 around
the whole of `ModelRunner.launch` — not only the forward that a CUDA-graph capture covers, but what surrounds it:
table updates, page copies, prefix-cache restores and snapshots, the verify rows' commit, penalties and min_tokens
bans, seeded sampling, logprobs with logprob_token_ids, n > 1 forks and the draft layer (Ling's MTP), eager and with
CUDA graphs.

Two rounds of the same prompts, so the second round restores cached state. Drafts are replayed (random, so verify
rows accept few of them) to make every decode step of the speculative runs a verify step. A sync inside `launch`
raises; the engine then fails the request that hit it, so every output must end normally with all its tokens.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.engine.drafts import ReplayDrafts
from tests.gpu.models import write_two_layer_model
from tests.gpu.sync import no_host_sync

pytestmark = pytest.mark.gpu(engine=True)


def mixed_params() -> list[SamplingParams]:
    common = dict(max_tokens=14, logprobs=2)
    return [
        SamplingParams(temperature=0, ignore_eos=True, logprob_token_ids=[5, 17, 900], **common),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=5, ignore_eos=True, **common),
        SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, seed=1, ignore_eos=True,
                       logprob_token_ids=[3], **common),
        SamplingParams(temperature=0, repetition_penalty=1.3, ignore_eos=True, **common),
        SamplingParams(temperature=1.0, min_p=0.05, min_tokens=10, seed=2, **common),
        SamplingParams(temperature=0.9, n=2, seed=7, ignore_eos=True, **common),
    ]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("model, method", [("zaya", "ngram"), ("ling", "mtp")])
def test_launch_queues_steps_without_host_sync(model: str, method: str, eager: bool, tmp_path: Path) -> None:
    write_two_layer_model(model, tmp_path, mtp=method == "mtp")
    llm = LLM(str(tmp_path), dtype="float32", device="cuda", max_num_batched_tokens=512, max_running_requests=16,
              max_model_len=2048, gpu_memory_utilization=0.25, use_tqdm=False, enforce_eager=eager,
              speculative_config={"method": method, "num_speculative_tokens": 3})
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (40, 300, 600, 17, 530, 270)]
    drafts = {tuple(p): torch.randint(3, 1000, (40,), generator=gen).tolist() for p in prompts}
    llm.engine.set_draft_source(ReplayDrafts(drafts, key=lambda request: tuple(request.prompt_token_ids)))

    runner, seen = llm.engine.runner, {"steps": 0, "verify": 0, "restores": 0, "snapshots": 0}
    launch = runner.launch

    def launch_without_sync(plan):
        seen["steps"] += 1
        seen["verify"] += any(chunk.num_drafts for chunk in plan.chunks)
        seen["restores"] += bool(plan.cache_ops.restores or plan.cache_ops.page_restores)
        seen["snapshots"] += bool(plan.cache_ops.snapshots)
        with no_host_sync():
            return launch(plan)

    runner.launch = launch_without_sync
    params = mixed_params()
    for _ in range(2):  # the second round hits the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for output, p in zip(outputs, params):
            assert output.error is None and len(output.outputs) == p.n
            for sequence in output.outputs:
                assert sequence.finish_reason in ("length", "stop"), sequence.finish_reason
                assert len(sequence.token_ids) >= p.min_tokens and len(sequence.logprobs) == len(sequence.token_ids)
                assert all(set(p.logprob_token_ids) <= set(position) for position in sequence.logprobs)
    print(f"\n{model} {method} {'eager' if eager else 'graphs'}: {seen}")
    assert seen["verify"] > 5 and seen["restores"] > 0
    assert seen["snapshots"] > 0 or not llm.engine.scheduler.sparse  # per-page state is written by the forward
