"""SamplingParams validation and the batched sampler's distributions."""
from __future__ import annotations

import math

import pytest
import torch

from hybridserve.core.step import SamplingRow
from hybridserve.layers.sampler import Sampler, uniform_for
from hybridserve.sampling import SamplingParams


@pytest.mark.parametrize("name, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("max_tokens", 0),
    ("max_tokens", -3), ("n", 0), ("logprobs", 21), ("logprobs", -1), ("presence_penalty", 3.0),
    ("repetition_penalty", 0.0), ("min_tokens", -1), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", 1.5),
])
def test_invalid_parameters_name_themselves(name, value):
    with pytest.raises(ValueError, match=rf"invalid sampling parameter {name}="):
        SamplingParams(**{name: value})


def test_stop_string_becomes_a_list_and_min_tokens_checked_against_max():
    assert SamplingParams(stop="###").stop == ["###"]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def _row(seed: int = 0, outputs=None, banned=None, prompt=(3,), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, list(outputs or []), list(prompt), list(banned or []))


def _draws(logits: torch.Tensor, count: int, **params) -> torch.Tensor:
    rows = [_row(seed=s, **params) for s in range(count)]
    tokens = Sampler()(logits.expand(count, -1).clone(), rows)
    return torch.bincount(torch.tensor([t.token_id for t in tokens]), minlength=logits.shape[-1]).float() / count


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def _assert_close_to(freq: torch.Tensor, probs: torch.Tensor, count: int) -> None:
    sigma = (probs * (1 - probs) / count).sqrt()
    assert ((freq - probs).abs() <= 4 * sigma + 1e-9).all(), (freq, probs)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_frequencies_follow_the_softmax(temperature):
    freq = _draws(LOGITS, 6000, temperature=temperature)
    _assert_close_to(freq, torch.softmax(LOGITS[0] / temperature, -1), 6000)


def test_top_k_top_p_min_p_restrict_the_support_and_renormalise():
    probs = torch.softmax(LOGITS[0], -1)
    freq = _draws(LOGITS, 4000, top_k=2)
    _assert_close_to(freq, torch.cat([probs[:2] / probs[:2].sum(), torch.zeros(4)]), 4000)
    nucleus = _draws(LOGITS, 2000, top_p=0.7)  # the first two tokens hold 0.80 > 0.7 (0.59 alone is not enough)
    assert nucleus[2:].sum() == 0 and nucleus[:2].min() > 0
    freq = _draws(LOGITS, 2000, min_p=0.3)  # keeps tokens with p >= 0.3 * p_max
    assert freq[(probs < 0.3 * probs.max())].sum() == 0


def test_greedy_and_banned_tokens():
    sampler = Sampler()
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    tokens = sampler(logits, [_row(temperature=0) for _ in range(4)])
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()
    best = logits[0].argmax().item()
    banned = sampler(logits[:1], [_row(temperature=0, banned=[best])])[0].token_id
    assert banned == logits[0].topk(2).indices[1].item()


def test_seeded_draws_do_not_depend_on_the_batch():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    sampler = Sampler()
    together = sampler(logits, [_row(seed=100 + i, temperature=0.9, top_p=0.95) for i in range(6)])
    alone = [sampler(logits[i:i + 1], [_row(seed=100 + i, temperature=0.9, top_p=0.95)])[0] for i in range(6)]
    assert [t.token_id for t in together] == [t.token_id for t in alone]
    assert uniform_for(7, 3) == uniform_for(7, 3) and uniform_for(7, 3) != uniform_for(7, 4)


def test_penalties():
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    sampler = Sampler()
    # Token 0 was generated before: a repetition penalty of 2 halves its logit (3 -> 1.5 < 2.9).
    assert sampler(logits, [_row(temperature=0, outputs=[0], repetition_penalty=2.0)])[0].token_id == 1
    # Negative logits are multiplied instead (more negative); prompt tokens count as seen.
    negative = torch.tensor([[-1.0, -1.5, -5.0]])
    assert sampler(negative, [_row(temperature=0, prompt=[0], repetition_penalty=2.0)])[0].token_id == 1
    assert sampler(logits, [_row(temperature=0, outputs=[0, 0], frequency_penalty=0.1)])[0].token_id == 1
    assert sampler(logits, [_row(temperature=0, outputs=[0], presence_penalty=0.05)])[0].token_id == 0
    assert sampler(logits, [_row(temperature=0, outputs=[0], presence_penalty=0.2)])[0].token_id == 1


def test_logprobs_are_the_models_raw_distribution():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    out = Sampler()(logits, [_row(temperature=0, logprobs=3), _row(temperature=0.7, seed=4, logprobs=0)])
    reference = torch.log_softmax(logits, -1)
    for i, token in enumerate(out):
        assert math.isclose(token.logprob, reference[i, token.token_id].item(), rel_tol=1e-6)
    top = reference[0].topk(3)
    assert [t for t, _ in out[0].top_logprobs] == top.indices.tolist()
    assert out[1].top_logprobs == []
