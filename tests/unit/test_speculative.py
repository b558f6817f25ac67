"""Speculative decoding pieces: n-gram proposals, the acceptance rule (the standard speculative-sampling rule for
one-hot drafts, measured), the device-side state commit, and the configuration's checks."""
from __future__ import annotations

import re

import pytest
import torch

from hybridserve.cache.state_pool import StateField, StatePool, StateSpec
from hybridserve.cli import _engine_kwargs, build_parser
from hybridserve.config import EngineConfig, SpeculativeConfig
from hybridserve.core.chunk import ScheduledChunk
from hybridserve.core.step import SamplingRow
from hybridserve.layers.sampler import Sampler
from hybridserve.models.registry import check_speculative
from hybridserve.sampling import SamplingParams
from hybridserve.spec.ngram import propose_ngram
from hybridserve.spec.verify import IntermediateSlots, accepted_length, commit_states


@pytest.mark.parametrize("tokens, k, n_min, n_max, want", [
    ([1, 2, 3, 4, 1, 2, 3], 3, 1, 3, [4, 1, 2]),  # longest suffix (1 2 3) first
    ([1, 2, 9, 5, 2, 8, 1, 2], 2, 1, 3, [9, 5]),  # (8 1 2) never occurred; (1 2) did
    ([7, 1, 7, 2, 7], 2, 1, 1, [2, 7]),  # the latest occurrence of (7) wins
    ([5, 5, 5, 5], 3, 1, 2, [5]),  # only one token follows the latest match
    ([1, 2, 3], 2, 2, 2, []),  # no recurrence
    ([4, 4], 2, 2, 3, []),  # too short for an n_min-gram plus what follows it
    ([3, 1, 3], 0, 1, 1, []),  # k = 0
])
def test_ngram_proposals(tokens, k, n_min, n_max, want):
    assert propose_ngram(tokens, k, n_min, n_max) == want


def test_accepted_length_counts_the_leading_matches():
    assert accepted_length([5, 6, 7, 8], [5, 6, 7]) == 3
    assert accepted_length([5, 9, 7, 1], [5, 6, 7]) == 1
    assert accepted_length([4, 6], [5]) == 0
    assert accepted_length([4], []) == 0


