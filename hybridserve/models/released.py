"""config.json of the released models at their real widths, with as many layers as asked: what a random stand-in
of ZAYA1-8B or Ling-2.6-flash loads (`load_format="dummy"` draws its weights on the device), so that full-size
models run without their checkpoints (benchmarks, memory plans). Also the quantization_config of the two FP8
checkpoint layouts the loader reads."""
from __future__ import annotations


def zaya1_8b_config(layers: int) -> dict:
    return {
        "model_type": "zaya", "architectures": ["ZayaForCausalLM"], "torch_dtype": "bfloat16", "vocab_size": 262272,
        "hidden_size": 2048, "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 128, "moe_intermediate_size": 2048, "num_experts": 16, "num_experts_per_tok": 1,
        "router_hidden_size": 256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "eos_token_id": 106, "pad_token_id": 0, "bos_token_id": 2,
    }


def ling_flash_config(layers: int, mtp: bool = False) -> dict:
    """Ling-2.6-flash: layer groups of 8 (7 lightning layers, then MLA: layers 7, 15, ...), layer 0's FFN dense,
    256 experts top-8 in groups 8/4 and one shared expert; its MTP layer only if `mtp` (the drafts of NEXTN)."""
    return {
        "model_type": "bailing_hybrid", "architectures": ["BailingMoeV2_5ForCausalLM"], "torch_dtype": "bfloat16",
        "vocab_size": 157184, "hidden_size": 4096, "intermediate_size": 9216, "num_hidden_layers": layers,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "layer_group_size": 8,
        "group_norm_size": 4, "linear_silu": False, "partial_rotary_factor": 0.5, "rope_theta": 6e6,
        "rope_scaling": None, "max_position_embeddings": 131072, "use_qk_norm": True, "use_qkv_bias": False,
        "use_bias": False, "rms_norm_eps": 1e-6, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True, "num_experts": 256,
        "num_experts_per_tok": 8, "num_shared_experts": 1, "n_group": 8, "topk_group": 4,
        "moe_intermediate_size": 1024, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
        "score_function": "sigmoid", "topk_method": "noaux_tc", "moe_router_enable_expert_bias": True,
        "router_dtype": "fp32", "num_nextn_predict_layers": int(mtp), "tie_word_embeddings": False,
        "lightning_decay_variant": "training", "bos_token_id": 1, "eos_token_id": [156892, 156895],
        "pad_token_id": 156892,
    }


FP8_CHECKPOINTS = {  # layout name -> the quantization_config a checkpoint of that layout carries
    "channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "symmetric": True,
                                                       "dynamic": False, "strategy": "channel"},
                    "input_activations": {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": True,
                                          "strategy": "token"}}}},
    "block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}
