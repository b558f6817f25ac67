"""FP8 checkpoints of both models (compressed-tensors per-channel, per-tensor and static-activation layouts, block
FP8 with weight_scale_inv; the real tensor names) against the same model dequantized to fp32, online FP8 against
the per-channel checkpoint, ignore rules, dummy FP8 weights, and the strict loader's errors.

The oracle: the FP8 checkpoint and its oracle hold the very same weight values (the oracle's are the dequantized
e4m3 values), so the one other rounding FP8 brings is that of the activations, to e4m3 before every projection
and expert projection (3 mantissa bits: up to 2^-4 relative per element, which moves these random models'
logits by 5% (ZAYA1) to 45% (Ling, whose routing flips)). The oracle run rounds its activations at the same
places the same way (`fake_quantize`, hooked onto the matching layers), so the two agree to fp32 summation order:
logits within 1e-4 relative. PROMPTS run as one step of 17 tokens, past the weight-only sizes (core/quant.py), so
every product there rounds x; a step of SHORT_PROMPT's 3 tokens (and 3 or 6 expert pairs) is decode-sized, where
the products take x as it is: there the FP8 model is the unrounded dequantized model, within the same 1e-4. A scale applied to the wrong rows or blocks, a piece's scale on another piece, or an
activation left unrounded moves them by whole percents. The online test needs no tolerance: quantizing at load is
bit for bit the per-channel checkpoint.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hybridserve.checkpoint import CheckpointError
from hybridserve.core.quant import FP8_DTYPE
from hybridserve.layers.moe import StackedExperts
from hybridserve.layers.weights import fp8_scales
from hybridserve.ops.reference import moe as moe_reference
from hybridserve.ops.reference.fp8 import fake_quantize
from hybridserve.runtime.build_model import build_model
from tests.helpers import CacheHarness
from tests.models.fp8_fixtures import LING_QUANTIZED, ZAYA_QUANTIZED, quantize_checkpoint
from tests.models.zaya_fixtures import random_hf_zaya, save_hf, tiny_config
from tests.reference.ling_naive import random_ling_checkpoint, tiny_ling_config, write_checkpoint

PROMPTS = [[5, 9, 1, 44, 3, 7, 100, 12, 60, 2, 33], [8, 2, 2, 61, 90, 17]]
SHORT_PROMPT = [8, 2, 61]
ORACLE_TOLERANCE = 1e-4  # relative L2 of the logits: fp32 summation order only


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """16-bit (fp32) tiny checkpoints whose fused pieces and tensor-parallel halves fall on 128-row block edges, as
    in the real models (block scales cannot be split elsewhere); MLA's kv_a (20 rows) ends on a partial block."""
    zaya = save_hf(random_hf_zaya(tiny_config("base", hidden_size=256, head_dim=128, moe_intermediate_size=256),
                                  seed=4), tmp_path_factory.mktemp("zaya16"))
    ling = tmp_path_factory.mktemp("ling16")
    config = tiny_ling_config(hidden_size=256, head_dim=32, q_lora_rank=128, intermediate_size=256,
                              moe_intermediate_size=128)
    write_checkpoint(ling, config, random_ling_checkpoint(config, seed=5))
    return {"zaya": zaya, "ling": ling}


def _run(model: torch.nn.Module, prompts: list[list[int]] = PROMPTS) -> torch.Tensor:
    harness = CacheHarness(model)
    return harness.run([harness.chunk(i + 1, p, 0) for i, p in enumerate(prompts)])


def _logits(directory: Path, **options) -> tuple[torch.Tensor, torch.nn.Module]:
    model, _ = build_model(directory, torch.float32, torch.device("cpu"), **options)
    return _run(model), model


@contextlib.contextmanager
def _rounding_activations_like(oracle: torch.nn.Module, fp8_model: torch.nn.Module):
    """Inside, `oracle` rounds the input of every layer that is FP8 in `fp8_model` as that layer's scheme does: the
    projections' inputs (a pre-hook), the experts' inputs and SwiGLU outputs (their torch path)."""
    modules = dict(fp8_model.named_modules())
    hooks, current = [], {}
    for name, module in oracle.named_modules():
        if isinstance(module, StackedExperts):  # every stack says whether its experts round (16-bit ones do not)
            gate_up, down = fp8_scales(modules[name].gate_up_proj), fp8_scales(modules[name].down_proj)
            for method in ("forward", "forward_residual_norm"):
                setattr(module, method, _with_experts_rounding(getattr(module, method), current, gate_up, down))
            continue
        weight = getattr(modules.get(name), "weight", None)
        scales = fp8_scales(weight) if weight is not None else None
        if scales is not None:
            hooks.append(module.register_forward_pre_hook(
                lambda _, args, s=scales: (_rounded(args[0], s.scheme, s.input_scale), *args[1:])))
    swiglu = moe_reference._swiglu

    def rounded_swiglu(x, w13, w2):
        gate_up, down = current["scales"]
        if gate_up is None:
            return swiglu(x, w13, w2)
        gate, up = F.linear(_rounded(x, gate_up.scheme, gate_up.input_scale), w13).chunk(2, dim=-1)
        return F.linear(_rounded(F.silu(gate) * up, down.scheme, down.input_scale), w2)

    moe_reference._swiglu = rounded_swiglu
    try:
        yield
    finally:
        moe_reference._swiglu = swiglu
        for hook in hooks:
            hook.remove()