def test_verify_draws_follow_the_speculative_sampling_rule():
    """At a verify position the sampler draws the plain token; accepting draft d iff the draw equals it must accept
    with probability p(d) (= min(1, p/q) for a one-hot q) and, when it rejects, follow max(p - q, 0) renormalised.
    Measured over 6000 seeds, 4 sigma, for greedy-unlike draft choices (the likeliest and a middling token)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    probs = torch.softmax(logits[0], -1)
    count = 6000
    rows = [SamplingRow(SamplingParams(temperature=1.0), seed, [9, 9], [3], [], token_index=2 + 1,
                        draft_prefix=[4]) for seed in range(count)]
    drawn = torch.tensor([t.token_id for t in Sampler()(logits.expand(count, -1).clone(), rows)])
    for draft in (0, 2):
        accepted = (drawn == draft).float().mean()
        sigma = (probs[draft] * (1 - probs[draft]) / count).sqrt()
        assert abs(accepted - probs[draft]) <= 4 * sigma
        rejected = drawn[drawn != draft]
        residual = probs.clone()
        residual[draft] = 0
        residual /= residual.sum()
        freq = torch.bincount(rejected, minlength=6).float() / len(rejected)
        assert ((freq - residual).abs() <= 4 * (residual * (1 - residual) / len(rejected)).sqrt() + 1e-9).all()


def test_verify_positions_count_the_drafts_before_them_for_penalties():
    """The draw at a verify position sees the drafts before it as output: a row with draft_prefix equals a plain row
    whose output already holds those tokens."""
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.9, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3)
    verify = SamplingRow(params, 11, [3, 4], [1, 2], [], draft_prefix=[5, 5])
    plain = SamplingRow(params, 11, [3, 4, 5, 5], [1, 2], [])
    sampler = Sampler()
    assert torch.equal(sampler._apply_penalties(logits[:1], [verify])[0],
                       sampler._apply_penalties(logits[:1], [plain])[0])
    assert verify.index == plain.index == 4


def test_commit_copies_the_state_after_the_last_accepted_draft():
    spec = StateSpec(num_layers=2, fields={"s": StateField((3,), torch.float32)})
    pool = StatePool(spec, 12, torch.device("cpu"))
    pool.buffers["s"].copy_(torch.arange(13.0)[None, :, None].expand(2, 13, 3))
    slots = IntermediateSlots(first=7, per_row=3)
    assert slots.of(1, 2) == [10, 11]
    with pytest.raises(ValueError, match="exceed"):
        slots.of(0, 4)
    rows = [ScheduledChunk([0, 21, 22, 23], 5, [], 2, True, draft_slots=slots.of(0, 3)),  # accepts 2
            ScheduledChunk([0, 31], 5, [], 3, True, draft_slots=slots.of(1, 1)),  # accepts 1 (all)
            ScheduledChunk([0, 41, 42], 5, [], 4, True, draft_slots=slots.of(0, 2))]  # accepts 0
    drawn = torch.tensor([21, 22, 50, 99, 31, 77, 40, 41, 42])  # position i draws what d_{i+1} must equal
    accepted = commit_states(pool, drawn, [(rows[0], 0), (rows[1], 4), (rows[2], 6)])
    assert accepted.tolist() == [2, 1, 0]
    values = pool.buffers["s"][:, :, 0]
    assert values[:, 2].tolist() == [8.0, 8.0] and values[:, 3].tolist() == [10.0, 10.0]
    assert values[:, 4].tolist() == [4.0, 4.0]  # nothing accepted: the working slot already holds the state


def test_speculative_config_checks():
    assert SpeculativeConfig("ngram", 3).prompt_lookup_min == 2
    assert EngineConfig(model="m", speculative_config={"method": "mtp", "num_speculative_tokens": 2}) \
        .num_speculative_tokens == 2
    assert EngineConfig(model="m").num_speculative_tokens == 0
    for bad, match in [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
                       ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
                       ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "ngram' only"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 3}, "prompt_lookup_max"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "window": 3}, "unknown keys")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model="m", speculative_config=bad)


@pytest.mark.parametrize("key, value", [
    ("method", 3), ("method", ["ngram"]), ("method", "NGRAM"),
    ("num_speculative_tokens", "2"), ("num_speculative_tokens", True), ("num_speculative_tokens", 2.0),
    ("prompt_lookup_min", "2"), ("prompt_lookup_min", True), ("prompt_lookup_min", 1.5), ("prompt_lookup_min", 0),
    ("prompt_lookup_max", "4"), ("prompt_lookup_max", False), ("prompt_lookup_max", [4]),
])
def test_speculative_config_values_of_the_wrong_type_are_a_value_error_naming_the_key(key, value):
    """A string, bool or float where an int belongs (or a non-string method) is a ValueError that names the key and
    shows the value, not a TypeError from comparing it."""
    config = {"method": "ngram", "num_speculative_tokens": 2, key: value}
    with pytest.raises(ValueError, match=rf"^invalid speculative_config {key}={re.escape(repr(value))}: "):
        EngineConfig(model="m", speculative_config=config)
    with pytest.raises(ValueError, match=rf"^invalid speculative_config {key}="):
        SpeculativeConfig(**config)


def test_speculative_config_fills_the_ngram_window():
    assert SpeculativeConfig("ngram", 2, prompt_lookup_min=6).prompt_lookup_max == 6  # max(4, min)
    assert SpeculativeConfig("ngram", 2, prompt_lookup_max=3).prompt_lookup_min == 2
    mtp = SpeculativeConfig("mtp", 2)
    assert (mtp.prompt_lookup_min, mtp.prompt_lookup_max) == (None, None)


def test_mtp_is_refused_for_models_without_an_mtp_layer():
    check_speculative({"model_type": "zaya"}, None)
    check_speculative({"model_type": "zaya"}, SpeculativeConfig("ngram", 2))
    with pytest.raises(ValueError, match="ZAYA1 has none"):
        check_speculative({"model_type": "zaya"}, SpeculativeConfig("mtp", 2))


def test_serve_flags_build_the_speculative_config():
    def kwargs(*flags):
        return _engine_kwargs(build_parser().parse_args(["serve", "/m", *flags]))["speculative_config"]

    assert kwargs() is None
    assert kwargs("--speculative-algorithm", "nextn", "--speculative-num-draft-tokens", "3") == \
        {"method": "mtp", "num_speculative_tokens": 3}
    assert kwargs("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "2",
                  "--speculative-ngram-max-match-window-size", "5") == \
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 5}
    for flags, match in [(("--speculative-num-draft-tokens", "2"), "need"),
                         (("--speculative-algorithm", "NGRAM"), "needs --speculative-num-draft-tokens"),
                         (("--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "2",
                           "--speculative-ngram-min-match-window-size", "1"), "NGRAM only")]:
        with pytest.raises(ValueError, match=match):
            kwargs(*flags)


@pytest.mark.parametrize("flags, match", [
    (("--speculative-num-draft-tokens", "0"), r"^invalid --speculative-num-draft-tokens=0: must be an integer in"),
    (("--speculative-num-draft-tokens", "17"), r"^invalid --speculative-num-draft-tokens=17: "),
    (("--speculative-num-draft-tokens", "2", "--speculative-ngram-min-match-window-size", "0"),
     r"^invalid --speculative-ngram-min-match-window-size=0: must be an integer >= 1"),
    (("--speculative-num-draft-tokens", "2", "--speculative-ngram-max-match-window-size", "-1"),
     r"^invalid --speculative-ngram-max-match-window-size=-1: "),
    (("--speculative-num-draft-tokens", "2", "--speculative-ngram-min-match-window-size", "5",
      "--speculative-ngram-max-match-window-size", "3"),
     r"^invalid --speculative-ngram-max-match-window-size=3: must be >= --speculative-ngram-min-match-window-size "
     r"\(5\)$"),
])
def test_bad_speculative_flag_values_are_reported_as_the_flag(flags, match):
    """Values from the command line are named by their flag, not by the speculative_config key they fill."""
    with pytest.raises(ValueError, match=match):
        _engine_kwargs(build_parser().parse_args(["serve", "/m", "--speculative-algorithm", "NGRAM", *flags]))


def test_a_non_integer_speculative_flag_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "/m", "--speculative-algorithm", "NGRAM",
                                   "--speculative-num-draft-tokens", "two"])
    assert "--speculative-num-draft-tokens" in capsys.readouterr().err


def test_metrics_report_acceptance():
    from hybridserve.server.metrics import ServerMetrics

    stats = {"running": 1, "spec_verify_rows": 10, "spec_draft_tokens": 30, "spec_accepted_tokens": 12}
    text = ServerMetrics(lambda: stats, "m").render().decode()
    values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("hybridserve:")}
    assert values["hybridserve:spec_decode_num_drafts_total"] == 10
    assert values["hybridserve:spec_decode_num_draft_tokens_total"] == 30
    assert values["hybridserve:spec_decode_num_accepted_tokens_total"] == 12
    assert values["hybridserve:spec_decode_acceptance_rate"] == pytest.approx(0.4)
    assert values["hybridserve:spec_decode_mean_accept_length"] == pytest.approx(2.2)
    plain = ServerMetrics(lambda: stats | {"spec_verify_rows": 0}, "m").render().decode()
    assert "acceptance_rate" not in plain and 'spec_decode_num_drafts_total{model_name="m"} 0.0' in plain
