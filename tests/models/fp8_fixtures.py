"""FP8 checkpoints written from a 16-bit one, in the layouts the real ones use, with the real tensor names.

`quantize_checkpoint` turns every tensor the predicate selects into e4m3 values plus scales, named as the format
names them (compressed-tensors: `<w>_scale` = `x.weight_scale`, static `x.input_scale`; block FP8:
`x.weight_scale_inv`), writes config.json's quantization_config, and writes beside it the oracle: the same model
with every quantized tensor replaced by its dequantized fp32 values (so the two differ only in how the engine
quantizes activations)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hybridserve.core.quant import Fp8Scheme, QuantConfig, dequantize
from hybridserve.ops.reference.fp8 import quantize_weight

# What the two models quantize: projections and experts; not embeddings, LM head, norms, routers or convs.
ZAYA_QUANTIZED = re.compile(r".*\.(self_attn\.(qkv_proj\.(q_proj|k_proj|v_proj_current|v_proj_delayed)|o_proj)"
                            r"\.weight|mlp\.experts\.(gate_up_proj|down_proj))")
LING_QUANTIZED = re.compile(r".*\.(attention\.(query_key_value|g_proj|dense|q_a_proj|kv_a_proj_with_mqa|q_b_proj|"
                            r"kv_b_proj|q_proj)|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj|eh_proj)"
                            r"\.weight")

LAYOUTS = {  # layout -> (scheme, quantization_config)
    "channel": Fp8Scheme("channel", "token"),
    "tensor": Fp8Scheme("tensor", "token"),
    "static": Fp8Scheme("channel", "static"),
    "block": Fp8Scheme("block", "group", (128, 128)),
}


def quantization_config(layout: str, ignore: list[str]) -> dict:
    """config.json's quantization_config for a layout, as llm-compressor (compressed-tensors) or the block-FP8
    checkpoints (DeepSeek-V3, Qwen3-FP8) write it."""
    if layout == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": ignore}
    static = layout == "static"
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ignore, "kv_cache_scheme": None, "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": None,
                "weights": {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False,
                            "strategy": "tensor" if layout == "tensor" else "channel", "group_size": None},
                "input_activations": {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": not static,
                                      "strategy": "tensor" if static else "token", "group_size": None}}}}


def _quantize(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, the scale tensor as the checkpoint stores it, the dequantized fp32 weight)."""
    scheme = LAYOUTS[layout]
    if layout == "tensor":  # one scale for the whole tensor (each expert of a stack its own)
        amax = weight.float().abs().amax((-2, -1), keepdim=True)
        scale = (amax / 448.0).clamp_min(1e-12)
        values = (weight.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        stored = scale.reshape(-1) if weight.dim() == 3 else scale.reshape(1)
        return values, stored, values.float() * scale
    pieces = [quantize_weight(w, scheme) for w in (weight if weight.dim() == 3 else [weight])]
    values, scale = (torch.stack(t) for t in zip(*pieces)) if weight.dim() == 3 else pieces[0]
    stored = scale if layout == "block" else scale[..., None]  # compressed-tensors keeps [N, 1]
    return values, stored, dequantize(values, scale, scheme)


def quantize_checkpoint(source: Path, target: Path, oracle: Path, layout: str, quantized: re.Pattern,
                        ignore: tuple[str, ...] = (), seed: int = 0) -> list[str]:
    """Write the FP8 checkpoint of `source` to `target` and its dequantized oracle to `oracle` (both with
    source's other files). Tensors named in `ignore` (exact module names) stay as they are. -> the quantized
    tensor names."""
    tensors = load_file(str(source / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out, dequantized, names = {}, {}, []
    suffix = "_scale_inv" if layout == "block" else "_scale"
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not quantized.fullmatch(name) or module in ignore:
            out[name] = dequantized[name] = tensor
            continue
        values, scale, exact = _quantize(tensor, layout)
        out[name], out[name + suffix], dequantized[name] = values, scale, exact
        if layout == "static":  # around amax / 448 of unit-scale activations, different for every tensor
            out[QuantConfig.input_scale_name(name)] = (torch.rand((), generator=gen) * 0.004 + 0.008).reshape(1)
        names.append(name)
    config = json.loads((source / "config.json").read_text())
    for directory, weights, quant in ((target, out, quantization_config(layout, list(ignore))),
                                      (oracle, dequantized, None)):
        directory.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            if path.name not in ("model.safetensors", "config.json"):
                shutil.copy(path, directory / path.name)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(config | ({"quantization_config": quant} if quant else {})))
    return names