def _rounded(x: torch.Tensor, scheme, input_scale) -> torch.Tensor:
    return fake_quantize(x.reshape(-1, x.shape[-1]), scheme, input_scale).view_as(x).to(x.dtype)


def _with_experts_rounding(method, current: dict, gate_up, down):
    def run(*args, **kwargs):
        current["scales"] = (gate_up, down)
        return method(*args, **kwargs)
    return run


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def _fp8_params(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.dtype == FP8_DTYPE}


def _quantized(model_name: str):
    return ZAYA_QUANTIZED if model_name == "zaya" else LING_QUANTIZED


def _check_against_oracle(fp8_dir: Path, oracle_dir: Path) -> tuple[torch.nn.Module, float]:
    """The FP8 model's logits against its dequantized oracle rounding activations alike, and on a decode-sized step
    against the oracle as it is -> (the FP8 model, the plain oracle's relative error on PROMPTS, for the record)."""
    got, model = _logits(fp8_dir)
    plain, oracle = _logits(oracle_dir)
    assert not _fp8_params(oracle)
    with _rounding_activations_like(oracle, model):
        want = _run(oracle)
    assert _relative_error(got, want) <= ORACLE_TOLERANCE
    assert _relative_error(_run(model, [SHORT_PROMPT]), _run(oracle, [SHORT_PROMPT])) <= ORACLE_TOLERANCE
    return model, _relative_error(got, plain)


@pytest.mark.parametrize("layout", ["channel", "tensor", "static", "block"])
@pytest.mark.parametrize("model_name", ["zaya", "ling"])
def test_fp8_checkpoint_matches_its_dequantized_model(sources, tmp_path, model_name, layout):
    names = quantize_checkpoint(sources[model_name], tmp_path / "fp8", tmp_path / "oracle", layout,
                                _quantized(model_name))
    model, plain_error = _check_against_oracle(tmp_path / "fp8", tmp_path / "oracle")
    print(f"{model_name} {layout}: logits relative error vs the unrounded dequantized model {plain_error:.3f}")
    # Every projection and expert stack is FP8 except MLA's kv_b_proj (dequantized at load: its weights fold into
    # the absorbed attention), with scales laid out as the scheme keeps them.
    fp8 = _fp8_params(model)
    assert fp8 and all(not name.endswith("kv_b_proj.weight") for name in fp8)
    assert any("kv_b_proj" in name for name in names) == (model_name == "ling")
    params = dict(model.named_parameters())
    for name in fp8:  # per-row scales drop the weight's last dim, block scales keep both
        scale = params[f"{name}_scale"]
        assert scale.dtype == torch.float32 and (scale.dim() == params[name].dim()) == (layout == "block")


def test_online_fp8_equals_the_per_channel_checkpoint(sources, tmp_path):
    kv_b = tuple(f"model.layers.{i}.attention.kv_b_proj" for i in range(5))  # online keeps it 16-bit outright
    for model_name in ("zaya", "ling"):
        quantize_checkpoint(sources[model_name], tmp_path / model_name / "fp8", tmp_path / model_name / "oracle",
                            "channel", _quantized(model_name), ignore=kv_b)
        online, model = _logits(sources[model_name], quantization="fp8")
        offline, checkpoint_model = _logits(tmp_path / model_name / "fp8")
        assert _fp8_params(model) == _fp8_params(checkpoint_model)
        assert torch.equal(online, offline)


