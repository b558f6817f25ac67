"""ZAYA1 vs HF transformers `ZayaForCausalLM` (the oracle), fp32 on CPU, tiny random configs."""
from __future__ import annotations

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.runtime.build_model import build_model
from tests.helpers import CacheHarness, add_tokenizer
from tests.models.zaya_fixtures import SHAPES, random_hf_zaya, save_hf, tiny_config

TOL = 2e-5
LENGTHS = [5, 11, 1, 8, 17, 3]  # six sequences of different lengths, packed into one prefill


def _prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["base", "gqa1", "gqa4"])
def zaya(request, tmp_path_factory):
    """(HF oracle model, checkpoint dir) for one tiny shape."""
    hf = random_hf_zaya(tiny_config(request.param), seed=sorted(SHAPES).index(request.param))
    directory = save_hf(hf, tmp_path_factory.mktemp(f"zaya-{request.param}"))
    return hf, directory


def _engine_model(directory, **overrides):
    model, _ = build_model(directory, torch.float32, torch.device("cpu"), {"mod_skip_mode": "zero", **overrides})
    return model


@torch.no_grad()
def test_packed_prefill_matches_hf_per_sequence(zaya):
    hf, directory = zaya
    harness = CacheHarness(_engine_model(directory))
    prompts = _prompts(LENGTHS)
    logits = harness.run([harness.chunk(slot + 1, p, 0) for slot, p in enumerate(prompts)])
    rows = logits.split(LENGTHS)
    for prompt, ours in zip(prompts, rows):
        ref = hf(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 7])
def test_prefill_resumed_in_chunks_equals_one_shot(zaya, chunk_size):
    _, directory = zaya
    harness = CacheHarness(_engine_model(directory))
    prompt = _prompts([23])[0]
    one_shot = harness.run([harness.chunk(1, prompt, 0)])
    pieces = [harness.run([harness.chunk(2, prompt[s:s + chunk_size], s)]) for s in range(0, 23, chunk_size)]
    assert (torch.cat(pieces) - one_shot).abs().max().item() <= TOL
    for name, buf in harness.state.buffers.items():
        assert (buf[:, 1] - buf[:, 2]).abs().max().item() <= TOL, f"state field {name} differs"


@torch.no_grad()
def test_states_after_prefill_equal_hf_cache(zaya):
    """(e): the conv window (raw q|k of the last 2 tokens) and the projected value lag equal HF's cache."""
    hf, directory = zaya
    harness = CacheHarness(_engine_model(directory))
    prompts = _prompts([9, 1, 4], seed=5)
    harness.run([harness.chunk(slot + 1, p, 0) for slot, p in enumerate(prompts)])
    for slot, prompt in enumerate(prompts, start=1):
        out = hf(torch.tensor([prompt]), use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values  # renamed in transformers 5.2x
        for layer in range(hf.config.num_hidden_layers):
            conv = harness.state.buffers["conv"][layer, slot]
            lag = harness.state.buffers["lag"][layer, slot]
            assert (conv - cache.get_conv_state(layer, state_idx=0)[0]).abs().max().item() <= TOL
            assert (lag - cache.get_recurrent_state(layer, state_idx=0)[0]).abs().max().item() <= TOL


@pytest.mark.parametrize("max_num_batched_tokens", [8192, 16])
def test_greedy_in_flight_matches_hf_generate(zaya, max_num_batched_tokens):
    """(c): 8 prompts decoded together (a tight token budget forces chunked, staggered admission and mixed
    prefill/decode steps) give HF `generate`'s greedy tokens, prompt by prompt."""
    hf, directory = zaya
    add_tokenizer(directory)
    prompts = _prompts([3, 12, 1, 7, 20, 5, 9, 2], seed=7)
    llm = LLM(str(directory), device="cpu", dtype="float32", hf_overrides={"mod_skip_mode": "zero"},
              max_num_batched_tokens=max_num_batched_tokens, page_size=4)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    hf.generation_config.eos_token_id = None
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        # An explicit mask: otherwise generate() treats token 0 (the pad id) as padding.
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)[0, len(prompt):]
        assert output.outputs[0].token_ids == ref.tolist()
        assert output.outputs[0].finish_reason == "length"


def _hf_scaled_identity_block(block, hidden_states, prev_router_hidden_states=None):
    """HF's MoE block with the scaled-identity MOD blend (Zyphra's reference and SGLang; HF outputs zero): skip
    tokens output p_skip * h2."""
    gate = block.gate
    z = gate.down_proj(hidden_states)
    if gate.use_eda and prev_router_hidden_states is not None:
        z = z + prev_router_hidden_states * gate.router_states_scale
    probs = torch.softmax(gate.router_mlp(z).float(), dim=-1)
    choice = (probs + gate.balancing_biases).argmax(-1)
    weight = probs.gather(-1, choice[..., None])
    skip = choice == block.experts.num_experts
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    routed = block.experts(flat, choice.masked_fill(skip, 0).reshape(-1, 1),
                           weight.masked_fill(skip[..., None], 0).reshape(-1, 1)).view_as(hidden_states)
    return routed + torch.where(skip[..., None], weight * hidden_states, 0.0), z


@torch.no_grad()
def test_mod_skip_modes(tmp_path, monkeypatch):
    """(d): with the skip class forced often, "zero" matches HF and "scaled_identity" `_hf_scaled_identity_block`."""
    hf = random_hf_zaya(tiny_config("base"), seed=3, skip_bias=0.0)
    directory = save_hf(hf, tmp_path)
    prompt = _prompts([24], seed=9)[0]
    ids = torch.tensor([prompt])
    choices = []
    for layer in hf.model.layers:
        gate = layer.mlp.gate
        gate.router_mlp.register_forward_hook(
            lambda mod, args, logits, gate=gate: choices.append((logits.float().softmax(-1) + gate.balancing_biases)
                                                                .argmax(-1)))
    hf(ids)
    skipped = (torch.cat(choices) == hf.config.num_experts).float().mean().item()
    assert 0.05 < skipped < 0.95, f"skip class chosen for {skipped:.0%} of tokens; the test needs a mix"
    results = {}
    for mode in ("zero", "scaled_identity"):
        harness = CacheHarness(_engine_model(directory, mod_skip_mode=mode))
        results[mode] = harness.run([harness.chunk(1, prompt, 0)])
    assert (results["zero"] - hf(ids).logits[0]).abs().max().item() <= TOL
    block_class = type(hf.model.layers[0].mlp)
    monkeypatch.setattr(block_class, "forward", _hf_scaled_identity_block)
    assert (results["scaled_identity"] - hf(ids).logits[0]).abs().max().item() <= TOL
    assert (results["scaled_identity"] - results["zero"]).abs().max().item() > 1e-2  # the modes really differ
