"""SamplingParams validation and the batched sampler's distributions."""
from __future__ import annotations

import math

import pytest
import torch

from hybridserve.core.step import SamplingRow
from hybridserve.layers import sampler as sampler_module
from hybridserve.layers.sampler import Sampler, uniform_for
from hybridserve.ops.reference import sampling as sampling_reference
from hybridserve.sampling import SamplingParamError, SamplingParams

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("name, value", [
    ("temperature", -0.1), ("temperature", 2.01), ("temperature", INF), ("temperature", NAN), ("top_p", 0.0),
    ("top_p", 1.5), ("top_p", NAN), ("top_k", -2), ("top_k", 2**63), ("min_p", 1.5), ("max_tokens", 0),
    ("max_tokens", -3), ("max_tokens", 2**63), ("n", 0), ("n", 2**63), ("n", True), ("logprobs", 2**63),
    ("logprobs", -1), ("presence_penalty", 3.0), ("frequency_penalty", -INF), ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e-200), ("repetition_penalty", 0.009), ("repetition_penalty", 10.5),
    ("min_tokens", -1), ("stop", [""]), ("stop", ["x"] * 33), ("stop", ["x" * 1025]), ("stop_token_ids", [-1]),
    ("stop_token_ids", [2**63]), ("stop_token_ids", list(range(1025))), ("seed", 1.5), ("seed", 2**70),
    ("seed", -(2**63) - 1), ("logit_bias", {-1: 1.0}), ("logit_bias", {1: 100.5}), ("logit_bias", {1: NAN}),
    ("logit_bias", {i: 1.0 for i in range(1025)}), ("prompt_logprobs_temperature", 0.0),
    ("prompt_logprobs_temperature", 100.5), ("prompt_logprobs_temperature", NAN), ("logprob_token_ids", [-1]),
    ("logprob_token_ids", list(range(129))), ("logprob_token_ids", [3]),  # the last: without logprobs
])
def test_invalid_parameters_name_themselves(name, value):
    with pytest.raises(SamplingParamError, match=rf"invalid sampling parameter {name}=") as caught:
        SamplingParams(**{name: value})
    assert caught.value.param == name and caught.value.why


def test_the_extremes_of_every_range_are_valid():
    SamplingParams(temperature=2.0, top_p=1e-9, top_k=2**63 - 1, min_p=1.0, seed=-(2**63), presence_penalty=-2.0,
                   frequency_penalty=2.0, repetition_penalty=0.01, stop=["x" * 1024] * 32,
                   stop_token_ids=list(range(1024)), logprobs=20, n=128, max_tokens=2**63 - 1)
    SamplingParams(repetition_penalty=10.0, seed=2**63 - 1, temperature=0.0, prompt_logprobs_temperature=1e-5)
    SamplingParams(prompt_logprobs_temperature=100.0)


def test_model_dependent_checks():
    eos = frozenset({7})
    SamplingParams(stop_token_ids=[0, 9]).check_vocabulary(10, eos)
    with pytest.raises(SamplingParamError,
                       match=r"stop_token_ids=.*Token id 10 is out of vocabulary: token ids must be in \[0, 10\)"):
        SamplingParams(stop_token_ids=[10]).check_vocabulary(10, eos)
    all_but_eos = [t for t in range(10) if t != 7]
    with pytest.raises(SamplingParamError, match="min_tokens.*whole vocabulary"):
        SamplingParams(min_tokens=1, stop_token_ids=all_but_eos).check_vocabulary(10, eos)
    SamplingParams(min_tokens=1, stop_token_ids=all_but_eos, ignore_eos=True).check_vocabulary(10, eos)
    with pytest.raises(SamplingParamError, match=r"logit_bias=.*Token id 12 is out of vocabulary"):
        SamplingParams(logit_bias={3: 1.0, 12: -5.0}).check_vocabulary(10, eos)
    with pytest.raises(SamplingParamError, match=r"logprob_token_ids=.*Token id 10 is out of vocabulary"):
        SamplingParams(logprobs=0, logprob_token_ids=[9, 10]).check_vocabulary(10, eos)


