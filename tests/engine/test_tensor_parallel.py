"""Tensor parallelism on CPU (gloo, one process per rank): TP=2 (and TP=4 where the shapes allow) against TP=1 on
tiny ZAYA1 and Ling checkpoints with prefix caching and chunked prefill on — the same greedy tokens for 8 prompts
over 32 steps, logprobs within fp32 rounding; shapes that cannot be sharded are refused before any rank starts."""
from __future__ import annotations

import os

import pytest
import torch

from hybridserve import SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine.engine import LLMEngine
from hybridserve.runtime.tensor_parallel import free_local_port, set_nccl_defaults
from tests.helpers import add_tokenizer

pytestmark = pytest.mark.heavy  # scheduled first: tests/conftest.py

LOGPROB_TOL = 1e-5  # fp32: the shards' partial sums are added in another order than TP=1's full products


def _engine(directory, tp: int, speculative: dict | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", dtype="float32", page_size=4,
                                  tensor_parallel_size=tp, max_num_batched_tokens=20, state_checkpoint_interval=8,
                                  use_tqdm=False, speculative_config=speculative))


def _generate(directory, tp: int, speculative: dict | None = None) -> dict[str, object]:
    """8 prompts of mixed lengths (chunked at 20 tokens a step), then 4 that share their prefixes (cache hits)."""
    engine = _engine(directory, tp, speculative)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in (5, 17, 9, 30, 12, 3, 25, 8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    done = {}
    try:
        for wave, batch in enumerate((prompts, [p + [7, 8, 9] for p in prompts[1:8:2]])):
            for i, prompt in enumerate(batch):
                engine.add_request(f"w{wave}-{i}", prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
        assert engine.cache_manager.prefix_hit_tokens > 0
        assert speculative is None or engine.stats()["spec_draft_tokens"] > 0
    finally:
        engine.shutdown()
    return done


def _assert_same(want: dict, have: dict) -> None:
    assert want.keys() == have.keys()
    for request_id in want:
        a, b = want[request_id].outputs[0], have[request_id].outputs[0]
        assert a.token_ids == b.token_ids, request_id
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= LOGPROB_TOL for t in x), request_id


@pytest.fixture(scope="module")
def ling4_dir(tmp_path_factory):
    """A tiny Ling whose heads and group norm split 4 ways."""
    from tests.reference.ling_naive import random_ling_checkpoint, tiny_ling_config, write_checkpoint

    config = tiny_ling_config(group_norm_size=4)
    directory = tmp_path_factory.mktemp("ling-tp4")
    write_checkpoint(directory, config, random_ling_checkpoint(config, 3))
    add_tokenizer(directory)
    return directory


@pytest.mark.parametrize("kind", ["zaya", "ling"])
def test_tp2_equals_tp1(kind, zaya_dir, ling_dir):
    directory = zaya_dir if kind == "zaya" else ling_dir
    _assert_same(_generate(directory, 1), _generate(directory, 2))


@pytest.mark.parametrize("kind, method", [("zaya", "ngram"), ("ling", "mtp")])
def test_tp2_speculative_equals_tp1_plain(kind, method, zaya_dir, ling_dir):
    """Speculative decoding under TP=2: every rank verifies, commits and (MTP) drafts on its shard from the same
    draws; the tokens are the plain TP=1 run's."""
    directory = zaya_dir if kind == "zaya" else ling_dir
    spec = {"method": method, "num_speculative_tokens": 3} | ({"prompt_lookup_min": 1} if method == "ngram" else {})
    _assert_same(_generate(directory, 1), _generate(directory, 2, spec))


def test_tp4_equals_tp1(ling4_dir):
    _assert_same(_generate(ling4_dir, 1), _generate(ling4_dir, 4))


def test_unshardable_sizes_are_refused_before_any_rank_starts(zaya_dir):
    """The tiny ZAYA1 has 2 KV heads: TP=4 would need KV-head replication, which CCA does not support."""
    with pytest.raises(ValueError, match=r"num_key_value_heads = 2 is not divisible.*sizes that work: 1, 2"):
        _engine(zaya_dir, 4)


def test_two_nodes_tp2_equals_tp1(ling_dir):
    """TP=2 over two "nodes" on this host: node 1 is a separate `hybridserve serve --node-rank 1` process tree that
    only runs its rank; node 0 is this process's engine. The same tokens as TP=1."""
    import subprocess
    import sys

    address = f"127.0.0.1:{free_local_port()}"
    node1 = subprocess.Popen([sys.executable, "-m", "hybridserve.cli", "serve", str(ling_dir), "--device", "cpu",
                              "--dtype", "float32", "--page-size", "4", "--max-num-batched-tokens", "20",
                              "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", address],
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        engine = LLMEngine(EngineConfig(model=str(ling_dir), device="cpu", dtype="float32", page_size=4,
                                        tensor_parallel_size=2, nnodes=2, dist_init_addr=address,
                                        max_num_batched_tokens=20, use_tqdm=False))
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompts = [[3 + (5 * i + j) % 100 for j in range(7 + 6 * i)] for i in range(4)]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"n{i}", prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        engine.shutdown()
        assert node1.wait(timeout=60) == 0, node1.stderr.read()[-2000:]
    finally:
        if node1.poll() is None:
            node1.kill()
    single = _engine(ling_dir, 1)
    for i, prompt in enumerate(prompts):
        single.add_request(f"n{i}", prompt, params)
    want = {}
    while single.has_unfinished_requests():
        want.update((o.request_id, o.outputs[0].token_ids) for o in single.step() if o.finished)
    assert done == want


def test_nccl_multicast_is_off_unless_the_environment_turns_it_on(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    set_nccl_defaults()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    set_nccl_defaults()
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
