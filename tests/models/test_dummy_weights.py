"""load_format="dummy": both models serve from a directory with only config.json and a tokenizer; seeded loads
are identical; activations keep their scale over many layers; the checkpoint formats fail clearly without weights."""
from __future__ import annotations

import json

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.demo import demo_ling_config, demo_zaya_config
from hybridserve.models.zaya import EDARouter
from hybridserve.ops.reference.zaya_router import Routing
from tests.helpers import add_tokenizer

LAYERS = 8
VOCAB, EOS = 151680, [151645]  # the bundled tokenizer's
CONFIGS = {
    "zaya": demo_zaya_config(VOCAB, EOS) | {"num_hidden_layers": LAYERS, "layer_types": ["hybrid"] * LAYERS,
                                            "hidden_size": 256},
    "ling": demo_ling_config(VOCAB, EOS) | {"num_hidden_layers": LAYERS, "hidden_size": 256},
}
PROMPT = {"prompt_token_ids": list(range(100, 140))}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def config_only_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"{request.param}-config-only")
    (directory / "config.json").write_text(json.dumps(CONFIGS[request.param]))
    add_tokenizer(directory)
    return directory


def _llm(directory, **options) -> LLM:
    return LLM(str(directory), use_tqdm=False, device="cpu", dtype="float32", load_format="dummy",
               kv_cache_memory_bytes=64 << 20, **options)


def _linear_output_rms(llm: LLM) -> dict[str, float]:
    """The RMS of every projection's output over one prompt (ZAYA1's router down-projection, which runs inside the
    router op, through the router's carry: down_proj(x) plus the previous router's carry times its scale; a
    projection handed its residual norm returns the norm's outputs, so its own output is recomputed)."""
    found = {}

    def record(name: str, module, args, out) -> None:
        out = out.carry if isinstance(out, Routing) else out
        out = torch.nn.functional.linear(args[0], module.weight, module.bias) if isinstance(out, tuple) else out
        found.setdefault(name, out.float().pow(2).mean().sqrt().item())

    for name, module in llm.engine.runner.model.named_modules():
        if type(module).__name__.endswith("Linear") or isinstance(module, EDARouter):
            module.register_forward_hook(lambda mod, args, out, name=name: record(name, mod, args, out))
    llm.generate(PROMPT, SamplingParams(max_tokens=1))
    return found


def test_config_only_directory_generates_and_seeded_loads_are_identical(config_only_dir):
    assert not list(config_only_dir.glob("*.safetensors"))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    first, again = (_llm(config_only_dir).generate(PROMPT, params)[0] for _ in range(2))
    assert len(first.outputs[0].token_ids) == 6
    assert first.outputs == again.outputs and first.prompt_logprobs == again.prompt_logprobs
    other = _llm(config_only_dir, seed=1)
    weights = dict(_llm(config_only_dir).engine.runner.model.named_parameters())
    differs = [name for name, param in other.engine.runner.model.named_parameters()
               if not torch.equal(param, weights[name])]
    assert differs and all(weights[name].dim() >= 2 for name in differs)  # the seed moves the matrices only


def test_activations_keep_their_scale_over_many_layers(config_only_dir):
    rms = _linear_output_rms(_llm(config_only_dir))
    assert len(rms) >= 3 * LAYERS
    bad = {name: value for name, value in rms.items() if not 0.1 < value < 10}
    assert not bad, bad


@pytest.mark.parametrize("load_format", ["auto", "safetensors"])
def test_checkpoint_formats_without_weights_fail_clearly(config_only_dir, load_format):
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files .*load_format='dummy'"):
        LLM(str(config_only_dir), use_tqdm=False, device="cpu", load_format=load_format)


def test_an_unknown_load_format_is_named():
    with pytest.raises(ValueError, match="load_format='pt'.*auto, safetensors, dummy"):
        EngineConfig(model="unused", load_format="pt")


def test_the_cli_passes_load_format_and_refuses_unknown_ones(capsys):
    from hybridserve.cli import _engine_kwargs, build_parser

    assert _engine_kwargs(build_parser().parse_args(["serve", "/m", "--load-format", "dummy"]))["load_format"] == \
        "dummy"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "/m", "--load-format", "pt"])
    assert "invalid choice: 'pt'" in capsys.readouterr().err