def test_logprobs_are_bounded_by_the_engines_max_logprobs():
    SamplingParams(logprobs=20, prompt_logprobs=20).check_logprobs(20)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(SamplingParamError, match=rf"{name}=21: must be at most 20") as caught:
            SamplingParams(**{name: 21}).check_logprobs(20)
        assert caught.value.param == name


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


@pytest.mark.parametrize("temperature", [0.0, 1e-50, 9.99e-6])
def test_temperatures_below_1e_minus_5_are_greedy(temperature):
    """1e-50 once became 0 in float32 and turned the logits into inf/nan (an index -1 crash)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3)) * 30
    rows = [_row(temperature=temperature, seed=i) for i in range(2)] + [_row(temperature=1.0, seed=9)]
    tokens = [t.token_id for t in Sampler()(logits, rows)]
    assert SamplingParams(temperature=temperature).greedy and tokens[:2] == logits[:2].argmax(-1).tolist()


def test_valid_extremes_sample_without_trouble():
    """The smallest sampled temperature, the largest top_k and the extreme penalties give proper tokens."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4)) * 40
    rows = [_row(temperature=1e-5, seed=1), _row(temperature=2.0, top_k=2**63 - 1, seed=2),
            _row(temperature=1.0, repetition_penalty=0.01, presence_penalty=-2, frequency_penalty=2, outputs=[3, 3],
                 seed=3),
            _row(temperature=0.5, repetition_penalty=10.0, outputs=[int(logits[3].argmax())], seed=4)]
    tokens = [t.token_id for t in Sampler()(logits, rows)]
    assert all(0 <= t < 50 for t in tokens)
    assert tokens[0] == logits[0].argmax().item()  # 1e-5 concentrates all mass on the argmax
    off = Sampler()(logits[1:2], [_row(temperature=2.0, top_k=-1, seed=2)])[0].token_id
    assert tokens[1] == off  # a top_k beyond the vocabulary is no top_k


def test_rows_are_sampled_in_bounded_groups(monkeypatch):
    """At most _MAX_ELEMENTS_PER_CALL logits go through one sampling pass; the draws stay the same."""
    logits = torch.randn(10, 40, generator=torch.Generator().manual_seed(5))
    rows = [_row(seed=20 + i, temperature=0.9, top_p=0.9, logprobs=2) for i in range(10)]
    whole = Sampler()(logits, rows)
    sizes = []
    draw_rows = Sampler._draw_rows
    monkeypatch.setattr(sampler_module, "_MAX_ELEMENTS_PER_CALL", 3 * 40)
    monkeypatch.setattr(Sampler, "_draw_rows", lambda self, lg, rs, mask: sizes.append(len(rs)) or
                        draw_rows(self, lg, rs, mask))
    grouped = Sampler()(logits, rows)
    assert sizes == [3, 3, 3, 1]
    assert [(t.token_id, t.top_logprobs) for t in grouped] == [(t.token_id, t.top_logprobs) for t in whole]


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


def test_mixed_batches_draw_each_row_as_alone():
    """Rows with top-k/top-p take the sorted path, the others invert the CDF in vocabulary order, greedy rows take
    the argmax: whichever path a row takes depends on its own parameters, never on its neighbours'."""
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(2))
    kinds = [dict(temperature=0.9, top_p=0.9), dict(temperature=0.7), dict(temperature=0), dict(top_k=5),
             dict(temperature=1.3, min_p=0.05), dict(temperature=0.9, top_p=0.9), dict(temperature=0.7),
             dict(temperature=0)]
    rows = [_row(seed=300 + i, **kind) for i, kind in enumerate(kinds)]
    together = [t.token_id for t in Sampler()(logits, rows)]
    alone = [Sampler()(logits[i:i + 1], [row])[0].token_id for i, row in enumerate(rows)]
    assert together == alone
    assert together[2] == logits[2].argmax().item() and together[7] == logits[7].argmax().item()


