"""Ling's MTP (NEXTN) drafts: every chain of drafts the engine proposes equals the chain the naive reference's MTP
layer (tests/reference/ling_naive.py) computes from the same tokens, after prefill in chunks, after verify
rows that accepted none, some or all of their drafts; greedy output equals the plain run's."""
from __future__ import annotations

import random

import pytest
import torch

from hybridserve import SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine.drafts import ModelDrafts, ReplayDrafts
from hybridserve.engine.engine import LLMEngine
from tests.helpers import finish_all
from tests.reference.ling_naive import NaiveLing, load_checkpoint

K = 3
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _naive_chain(naive: NaiveLing, tokens: list[int], k: int) -> list[int]:
    """The MTP drafts after `tokens` (its last token is the one the next step runs first): the layer over every
    earlier position with its next token and the target's hidden state, then a chain of k - 1 single steps."""
    hidden = naive.step_hidden(naive.new_sequence(), tokens[:-1])
    mtp = naive.new_mtp_sequence()
    out, logits = naive.mtp_step(mtp, tokens[1:], hidden)
    drafts = [int(logits[-1].argmax())]
    out = out[-1:]
    for _ in range(k - 1):
        out, logits = naive.mtp_step(mtp, drafts[-1:], out)
        drafts.append(int(logits[-1].argmax()))
    return drafts


class _Recording:
    """A draft source that records, whenever asked, the request's tokens and the MTP drafts it holds."""

    def __init__(self, source):
        self.source, self.records = source, []

    def propose(self, request, limit):
        self.records.append((request.prompt_token_ids + request.output_token_ids, list(request.draft_token_ids)))
        return self.source.propose(request, limit)


@pytest.mark.parametrize("source", ["mtp", "replayed"])
def test_mtp_drafts_equal_the_naive_chain(ling_dir, source):
    """`mtp`: the MTP drafts are verified (random weights: nearly all rejected); `replayed`: the plain greedy
    continuation with every third token wrong is verified instead (accepted runs of 0..2), while the MTP layer
    still drafts after each step: its bases then move by the accepted counts."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 128) for _ in range(n)] for n in (3, 9, 14)]
    options = dict(device="cpu", dtype="float32", page_size=4, enable_prefix_caching=False, chunked_prefill_size=5)
    plain = LLMEngine(EngineConfig(model=str(ling_dir), **options))
    ids = [f"p{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        plain.add_request(request_id, prompt, PARAMS)
    reference = {i: o.outputs[0].token_ids for i, o in finish_all(plain).items()}

    engine = LLMEngine(EngineConfig(model=str(ling_dir), speculative_config={"method": "mtp",
                                                                            "num_speculative_tokens": K}, **options))
    wrong = {i: [(t + 1) % 128 if j % 3 == 2 else t for j, t in enumerate(reference[i])] for i in ids}
    recording = _Recording(ModelDrafts() if source == "mtp" else ReplayDrafts(wrong))
    engine.set_draft_source(recording)
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, PARAMS)
    assert {i: o.outputs[0].token_ids for i, o in finish_all(engine).items()} == reference
    stats = engine.stats()
    if source == "replayed":
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]

    config, tensors = load_checkpoint(ling_dir)
    naive = NaiveLing(config, tensors)
    assert len(recording.records) >= 10
    with torch.no_grad():
        for tokens, drafts in recording.records:
            assert drafts == _naive_chain(naive, tokens, K), tokens
