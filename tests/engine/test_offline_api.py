"""The offline API as users meet it: the README example runs as written, generate() checks every prompt before it
queues any, an interrupted generate() leaves nothing behind, and tqdm progress can be silenced."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def llm(zaya_dir):
    return LLM(str(zaya_dir), use_tqdm=False, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)


def test_the_readme_example_runs_as_written(capsys):
    (example,) = re.findall(r"```python\n(from hybridserve import LLM.*?)```", README.read_text(), re.DOTALL)
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(("stop", "length"))


def test_generate_checks_every_prompt_before_queueing_any(llm):
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prompt 2: Token id 1000000 is out of vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}, {"prompt_token_ids": [1000000]}],
                     params)
    with pytest.raises(ValueError, match=r"prompt 1: invalid sampling parameter stop_token_ids"):
        llm.generate([{"prompt_token_ids": [1, 2]}] * 2, [params, SamplingParams(stop_token_ids=[10**6])])
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate([{"prompt_token_ids": [1, 2]}], params)
    assert len(out.outputs[0].token_ids) == 2


def test_an_interrupted_generate_aborts_what_it_queued(llm, monkeypatch):
    step, calls = llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 3, SamplingParams(max_tokens=20, ignore_eos=True))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.cache_manager.check()


def test_progress_bars_show_unless_silenced(llm, zaya_dir, capsys):
    llm.generate([{"prompt_token_ids": [4, 5]}] * 2, SamplingParams(max_tokens=2), use_tqdm=True)
    assert "generating: 100%" in capsys.readouterr().err
    llm.generate([{"prompt_token_ids": [4, 5]}] * 2, SamplingParams(max_tokens=2))  # LLM(use_tqdm=False)
    LLM(str(zaya_dir), use_tqdm=False, device="cpu", dtype="float32")
    silent = capsys.readouterr().err
    assert "generating" not in silent and "loading weights" not in silent
    LLM(str(zaya_dir), device="cpu", dtype="float32")
    assert "loading weights: 100%" in capsys.readouterr().err


def test_generate_without_params_takes_the_generation_configs_defaults(llm, zaya_dir, tmp_path):
    """vLLM's generation_config: LLM.generate() with no SamplingParams samples as the chosen generation config says
    (here a directory's: greedy, 3 tokens); a model without one gets SamplingParams' defaults."""
    assert llm.get_default_sampling_params() == SamplingParams()  # the tiny checkpoint has no generation config
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    configured = LLM(str(zaya_dir), use_tqdm=False, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20,
                     generation_config=str(tmp_path))
    assert configured.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
    prompt = {"prompt_token_ids": [1, 2, 3]}
    (defaulted,) = configured.generate(prompt)
    (greedy,) = configured.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3))
    assert defaulted.outputs[0].token_ids == greedy.outputs[0].token_ids and len(greedy.outputs[0].token_ids) <= 3