def test_a_draw_at_the_top_of_the_cdf_lands_on_the_last_kept_token():
    """A filtered tail and u * total at the CDF's end (where float rounding can put it): the search runs past every
    entry, and the draw must still be a kept token (in vocabulary order the kept ones are not a prefix)."""
    logits = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0, 0.0]]).log()
    params = torch.tensor([[1.0, 7, 1.0, 0.0, 1.0]], dtype=torch.float64)
    assert sampling_reference.draw_unsorted(logits, params).tolist() == [4]
    params[0, 4] = 0.0
    assert sampling_reference.draw_unsorted(logits, params).tolist() == [1]


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


def test_logprob_token_ids_are_scored_in_every_row_that_lists_them():
    """Each row gets the raw logprobs of its own listed ids (whatever their rank, and under allowed_token_ids),
    after its top-k; rows listing fewer or none in the same call are untouched by the padding."""
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(5))
    rows = [_row(temperature=0, logprobs=0, logprob_token_ids=[29, 3, 17], allowed_token_ids=[8]),
            _row(temperature=0.8, seed=2, logprobs=2, logprob_token_ids=[5]), _row(temperature=0, logprobs=1)]
    out = Sampler()(logits, rows)
    reference = torch.log_softmax(logits, -1)
    assert out[0].token_id == 8
    assert [t for t, _ in out[0].top_logprobs] == [29, 3, 17]
    assert [t for t, _ in out[1].top_logprobs] == reference[1].topk(2).indices.tolist() + [5]
    assert [t for t, _ in out[2].top_logprobs] == reference[2].topk(1).indices.tolist()
    for i, token in enumerate(out):
        for token_id, logprob in token.top_logprobs:
            assert math.isclose(logprob, reference[i, token_id].item(), rel_tol=1e-6)


def test_logit_bias_shifts_the_logits_before_sampling_and_penalties():
    """A bias moves greedy picks and sampled frequencies as if the logits were logits + bias (-100 bans a token
    in practice); logprobs stay the raw model's; rows without a bias in the same call are untouched."""
    greedy = Sampler()(LOGITS.expand(3, -1).clone(), [_row(temperature=0, logit_bias={3: 2.5}),
                                                     _row(temperature=0, logit_bias={0: -100.0}, logprobs=0),
                                                     _row(temperature=0)])
    assert [t.token_id for t in greedy] == [3, 1, 0]
    assert math.isclose(greedy[1].logprob, torch.log_softmax(LOGITS[0], -1)[1].item(), rel_tol=1e-6)
    bias = {1: 1.0, 4: 3.0, 0: -100.0}
    shifted = LOGITS[0].clone()
    for token, value in bias.items():
        shifted[token] += value
    _assert_close_to(_draws(LOGITS, 6000, temperature=1.0, logit_bias=bias), torch.softmax(shifted, -1), 6000)
    penalised = Sampler()(LOGITS.clone(), [_row(temperature=0, outputs=[0], repetition_penalty=10.0,
                                                logit_bias={0: 1.0})])
    assert penalised[0].token_id == 1  # the biased logit (3.0) is then penalised (3.0 / 10)


def test_allowed_token_ids_restrict_the_draws_of_their_rows_only():
    rows = [_row(temperature=0, allowed_token_ids=[2, 4]), _row(temperature=0)]
    assert [t.token_id for t in Sampler()(LOGITS.expand(2, -1).clone(), rows)] == [2, 0]
    freq = _draws(LOGITS, 3000, temperature=1.0, allowed_token_ids=[3, 4, 5])
    assert freq[:3].sum() == 0
    _assert_close_to(freq[3:], torch.softmax(LOGITS[0, 3:], -1), 3000)



