"""The fused q | k | v_current | v_delayed projection under tensor parallelism (simulated ranks, no collectives):
each rank holds its q and k column shards and both value projections whole, filled from the four checkpoint
tensors through the model's checkpoint names (native and legacy)."""
from __future__ import annotations

import pytest
import torch

from hybridserve.core.parallel import set_tensor_parallel_group
from hybridserve.models.zaya import ZayaForCausalLM
from hybridserve.models.zaya_config import parse_zaya_config

CONFIG = {"model_type": "zaya", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 16,
          "num_experts": 2, "router_hidden_size": 8, "attention_bias": True}


@pytest.fixture
def tp2():
    yield
    set_tensor_parallel_group(0, 1, None)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("legacy", [False, True])
def test_fused_projection_shards(tp2, rank, legacy):
    set_tensor_parallel_group(rank, 2, None)
    config = parse_zaya_config(CONFIG)
    config.legacy_layout = legacy
    model = ZayaForCausalLM(config)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(0)
    full = {"q_proj": torch.randn(32, 32, generator=gen), "k_proj": torch.randn(16, 32, generator=gen),
            "v_proj_current": torch.randn(8, 32, generator=gen), "v_proj_delayed": torch.randn(8, 32, generator=gen)}
    legacy_names = {"q_proj": "linear_q", "k_proj": "linear_k", "v_proj_current": "val_proj1",
                    "v_proj_delayed": "val_proj2"}
    for which, tensor in full.items():
        for kind, value in (("weight", tensor), ("bias", tensor[:, 0].clone())):
            name = (f"model.layers.0.self_attn.qkv.{legacy_names[which]}.{kind}" if legacy
                    else f"model.layers.0.self_attn.qkv_proj.{which}.{kind}")
            target, shard = model.checkpoint_target(name)
            params[target].weight_loader(params[target], value, shard)
    fused = model.model.layers[0].self_attn.qkv_proj.qkvv_proj
    q, k = full["q_proj"].chunk(2)[rank], full["k_proj"].chunk(2)[rank]
    expected = torch.cat([q, k, full["v_proj_current"], full["v_proj_delayed"]])
    assert torch.equal(fused.weight, expected)
    assert torch.equal(fused.bias, expected[:, 0])
    assert params["model.layers.0.self_attn.qkv_proj.qkvv_proj.weight"].shard_ids == frozenset(range(4))
