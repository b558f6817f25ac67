"""Ling-2.6 (`bailing_hybrid`) against the independent naive reference (tests/reference/ling_naive.py), fp32 on CPU.

Models are built the way a user's would be: a random checkpoint written in HF layout, loaded through
`build_model` (with `hf_overrides` where a case needs one), caches from the model's own specs, batches from
`build_forward_batch` (tests.helpers.CacheHarness), and end to end through `LLM`.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hybridserve.layers.mla as mla_module
from hybridserve import LLM, SamplingParams
from hybridserve.checkpoint import CheckpointError
from hybridserve.demo import DEMO_VERSION, ensure_demo_checkpoint
from hybridserve.models.ling import alibi_slopes, lightning_log_decay
from hybridserve.models.ling_config import parse_ling_config
from hybridserve.runtime.build_model import build_model
from tests.helpers import CacheHarness, add_tokenizer
from tests.reference.ling_naive import (
    NaiveLing,
    random_ling_checkpoint,
    tiny_ling_config,
    write_checkpoint,
)

CPU = torch.device("cpu")
# Tiny configs: layer_group_size 2 and 3; 4 and 6 (not a power of two) heads; group_norm_size 2 and 3; 8 experts
# top-2 with n_group 2 / topk_group 1; one shared expert; first_k_dense_replace 1; q-LoRA and plain q_proj.
CASES = {
    "group2": {},
    "group3_6heads": {"layer_group_size": 3, "num_hidden_layers": 3, "num_attention_heads": 6, "group_norm_size": 3,
                      "q_lora_rank": None, "moe_shared_expert_intermediate_size": 24},
}


@dataclasses.dataclass
class Ling:
    directory: Path
    overrides: dict
    reference: NaiveLing  # configured like the engine (overrides applied)


@pytest.fixture(scope="module", params=[("group2", "training"), ("group2", "hf_remote_code"),
                                        ("group3_6heads", "training"), ("group3_6heads", "hf_remote_code")],
                ids=lambda p: "-".join(p))
def ling(request, tmp_path_factory) -> Ling:
    case, variant = request.param
    config = tiny_ling_config(**CASES[case])
    tensors = random_ling_checkpoint(config, seed=0)
    directory = tmp_path_factory.mktemp(f"ling-{case}")
    write_checkpoint(directory, config, tensors)
    add_tokenizer(directory)
    # The checkpoint says "training"; the other variant arrives as a per-run override, as a user would pass it.
    overrides = {} if variant == "training" else {"lightning_decay_variant": variant}
    return Ling(directory, overrides, NaiveLing(config | overrides, tensors))


def _harness(directory: Path, overrides: dict) -> CacheHarness:
    model, _ = build_model(directory, torch.float32, CPU, overrides)
    harness = CacheHarness(model)
    for buf in harness.state.buffers.values():
        buf.fill_(float("nan"))  # a fresh row must never read its slot
    return harness


def _states(harness: CacheHarness, slot: int) -> list[torch.Tensor]:
    return list(harness.state.buffers["lightning"][:, slot])


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _reference_states(ling: Ling, seq) -> list[torch.Tensor]:
    states = ling.reference.lightning_states(seq)
    return [states[i] for i in sorted(states)]


# ------------------------------------------------------------------------------------------- engine vs reference


def test_packed_prefill_matches_reference(ling: Ling) -> None:
    harness = _harness(ling.directory, ling.overrides)
    lengths = [1, 7, 70, 130]  # one batch; 130 crosses two 64-token chunk boundaries
    prompts = _prompts(lengths, seed=1)
    logits = harness.run([harness.chunk(slot, p, 0) for slot, p in enumerate(prompts, start=1)]).split(lengths)
    for slot, (prompt, got) in enumerate(zip(prompts, logits), start=1):
        seq = ling.reference.new_sequence()
        assert _max_abs(got, ling.reference.step(seq, prompt)) <= 2e-5
        for engine_state, ref_state in zip(_states(harness, slot), _reference_states(ling, seq), strict=True):
            assert _rel(engine_state, ref_state) <= 1e-5


def test_chunked_prefill_and_decode_resume_from_state(ling: Ling) -> None:
    """Two sequences share every step, chunked 1/3/17/70 and 70/17/3/1 (so steps mix one-token and long rows),
    then decode together; each step equals the one-shot prefill and the reference, logits and states."""
    prompt_a, prompt_b = _prompts([91, 91], seed=2)
    one_shot = _harness(ling.directory, ling.overrides)
    full_a, full_b = one_shot.run([one_shot.chunk(1, prompt_a, 0), one_shot.chunk(2, prompt_b, 0)]).split(91)
    chunked = _harness(ling.directory, ling.overrides)
    seq_a, seq_b = ling.reference.new_sequence(), ling.reference.new_sequence()
    start_a = start_b = 0
    for len_a, len_b in zip([1, 3, 17, 70], [70, 17, 3, 1]):
        piece_a, piece_b = prompt_a[start_a:start_a + len_a], prompt_b[start_b:start_b + len_b]
        got_a, got_b = chunked.run([chunked.chunk(1, piece_a, start_a),
                                    chunked.chunk(2, piece_b, start_b)]).split([len_a, len_b])
        assert _max_abs(got_a, full_a[start_a:start_a + len_a]) <= 2e-5
        assert _max_abs(got_b, full_b[start_b:start_b + len_b]) <= 2e-5
        ling.reference.step(seq_a, piece_a)
        ling.reference.step(seq_b, piece_b)
        for slot, seq in ((1, seq_a), (2, seq_b)):
            for engine_state, ref_state in zip(_states(chunked, slot), _reference_states(ling, seq), strict=True):
                assert _rel(engine_state, ref_state) <= 1e-5
        start_a, start_b = start_a + len_a, start_b + len_b
    for slot in (1, 2):
        for chunked_state, one_shot_state in zip(_states(chunked, slot), _states(one_shot, slot), strict=True):
            assert _rel(chunked_state, one_shot_state) <= 1e-5
    for step, (token_a, token_b) in enumerate([(5, 9), (17, 3), (100, 100)]):  # all-decode: recurrence + absorbed MLA
        batch = [chunked.chunk(1, [token_a], 91 + step), chunked.chunk(2, [token_b], 91 + step)]
        got_a, got_b = chunked.run(batch)
        assert _max_abs(got_a, ling.reference.step(seq_a, [token_a])[0]) <= 2e-5
        assert _max_abs(got_b, ling.reference.step(seq_b, [token_b])[0]) <= 2e-5


def test_generate_matches_reference_greedy(ling: Ling) -> None:
    """8 prompts in flight together through the offline API; a small token budget forces chunked prefill with
    decode rows of the earlier requests in the same steps. A second round extends earlier prompts, so it resumes
    from prefix-cache state checkpoints."""
    prompts = _prompts([1, 4, 9, 16, 23, 40, 65, 80], seed=3)
    llm = LLM(str(ling.directory), device="cpu", dtype="float32", hf_overrides=ling.overrides,
              max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == ling.reference.greedy_generate(prompt, 32)
    extended = [p + [3, 1, 4] for p in prompts[4:]]
    for prompt, output in zip(extended, llm.generate([{"prompt_token_ids": p} for p in extended], params)):
        assert output.outputs[0].token_ids == ling.reference.greedy_generate(prompt, 32)


# ------------------------------------------------------------------------------------------- decay slopes


@pytest.mark.parametrize(("variant", "layer", "decay"), [
    ("training", 30, 0.9732), ("hf_remote_code", 30, 0.9472), ("training", 0, 0.4313), ("hf_remote_code", 0, 0.4198),
])
def test_decay_reproduces_spec_worked_numbers(variant: str, layer: int, decay: float) -> None:
    """Flash (H=32, L=32): head 0's per-token decay at layers 30 and 0 under both variants, the values SGLang
    (training) and the HF remote code give."""
    config = parse_ling_config(tiny_ling_config(num_attention_heads=32, num_hidden_layers=32, layer_group_size=8,
                                                group_norm_size=4, lightning_decay_variant=variant))
    log_decay = lightning_log_decay(config, layer)
    assert log_decay.shape == (32,) and bool((log_decay < 0).all())
    assert round(math.exp(log_decay[0].item()), 4) == decay


def test_alibi_slopes_follow_spec_rule() -> None:
    flash = alibi_slopes(32)
    assert [round(flash[i], 4) for i in (0, 1, 31)] == [0.8409, 0.7071, 0.0039]
    assert round(alibi_slopes(64)[0], 4) == 0.9170
    # n = 6: the power-of-two list for 4, then the even-indexed entries 0 and 2 of the list for 8.
    assert alibi_slopes(6) == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]


# ------------------------------------------------------------------------------------------- MLA


def test_absorbed_and_unabsorbed_mla_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_ling_config()
    write_checkpoint(tmp_path, config, random_ling_checkpoint(config, seed=4))
    harness = _harness(tmp_path, {})
    prompts = _prompts([5, 16, 33], seed=5)
    harness.run([harness.chunk(slot, p, 0) for slot, p in enumerate(prompts, start=1)])
    decode = harness.batch([harness.chunk(slot, [7 + slot], len(p)) for slot, p in enumerate(prompts, start=1)])
    assert decode.is_decode
    attention = harness.model.model.layers[1].attention
    x = torch.randn(3, config["hidden_size"], generator=torch.Generator().manual_seed(6))
    calls = []
    paged_attention = mla_module.paged_attention
    monkeypatch.setattr(mla_module, "paged_attention", lambda *a, **k: calls.append(1) or paged_attention(*a, **k))
    with torch.inference_mode():
        absorbed = attention(x, decode)
        assert calls == [1]  # the absorbed form: MQA over the latent cache
        unabsorbed = attention(x, dataclasses.replace(decode, is_decode=False))
        assert calls == [1]
    assert _max_abs(absorbed, unabsorbed) <= 1e-5 * unabsorbed.abs().max().item()


# ------------------------------------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def tiny_checkpoint() -> tuple[dict, dict[str, torch.Tensor]]:
    config = tiny_ling_config()
    return config, random_ling_checkpoint(config, seed=7)


def _load(directory: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1):
    write_checkpoint(directory, config, tensors, shards=shards)
    return build_model(directory, torch.float32, CPU)[0]


@pytest.mark.parametrize(("change", "message"), [
    ("missing", "model.layers.1.attention.kv_b_proj.weight"),
    ("missing_expert_half", "model.layers.2.mlp.experts.gate_up_proj"),
    ("extra", "unexpected tensor 'model.layers.0.attention.extra.weight'"),
    ("extra_expert", "unexpected tensor 'model.layers.2.mlp.experts.8.up_proj.weight'"),
    ("wrong_shape", "tensor 'model.layers.0.attention.g_proj.weight' has shape (64, 32)"),
    ("wrong_expert_shape", "tensor 'model.layers.3.mlp.experts.1.down_proj.weight' has shape (64, 31)"),
])
def test_loader_is_strict(tmp_path: Path, tiny_checkpoint, change: str, message: str) -> None:
    config, tensors = tiny_checkpoint
    tensors = dict(tensors)
    if change == "missing":
        del tensors["model.layers.1.attention.kv_b_proj.weight"]
    elif change == "missing_expert_half":
        del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    elif change == "extra":
        tensors["model.layers.0.attention.extra.weight"] = torch.zeros(2, 2)
    elif change == "extra_expert":  # the tiny config has experts 0..7
        tensors["model.layers.2.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)
    elif change == "wrong_shape":
        tensors["model.layers.0.attention.g_proj.weight"] = torch.zeros(64, 32)
    else:
        tensors["model.layers.3.mlp.experts.1.down_proj.weight"] = torch.zeros(64, 31)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _load(tmp_path, config, tensors)


def test_loader_accepts_aliases_ignored_buffers_and_shards(tmp_path: Path, tiny_checkpoint) -> None:
    config, tensors = tiny_checkpoint
    renamed = {name.replace("mlp.gate.expert_bias", "mlp.gate.e_score_correction_bias"): t
               for name, t in tensors.items()}
    renamed["model.layers.0.attention.slope"] = torch.ones(4)
    renamed["model.layers.1.attention.rotary_emb.inv_freq"] = torch.ones(2)
    model = _load(tmp_path, config, renamed, shards=3)
    assert torch.equal(model.model.layers[2].mlp.gate.expert_bias, tensors["model.layers.2.mlp.gate.expert_bias"])


def test_mtp_layer_is_loaded(tmp_path: Path, tiny_checkpoint) -> None:
    config, tensors = tiny_checkpoint
    mtp = _load(tmp_path, config, tensors).model.mtp[0]
    width, q_lora = config["moe_intermediate_size"], config["q_lora_rank"]
    expected = [  # (engine parameter of the MTP block, checkpoint tensor of model.layers.4 = the MTP layer)
        (mtp.enorm.weight, "enorm.weight"),
        (mtp.hnorm.weight, "hnorm.weight"),
        (mtp.eh_proj.weight, "eh_proj.weight"),
        (mtp.final_layernorm.weight, "final_layernorm.weight"),
        (mtp.input_layernorm.weight, "input_layernorm.weight"),
        (mtp.post_attention_layernorm.weight, "post_attention_layernorm.weight"),
        (mtp.attention.fused_qkv_a_proj.weight[:q_lora], "attention.q_a_proj.weight"),
        (mtp.attention.q_b_proj.weight, "attention.q_b_proj.weight"),
        (mtp.attention.fused_qkv_a_proj.weight[q_lora:], "attention.kv_a_proj_with_mqa.weight"),
        (mtp.attention.kv_b_proj.weight, "attention.kv_b_proj.weight"),
        (mtp.attention.dense.weight, "attention.dense.weight"),
        (mtp.mlp.gate.weight, "mlp.gate.weight"),
        (mtp.mlp.gate.expert_bias, "mlp.gate.expert_bias"),
        (mtp.mlp.experts.gate_up_proj[3, :width], "mlp.experts.3.gate_proj.weight"),
        (mtp.mlp.experts.gate_up_proj[3, width:], "mlp.experts.3.up_proj.weight"),
        (mtp.mlp.experts.down_proj[6], "mlp.experts.6.down_proj.weight"),
        (mtp.mlp.shared_experts.gate_up_proj.weight[:width], "mlp.shared_experts.gate_proj.weight"),
        (mtp.mlp.shared_experts.down_proj.weight, "mlp.shared_experts.down_proj.weight"),
    ]
    for param, name in expected:
        assert torch.equal(param, tensors[f"model.layers.4.{name}"]), name


def test_cache_specs_cover_only_their_layers(tmp_path: Path, tiny_checkpoint) -> None:
    """4 layers, group 2: lightning 0 and 2 own fp32 states (whatever the model dtype), MLA 1 and 3 own KV."""
    config, tensors = tiny_checkpoint
    model = _load(tmp_path, config, tensors)
    state = model.state_spec(torch.bfloat16)
    assert state.num_layers == 2
    assert state.fields["lightning"].shape == (4, 16, 16) and state.fields["lightning"].dtype == torch.float32
    kv = model.kv_cache_spec(torch.bfloat16)
    assert kv.num_layers == 2 and kv.fields == {"latent": (1, 16 + 4)} and kv.dtype == torch.bfloat16


def test_demo_ling_checkpoint_uses_hf_names_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDSERVE_CACHE", str(tmp_path))
    directory = ensure_demo_checkpoint("bailing_hybrid")
    assert directory.name == f"demo-bailing_hybrid-v{DEMO_VERSION}"
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
            "model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.4.eh_proj.weight"} <= names
    harness = CacheHarness(build_model(directory, torch.float32, CPU)[0])
    assert bool(torch.isfinite(harness.run([harness.chunk(1, [1, 2, 3], 0)])).all())