def _penalised(key: int, outputs: list[int], prompt: list[int], keep: bool) -> SamplingRow:
    row = _row(temperature=0.9, seed=key, outputs=outputs, prompt=prompt, repetition_penalty=1.3,
               frequency_penalty=0.4, presence_penalty=-0.2)
    row.key = key if keep else None
    return row


def test_penalty_counts_kept_across_draws_equal_counts_from_the_lists(monkeypatch):
    """Sequences 1 and 2 draw from step 0 (2 skips steps 4-5, as if preempted), 3 joins at step 6, with room kept
    for two: kept counts (each drawn token counted on the device as it is drawn, the host lists read only for what
    was not counted) give exactly the penalised logits that counting the whole lists gives; a continuing sequence
    uploads no token at all; one that skipped a step gave its row back and is rebuilt from its lists; the one
    without room is computed from its lists."""
    gen = torch.Generator().manual_seed(5)
    vocab = 40
    prompts = {1: [3, 4, 4, 9], 2: [7], 3: [0, 1, 2, 39]}
    outputs = {1: [5, 5], 2: [], 3: [8]}
    kept, fresh = Sampler(max_running=1), Sampler()  # room for two sequences' counts
    uploads = []
    upload = sampler_module.upload
    monkeypatch.setattr(sampler_module, "upload", lambda values, *a: (uploads.append(values), upload(values, *a))[1])
    for step in range(10):
        keys = [k for k in outputs if not (k == 2 and step in (4, 5)) and not (k == 3 and step < 6)]
        logits = torch.randn(len(keys), vocab, generator=gen)
        uploads.clear()
        with_state, counted = kept._apply_penalties(logits, [_penalised(k, outputs[k], prompts[k], True)
                                                             for k in keys])
        token_uploads = sum(len(v[1]) for v in uploads if len(v) == 2 and isinstance(v[0], list))
        without, _ = fresh._apply_penalties(logits, [_penalised(k, outputs[k], prompts[k], False) for k in keys])
        assert torch.equal(with_state, without), step
        if step in (1, 2, 3, 7, 8, 9):  # sequences 1 and 2 continue in their rows: nothing to upload
            assert token_uploads == 0, step
        drawn = torch.randint(vocab, (len(keys),), generator=gen)
        kept.penalties.record(counted, drawn)
        kept.end_step()
        assert sorted(kept.penalties._rows) == ([1, 2] if step not in (4, 5) else [1])
        for k, token in zip(keys, drawn.tolist()):
            outputs[k].append(token)


def test_a_draw_that_fails_part_way_counts_no_penalty_tokens(monkeypatch):
    """One row per group; the second group fails: nothing drawn in that call reaches the penalty counts, and the
    retries row by row (what the runner does) count each drawn token exactly once."""
    vocab = 40
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(8))
    rows = [_penalised(k, [5, 6], [3, 4], True) for k in (1, 2)]
    sampler = Sampler(max_running=2)
    monkeypatch.setattr(sampler_module, "_MAX_ELEMENTS_PER_CALL", vocab)
    draw_rows, calls = Sampler._draw_rows, []

    def failing_once(self, lg, rs, mask):
        calls.append(rs[0].key)
        if calls == [1, 2]:
            raise RuntimeError("injected")
        return draw_rows(self, lg, rs, mask)

    monkeypatch.setattr(Sampler, "_draw_rows", failing_once)
    with pytest.raises(RuntimeError, match="injected"):
        sampler.draw(logits, rows)
    drawn = [sampler.draw(logits[i:i + 1], rows[i:i + 1])[0].tokens for i in range(2)]
    counts = sampler.penalties.counts
    for key, tokens in zip((1, 2), drawn):
        row, counted = sampler.penalties._rows[key]
        expected = torch.bincount(torch.tensor([5, 6, int(tokens[0])]), minlength=vocab).float()
        assert counted == 3 and torch.equal(counts[row], expected)
