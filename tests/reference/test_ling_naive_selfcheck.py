"""Self-checks of the naive Ling-2.6 reference against the implementation spec's worked numbers and against
independent formulations written here (chunked-parallel lightning attention, brute-force routing)."""

from __future__ import annotations

import json

import pytest
import torch

from .ling_naive import (
    NaiveLing,
    alibi_slopes,
    expected_tensor_shapes,
    layer_log_decay,
    lightning_recurrence,
    load_checkpoint,
    random_ling_checkpoint,
    rms_norm,
    rope_interleaved,
    rope_neox_partial,
    route_tokens,
    tiny_ling_config,
    write_checkpoint,
)

TOKENS = [5, 17, 3, 99, 42, 42, 7, 120, 64]


@pytest.fixture(scope="module")
def tiny() -> tuple[dict, dict[str, torch.Tensor], NaiveLing]:
    config = tiny_ling_config()
    tensors = random_ling_checkpoint(config, seed=0)
    return config, tensors, NaiveLing(config, tensors)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------------- slopes


def test_power_of_two_slopes_match_spec() -> None:
    slopes = alibi_slopes(32)
    assert slopes[0] == pytest.approx(2 ** -0.25, rel=1e-12)
    assert slopes[1] == pytest.approx(2 ** -0.5, rel=1e-12)
    assert slopes[31] == pytest.approx(2 ** -8, rel=1e-12)
    assert round(alibi_slopes(64)[0], 4) == 0.9170


def test_non_power_of_two_slopes() -> None:
    n4, n8 = alibi_slopes(4), alibi_slopes(8)
    assert alibi_slopes(6) == n4 + [n8[0], n8[2]]
    assert alibi_slopes(6) == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]
    assert alibi_slopes(12) == alibi_slopes(8) + alibi_slopes(16)[0::2][:4]


@pytest.mark.parametrize(
    ("variant", "layer", "decay"),
    [("training", 30, 0.9732), ("hf_remote_code", 30, 0.9472), ("training", 0, 0.4313), ("hf_remote_code", 0, 0.4198)],
)
def test_layer_decay_worked_numbers(variant: str, layer: int, decay: float) -> None:
    config = tiny_ling_config(num_attention_heads=32, num_hidden_layers=32, lightning_decay_variant=variant)
    log_decay = layer_log_decay(config, layer)
    assert log_decay.shape == (32,)
    assert bool((log_decay < 0).all())
    assert round(torch.exp(log_decay[0]).item(), 4) == decay


def test_hf_variant_is_training_variant_of_previous_layer() -> None:
    training = tiny_ling_config(num_attention_heads=32, num_hidden_layers=32)
    hf = dict(training, lightning_decay_variant="hf_remote_code")
    assert torch.allclose(layer_log_decay(hf, 8), layer_log_decay(training, 7))


# ----------------------------------------------------------------------------------- RoPE


