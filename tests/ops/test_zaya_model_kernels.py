"""A tiny ZAYA1 model with its kernels (conv with the q/k norm + RoPE + KV write, norm, zaya_router, moe, the decode
GEMV linear; through the interpreter) equals the same model on its torch references over fresh, chunked, mixed and
decode steps: logits, state slots and page footers. Both are fp32; the kernels sum in other orders, hence 1e-4 on
logits of unit scale. The decode steps of more than 8 tokens run the router's decode form and the experts' grouped
form, the decode step (three tokens) the experts' GEMV form with the post-MoE residual norm in its down launch (and,
with the post-attention norm in the router's first launch, the class selection deferred to the experts' launches),
and the first layer's experts leave the second layer's input norm pending, finished in its q|k|v|v launch; MOD skips
included."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from hybridserve.cache.state_pool import StatePool
from hybridserve.demo import write_random_checkpoint
from hybridserve.ops import backends
from hybridserve.ops.norm import PendingNorm
from hybridserve.runtime.build_model import build_model
from tests.helpers import CacheHarness
from tests.ops.conftest import ON_GPU

ZAYA_KERNELS = ("conv", "norm", "zaya_router", "moe", "linear")
CONFIG = {"model_type": "zaya", "architectures": ["ZayaForCausalLM"], "vocab_size": 96, "hidden_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "moe_intermediate_size": 32, "num_experts": 3, "num_experts_per_tok": 1, "router_hidden_size": 16,
          "attention_bias": True, "layer_types": ["hybrid", "hybrid_sliding"], "sliding_window": 5,
          "eos_token_id": 1, "rope_parameters": {"hybrid": {"rope_type": "default", "rope_theta": 1e4,
                                                            "partial_rotary_factor": 0.5}}}


def _harness(directory, kernels: bool) -> tuple[CacheHarness, StatePool]:
    model, _ = build_model(directory, torch.float32, torch.device("cpu"), {"mod_skip_mode": "scaled_identity"})
    with _kernels(kernels):
        model.prepare_kernels()  # with the kernels: each router's fc1 folded into its first launch
        harness = CacheHarness(model, page_size=4)
    footers = StatePool(model.state_spec(torch.float32), 64, torch.device("cpu"))
    layers = range(len(model.model.layers))
    model.bind_caches([harness.kv.layer(i) for i in layers], [harness.state.layer(i) for i in layers],
                      [footers.layer(i) for i in layers])
    return harness, footers


def _kernels(on: bool):
    return mock.patch.object(backends, "use_triton", lambda op, device: on and op in ZAYA_KERNELS)


@pytest.mark.skipif(ON_GPU, reason="the interpreter runs CPU tensors; on a GPU tests/gpu covers the model")
@pytest.mark.parametrize("norm_in_router", [True, False])
def test_model_on_kernels_equals_model_on_references(tmp_path, monkeypatch, norm_in_router):
    """norm_in_router: the post-attention residual norm runs in the router's first launch (at these widths every
    step's tiles take it, as ZAYA1-8B's take it at 1 and 2 tokens), else after o_proj and the router reads its
    output (ZAYA1-8B's larger decode steps)."""
    def skip_often(weights):  # MOD's skip class chosen for some tokens, so its fused term is exercised
        for name in weights:
            if name.endswith("balancing_biases"):
                weights[name][-1] = 0.3

    write_random_checkpoint(tmp_path, CONFIG, seed=3, adjust=skip_often)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (9, 3, 6)]
    steps = [  # (slot, tokens, prefix) per row: 9, 10, then 3 tokens (the experts' grouped, then GEMV form)
        [(1, prompts[0][:6], 0), (2, prompts[1], 0)],
        [(1, prompts[0][6:], 6), (2, [7], 3), (3, prompts[2], 0)],
        [(1, [4], 9), (2, [8], 4), (3, [9], 6)],
    ]
    from hybridserve.ops.triton import conv, linear, moe, moe_gemv, norm, zaya_router
    # The conv's columns form and the router's decode form tiled for 16 programs, not an H200's 128: a sixth of the
    # interpreter's programs, the same forms and one-chunk loops, and the decode step still splits each conv head's
    # columns over two programs (the tiling changes no result beyond fp32 summation order).
    for module in (conv, zaya_router):
        monkeypatch.setattr(module, "PROGRAMS", 16)
    if not norm_in_router:
        monkeypatch.setattr(zaya_router, "takes_residual_norm", lambda tokens, hidden, width: False)
    router_entry = "normed_route" if norm_in_router else "eda_route"
    entries = [(conv, "cca_conv"), (norm, "residual_rms_norm"), (zaya_router, router_entry), (moe, "fused_experts"),
               (moe_gemv, "fused_experts"), (linear, "linear")]
    results = {}
    for kernels in (False, True):
        harness, footers = _harness(tmp_path, kernels)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_kernels(kernels))
            spies = [stack.enter_context(mock.patch.object(module, name, wraps=getattr(module, name)))
                     for module, name in entries]
            logits = [harness.run([harness.chunk(*row) for row in step]) for step in steps]
        assert [spy.called for spy in spies] == [kernels] * len(spies)
        assert not kernels or all(call.kwargs.get("to_cache") is not None for call in spies[0].call_args_list)
        experts_calls = spies[-2].call_args_list
        assert not kernels or all(call.kwargs.get("norm") is not None for call in experts_calls)
        # the routers' first launches compute fc1 too where they run the norm
        assert all(call.kwargs["folded"] is not None for call in spies[2].call_args_list if norm_in_router)
        # with the norm in the router, its decode step's selection is left to the GEMV experts' launches
        deferred = [call.kwargs.get("selection") is not None for call in experts_calls]
        assert deferred == [norm_in_router] * len(deferred)
        # the decode step's first layer leaves the second's input norm to its q|k|v|v launch (the last layer's
        # output, the final norm, is never pending)
        pending = [call.args[0] for call in spies[-1].call_args_list if isinstance(call.args[0], PendingNorm)]
        assert [p.shape[0] for p in pending] == ([3] if kernels else [])
        assert [call.kwargs["norm"].h_pending for call in experts_calls] == ([True, False] if kernels else [])
        results[kernels] = (torch.cat(logits), harness.state.buffers, footers.buffers)
    (want, want_state, want_footers), (got, got_state, got_footers) = results[False], results[True]
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    for name in want_state:
        assert torch.allclose(got_state[name], want_state[name], atol=1e-5), name
        assert torch.allclose(got_footers[name], want_footers[name], atol=1e-5), name
        assert want_footers[name].abs().sum() > 0