def test_ignored_modules_stay_16_bit(sources, tmp_path):
    # ZAYA1: one projection; Ling: g_proj, one piece of the fused Q|K|V|G layer (the layer then runs 16-bit, its
    # FP8 pieces dequantized at load), and one layer's experts.
    ignore = {"zaya": ("model.layers.1.self_attn.o_proj",),
              "ling": ("model.layers.0.attention.g_proj", *(f"model.layers.1.mlp.experts.{e}.{p}_proj"
                                                           for e in range(8) for p in ("gate", "up", "down")))}
    for model_name, ignored in ignore.items():
        quantize_checkpoint(sources[model_name], tmp_path / model_name, tmp_path / f"{model_name}-oracle", "channel",
                            _quantized(model_name), ignore=ignored)
        model, _ = _check_against_oracle(tmp_path / model_name, tmp_path / f"{model_name}-oracle")
        params = dict(model.named_parameters())
        if model_name == "zaya":
            assert params["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float32
            assert params["model.layers.0.self_attn.o_proj.weight"].dtype == FP8_DTYPE
        else:
            assert params["model.layers.0.attention.query_key_value.weight"].dtype == torch.float32
            assert params["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.float32
            assert params["model.layers.2.attention.query_key_value.weight"].dtype == FP8_DTYPE


def test_dummy_fp8_weights(sources, tmp_path):
    quantize_checkpoint(sources["ling"], tmp_path / "fp8", tmp_path / "oracle", "block", LING_QUANTIZED)
    (tmp_path / "fp8" / "model.safetensors").unlink()  # config.json alone
    first, model = _logits(tmp_path / "fp8", load_format="dummy", seed=3)
    second, _ = _logits(tmp_path / "fp8", load_format="dummy", seed=3)
    assert _fp8_params(model) and torch.isfinite(first).all() and torch.equal(first, second)
    scales = [p for n, p in model.named_parameters() if n.endswith("_scale")]
    assert scales and all(bool((s > 0).all()) for s in scales)  # filled with their weights, not left empty


def _edit(directory: Path, change) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def test_strict_loading_names_the_tensor(sources, tmp_path):
    quantize_checkpoint(sources["zaya"], tmp_path / "fp8", tmp_path / "oracle", "channel", ZAYA_QUANTIZED)
    name = "model.layers.0.self_attn.o_proj.weight"
    cases = {
        "no scales": (lambda t: t.pop(f"{name}_scale"), f"{name}_scale' is missing"),
        "scale shape": (lambda t: t.update({f"{name}_scale": torch.ones(3, 1)}), f"{name}_scale"),
        "orphan scale": (lambda t: t.update({"model.layers.0.mlp.gate.down_proj.weight_scale": torch.ones(1)}),
                         "model.layers.0.mlp.gate.down_proj.weight_scale"),
        "input scale unused": (lambda t: t.update({"model.layers.0.self_attn.o_proj.input_scale": torch.ones(1)}),
                               "model.layers.0.self_attn.o_proj.input_scale"),
        "16-bit where FP8": (lambda t: (t.update({name: t[name].float()}), t.pop(f"{name}_scale")), name),
    }
    for case, (change, message) in cases.items():
        broken = tmp_path / case.replace(" ", "-")
        broken.mkdir()
        for path in (tmp_path / "fp8").iterdir():
            (broken / path.name).write_bytes(path.read_bytes())
        _edit(broken, change)
        with pytest.raises(CheckpointError, match=message):
            build_model(broken, torch.float32, torch.device("cpu"))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="float8_e4m3fn, but config.json has no quantization_config"):
        build_model(tmp_path / "fp8", torch.float32, torch.device("cpu"))


def test_engine_serves_fp8_and_logs_the_weights(sources, tmp_path, caplog):
    """Through the engine (chunked prefill, prefix-cache hits): the FP8 checkpoint and online FP8 of the same
    weights draw the same tokens, and the start-up log counts FP8 values and scales apart."""
    from hybridserve import LLM, SamplingParams
    from tests.helpers import add_tokenizer

    quantize_checkpoint(sources["zaya"], tmp_path / "fp8", tmp_path / "oracle", "channel", ZAYA_QUANTIZED)
    add_tokenizer(tmp_path / "fp8")
    add_tokenizer(sources["zaya"])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [PROMPTS[0] + [4, 4, 4]]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", use_tqdm=False, max_num_batched_tokens=8)
    with caplog.at_level("INFO"):
        checkpoint = LLM(str(tmp_path / "fp8"), **options).generate(prompts, params)
    assert any("FP8 e4m3" in r.message and "per channel" in r.message for r in caplog.records)
    online = LLM(str(sources["zaya"]), quantization="fp8", **options).generate(prompts, params)
    assert [r.outputs[0].token_ids for r in checkpoint] == [r.outputs[0].token_ids for r in online]
