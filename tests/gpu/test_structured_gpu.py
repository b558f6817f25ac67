"""Structured output on the H200: grammar masks uploaded and applied on the device beside CUDA-graph decode and
overlapped scheduling give the tokens of eager, serial decode (fp32 two-layer ZAYA1-8B widths, vocabulary 262k with
the bundled tokenizer, so most ids are never allowed), every output matches its grammar, and applying a mask never
synchronises with the host."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.structured import StructuredOutputParams
from hybridserve.structured.bitmask import TokenMask, apply_token_mask, words_for
from tests.gpu.models import largest_logprob_difference, write_two_layer_model
from tests.gpu.sync import no_host_sync

pytestmark = pytest.mark.gpu(engine=True)

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 4},
                                           "name": {"type": "string", "maxLength": 8}},
          "required": ["id", "tags", "name"], "additionalProperties": False}
REGEX = r"[A-Z]{3}-\d{3,5}"


def test_masked_graph_decode_matches_eager(tmp_path: Path) -> None:
    write_two_layer_model("zaya", tmp_path)
    options = dict(dtype="float32", device="cuda", max_num_batched_tokens=1024, max_running_requests=32,
                   max_model_len=1024, gpu_memory_utilization=0.2, use_tqdm=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()}
               for n in (5, 40, 130, 17, 300, 64, 9, 200, 33, 250, 80, 3)]
    kinds = [StructuredOutputParams(json=SCHEMA), StructuredOutputParams(regex=REGEX), None]
    params = [SamplingParams(temperature=0, max_tokens=120, logprobs=1, structured_output=kinds[i % 3])
              for i in range(len(prompts))]
    params[4] = SamplingParams(temperature=0.9, seed=4, max_tokens=120, logprobs=1,
                               structured_output=StructuredOutputParams(json=SCHEMA))

    eager = LLM(str(tmp_path), enforce_eager=True, disable_overlap_schedule=True, **options)
    expected = eager.generate(prompts, params)
    del eager
    torch.cuda.empty_cache()
    llm = LLM(str(tmp_path), **options)
    assert llm.engine.runner.graphs is not None
    got = llm.generate(prompts, params)
    worst = largest_logprob_difference(expected, got)
    print(f"\nstructured output: largest logprob difference graphs vs eager {worst:.2e}")
    assert worst <= 2e-5
    for p, output in zip(params, got):
        completion = output.outputs[0]
        if p.structured_output is None:
            continue
        assert completion.finish_reason == "stop", completion.text
        if p.structured_output.kind == "json":
            jsonschema.validate(json.loads(completion.text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, completion.text)


def test_applying_a_mask_never_syncs() -> None:
    vocab = 262272
    logits = torch.randn(64, vocab, device="cuda")
    rows = list(range(0, 64, 2))
    host = TokenMask.allocate(rows, vocab)
    host.bits[:, ::3] = 0
    with no_host_sync():
        out = apply_token_mask(logits, host.to(logits.device))
    expected = logits.clone()
    allowed = torch.ones(words_for(vocab) * 32, dtype=torch.bool)
    allowed.view(-1, 32)[::3] = False
    expected[rows] = expected[rows].masked_fill(~allowed[:vocab].cuda(), float("-inf"))
    assert torch.equal(out, expected)
