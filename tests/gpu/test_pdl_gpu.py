"""Programmatic dependent launch changes when a kernel starts, never what it computes: the same prompts decoded from
CUDA graphs with PDL off and on (HYBRIDSERVE_PDL=1) must give the same greedy tokens and logprobs within fp32
rounding (the split-K reductions add in whatever order their programs finish), on both models (two layers at the
real widths, fp32 as in the graph test). A kernel reading its inputs before its griddepcontrol.wait would race the
kernel before it: a stale row is off by far more than rounding."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.ops.triton import pdl
from tests.gpu.models import largest_logprob_difference, write_two_layer_model

pytestmark = pytest.mark.gpu(engine=True)


def _generate(directory: Path, use_pdl: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    monkeypatch.setenv("HYBRIDSERVE_PDL", "1" if use_pdl else "0")
    pdl._enabled.cache_clear()
    assert pdl.launch(torch.device("cuda")) == ({"USE_PDL": True, "launch_pdl": True} if use_pdl else
                                                {"USE_PDL": False})
    llm = LLM(str(directory), dtype="float32", device="cuda", max_num_batched_tokens=1024, max_running_requests=16,
              max_model_len=2048, gpu_memory_utilization=0.2, use_tqdm=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()}
               for n in (5, 40, 130, 17, 300, 64, 9, 700, 33)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    del llm
    torch.cuda.empty_cache()
    return outputs


@pytest.mark.parametrize("model", ["zaya", "ling"])
def test_pdl_changes_nothing_computed(model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm90 or later")
    write_two_layer_model(model, tmp_path)
    try:
        expected = _generate(tmp_path, False, monkeypatch)
        got = _generate(tmp_path, True, monkeypatch)
    finally:
        monkeypatch.delenv("HYBRIDSERVE_PDL")
        pdl._enabled.cache_clear()  # the next test sees the environment as it was
    worst = largest_logprob_difference(expected, got)
    print(f"\n{model}: largest logprob difference PDL on vs off {worst:.2e}")
    assert worst <= 1e-5