def test_rope_variants_depend_only_on_relative_position() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))

    def score(rope, m: int, n: int) -> torch.Tensor:
        return (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum(-1)

    for rope in (lambda x, p: rope_interleaved(x, p, 100.0), lambda x, p: rope_neox_partial(x, p, 8, 100.0)):
        assert torch.allclose(score(rope, 7, 3), score(rope, 104, 100))
    # NeoX partial RoPE leaves the non-rotary tail untouched.
    assert torch.equal(rope_neox_partial(q, torch.tensor([5]), 8, 100.0)[..., 8:], q[..., 8:])


def test_interleaved_rope_equals_deinterleave_then_rotate_half() -> None:
    """MLA's RoPE: HF de-interleaves (even, odd) and applies rotate-half; GPT-J style gives the same scores."""
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(6, 3, 8, generator=gen), torch.randn(6, 3, 8, generator=gen)
    pos = torch.arange(6) * 11

    def deinterleave(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)

    ours = torch.einsum("thd,thd->th", rope_interleaved(q, pos, 50.0), rope_interleaved(k, pos + 3, 50.0))
    hf = torch.einsum(
        "thd,thd->th",
        rope_neox_partial(deinterleave(q), pos, 8, 50.0),
        rope_neox_partial(deinterleave(k), pos + 3, 8, 50.0),
    )
    assert _max_abs_diff(ours, hf) < 1e-5


# ----------------------------------------------------------------------------------- recurrence


def _chunked_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill from a zero or a carried state: intra-chunk decay-masked attention + inter-chunk term from
    the carried state."""
    length, _, dim = q.shape
    scale = dim ** -0.5
    outputs = []
    for start in range(0, length, chunk):
        qc, kc, vc = q[start : start + chunk], k[start : start + chunk], v[start : start + chunk]
        b = qc.shape[0]
        idx = torch.arange(b, dtype=q.dtype)
        diff = idx[:, None] - idx[None, :]
        mask = torch.where(diff >= 0, torch.exp(g[:, None, None] * diff.clamp(min=0)), torch.zeros(()))  # [H,b,b]
        intra = scale * torch.einsum("hij,jhv->ihv", torch.einsum("ihd,jhd->hij", qc, kc) * mask, vc)
        inter = scale * torch.exp(g[None, :] * (idx[:, None] + 1))[..., None] * torch.einsum("ihk,hkv->ihv", qc, state)
        outputs.append(intra + inter)
        k_weighted = kc * torch.exp(g[None, :] * (b - 1 - idx[:, None]))[..., None]
        state = torch.exp(g * b)[:, None, None] * state + torch.einsum("jhk,jhv->hkv", k_weighted, vc)
    return torch.cat(outputs), state


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref).norm() / ref.norm()).item()


def test_recurrence_matches_chunked_parallel_form() -> None:
    gen = torch.Generator().manual_seed(3)
    length, heads, dim = 23, 6, 16
    q, k, v = (torch.randn(length, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    state0 = torch.randn(heads, dim, dim, generator=gen, dtype=torch.float64)
    g = layer_log_decay(tiny_ling_config(num_attention_heads=heads), 0)
    o, state = lightning_recurrence(q.float(), k.float(), v.float(), g, state0.float())
    for chunk in (1, 4, 64):
        o_ref, state_ref = _chunked_parallel(q, k, v, g, state0, chunk)
        assert _rel_err(o, o_ref) < 1e-5
        assert _rel_err(state, state_ref) < 1e-5


def test_model_lightning_state_matches_closed_form(tiny) -> None:
    """State of lightning layer 0 after T tokens = sum_j a^(T-1-j) k_j^T v_j (zero initial state)."""
    config, tensors, model = tiny
    seq = model.new_sequence()
    model.step(seq, TOKENS)
    embedded = tensors["model.word_embeddings.weight"][TOKENS]
    x = rms_norm(embedded, tensors["model.layers.0.input_layernorm.weight"], config["rms_norm_eps"])
    _, k, v = (t.double() for t in model.lightning_qkv(0, x, torch.arange(len(TOKENS))))
    g = layer_log_decay(config, 0)
    ages = len(TOKENS) - 1 - torch.arange(len(TOKENS), dtype=torch.float64)
    closed = torch.einsum("jhk,jhv->hkv", k * torch.exp(g[None, :] * ages[:, None])[..., None], v)
    state = model.lightning_states(seq)[0]
    assert state.shape == (4, 16, 16) and state.dtype == torch.float32
    assert _rel_err(state, closed) < 1e-5


# ----------------------------------------------------------------------------------- model API


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_forward_equals_chunked_steps(q_lora_rank) -> None:
    config = tiny_ling_config(q_lora_rank=q_lora_rank)
    model = NaiveLing(config, random_ling_checkpoint(config, seed=4))
    full = model.forward(TOKENS)
    assert full.shape == (len(TOKENS), config["vocab_size"])
    seq = model.new_sequence()
    pieces = [model.step(seq, TOKENS[a:b]) for a, b in ((0, 3), (3, 4), (4, 9))]
    assert _max_abs_diff(torch.cat(pieces), full) < 1e-5
    assert seq.position == len(TOKENS)
    assert sorted(model.lightning_states(seq)) == [0, 2]
    assert all(h.shape == (len(TOKENS), config["kv_lora_rank"]) for h in seq.mla_latent.values())


def test_greedy_generate_matches_repeated_forward(tiny) -> None:
    _, _, model = tiny
    generated = model.greedy_generate(TOKENS[:4], 4)
    expected, ids = [], list(TOKENS[:4])
    for _ in range(4):
        expected.append(int(model.forward(ids)[-1].argmax()))
        ids.append(expected[-1])
    assert generated == expected


def test_mtp_tensors_kept(tiny) -> None:
    _, tensors, model = tiny
    assert "model.layers.4.eh_proj.weight" in model.mtp_tensors
    assert "model.layers.4.attention.kv_b_proj.weight" in model.mtp_tensors
    assert "model.layers.4.mlp.experts.7.down_proj.weight" in model.mtp_tensors
    assert all(name.startswith("model.layers.4.") for name in model.mtp_tensors)
    assert "model.layers.4.mlp.gate_proj.weight" not in tensors  # the MTP block is always MoE


def test_checkpoint_names_follow_hf_layout() -> None:
    names = set(expected_tensor_shapes(tiny_ling_config()))
    for name in [
        "model.word_embeddings.weight",
        "model.layers.0.attention.query_key_value.weight",
        "model.layers.0.attention.g_norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.attention.q_a_layernorm.weight",
        "model.layers.1.attention.kv_a_proj_with_mqa.weight",
        "model.layers.1.mlp.gate.expert_bias",
        "model.layers.2.mlp.shared_experts.up_proj.weight",
        "model.layers.3.attention.dense.weight",
        "model.layers.4.enorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]:
        assert name in names, name
    assert "model.layers.1.attention.query_key_value.weight" not in names
    assert "model.layers.2.attention.q_a_proj.weight" not in names
    plain_q = set(expected_tensor_shapes(tiny_ling_config(q_lora_rank=None)))
    assert "model.layers.1.attention.q_proj.weight" in plain_q
    assert "model.layers.1.attention.q_a_proj.weight" not in plain_q


def test_missing_or_unexpected_tensor_raises(tiny) -> None:
    config, tensors, _ = tiny
    incomplete = {n: t for n, t in tensors.items() if n != "model.layers.2.attention.g_norm.weight"}
    with pytest.raises(KeyError, match="missing"):
        NaiveLing(config, incomplete)
    with pytest.raises(KeyError, match="unexpected"):
        NaiveLing(config, dict(tensors, **{"model.layers.0.attention.mystery.weight": torch.zeros(2)}))
    misshaped = dict(tensors, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="shape"):
        NaiveLing(config, misshaped)
    # Recomputed buffers (rotary inv_freq, lightning slope) are tolerated.
    NaiveLing(config, dict(tensors, **{"model.layers.0.attention.slope": torch.zeros(4)}))


# ----------------------------------------------------------------------------------- checkpoint I/O


@pytest.mark.parametrize("shards", [1, 3])
def test_checkpoint_round_trip(tmp_path, tiny, shards: int) -> None:
    config, tensors, model = tiny
    write_checkpoint(tmp_path, config, tensors, shards=shards)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if shards == 1:
        assert files == ["model.safetensors"]
    else:
        assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(tensors)
        assert set(index["weight_map"].values()) == set(files)
        assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    loaded_config, loaded = load_checkpoint(tmp_path)
    assert loaded_config == config
    assert set(loaded) == set(tensors)
    assert all(torch.equal(loaded[n], tensors[n]) for n in tensors)
    # Bitwise equality is not guaranteed: BLAS may pick other kernels for differently aligned buffers.
    assert _max_abs_diff(NaiveLing(loaded_config, loaded).forward(TOKENS[:3]), model.forward(TOKENS[:3])) < 1e-6


# ----------------------------------------------------------------------------------- router


def _groups_of(indices: torch.Tensor, experts_per_group: int) -> list[set[int]]:
    return [set((row // experts_per_group).tolist()) for row in indices]


@pytest.mark.parametrize(("experts", "n_group", "topk_group", "top_k"), [(8, 2, 1, 2), (16, 4, 2, 4)])
def test_router_keeps_topk_groups(experts: int, n_group: int, topk_group: int, top_k: int) -> None:
    config = tiny_ling_config(num_experts=experts, n_group=n_group, topk_group=topk_group, num_experts_per_tok=top_k)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 64, generator=gen)
    gate = torch.randn(experts, 64, generator=gen) / 4
    bias = 0.1 * torch.randn(experts, generator=gen)
    indices, weights = route_tokens(x, gate, bias, config)
    assert indices.shape == weights.shape == (300, top_k)
    groups = _groups_of(indices, experts // n_group)
    assert all(len(g) <= topk_group for g in groups)
    assert len({frozenset(g) for g in groups}) > 1  # different tokens really do use different groups

    # Brute force, written independently: best topk_group groups by top-2 biased score, then top_k.
    scores = torch.sigmoid(x @ gate.T)
    biased = scores + bias
    per_group = experts // n_group
    for t in range(0, 300, 37):
        group_score = [sorted(biased[t, g * per_group : (g + 1) * per_group].tolist())[-2:] for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group]
        candidates = [e for e in range(experts) if e // per_group in kept]
        best = sorted(candidates, key=lambda e: -biased[t, e].item())[:top_k]
        assert set(indices[t].tolist()) == set(best)
        expected_w = scores[t, best] / scores[t, best].sum() * 2.5
        got = dict(zip(indices[t].tolist(), weights[t].tolist()))
        assert [got[e] for e in best] == pytest.approx(expected_w.tolist(), rel=1e-6)


def test_expert_bias_selects_but_does_not_weight() -> None:
    config = tiny_ling_config()
    gen = torch.Generator().manual_seed(6)
    x, gate = torch.randn(50, 64, generator=gen), torch.randn(8, 64, generator=gen) / 4
    bias = torch.zeros(8)
    bias[5] = 10.0
    indices, weights = route_tokens(x, gate, bias, config)
    assert bool((indices == 5).any(dim=-1).all())
    assert torch.allclose(weights.sum(-1), torch.full((50,), 2.5))
    scores = torch.sigmoid(x @ gate.T)
    assert torch.allclose(weights, scores.gather(1, indices) / scores.gather(1, indices).sum(-1, keepdim=True) * 2.5)
