"""Ling kernels on CUDA at Ling-2.6-flash widths (32 lightning heads x 128, hidden 4096): the Triton lightning
kernels with bf16 q/k/v against the fp32 torch reference over a varlen prefill and 40 decode steps (errors printed
and bounded), the dot-precision choice measured, CUDA-graph replay of the decode kernel, and issue 8's symptom:
4 requests decoding together in a bf16 model, teacher-forced on the fp32 CPU model's tokens.

    pytest -s tests/gpu/test_ling_kernels_gpu.py      # -s shows the measured errors
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve.core.batch import ScheduledChunk, build_forward_batch
from hybridserve.models.ling import alibi_slopes, layer_decay_factor
from hybridserve.models.ling_config import parse_ling_config
from hybridserve.ops import backends
from hybridserve.ops.reference import lightning as reference
from hybridserve.runtime.model_loader import build_model
from tests.helpers import CacheHarness
from tests.reference.ling_naive import (
    random_ling_checkpoint,
    tiny_ling_config,
    write_checkpoint,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
HEADS, DIM, PAGE, NUM_SLOTS = 32, 128, 16, 16
BOUND = 2e-3  # relative, outputs and states, bf16 q/k/v vs the fp32 reference on the same bf16 values


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _log_decay(layer: int) -> torch.Tensor:
    """Ling-2.6-flash's decays at one layer (L = 32, the training law): per-token decay 0.43 .. 0.9966 at layer 0."""
    config = parse_ling_config(tiny_ling_config(num_attention_heads=HEADS, num_hidden_layers=32, layer_group_size=8,
                                                group_norm_size=4, head_dim=DIM, hidden_size=4096))
    return -torch.tensor(alibi_slopes(HEADS), device=CUDA) * layer_decay_factor(config, layer)


def _batch(lengths: list[int], prefixes: list[int], slots: list[int]):
    chunks = [ScheduledChunk([0] * n, p, list(range(1, 2 + (p + n) // PAGE)), s, p > 0)
              for n, p, s in zip(lengths, prefixes, slots)]
    return build_forward_batch(chunks, PAGE, CUDA)


def _qkv(tokens: int, gen: torch.Generator) -> list[torch.Tensor]:
    """bf16 q, k, v with unit-RMS heads (q and k come out of a per-head RMSNorm in the model)."""
    return [torch.randn(tokens, HEADS, DIM, device=CUDA, generator=gen).bfloat16() for _ in range(3)]


LENGTHS = [1, 63, 64, 65, 200, 1000]
SLOTS = [9, 3, 14, 1, 6, 11]
PREFIXES = [10, 0, 40, 0, 300, 0]  # rows with a prefix start from a restored state, the others from zero


def _prefill_setup(seed: int):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    pool = 0.05 * torch.randn(NUM_SLOTS + 1, HEADS, DIM, DIM, device=CUDA, generator=gen)
    for slot, prefix in zip(SLOTS, PREFIXES):
        if not prefix:
            pool[slot] = float("nan")  # a fresh row must never read its slot
    return pool, _batch(LENGTHS, PREFIXES, SLOTS), _qkv(sum(LENGTHS), gen), gen


def test_prefill_then_decode_bf16_matches_fp32_reference() -> None:
    from hybridserve.ops.triton import lightning as kernel

    assert not torch.backends.cuda.matmul.allow_tf32  # the reference must be true fp32
    log_decay = _log_decay(0)  # layer 0: the fastest decays (0.43 .. 0.9966 per token)
    pool, batch, (q, k, v), gen = _prefill_setup(0)
    fast_pool, ref_pool = pool.clone(), pool.clone()
    out = kernel.lightning_attention(q, k, v, log_decay, fast_pool, batch)
    expected = reference.lightning_attention(q, k, v, log_decay, ref_pool, batch)
    out_err = max(_rel(out[s:s + n], expected[s:s + n]) for s, n in zip(batch.query_starts, LENGTHS))
    state_err = max(_rel(fast_pool[s], ref_pool[s]) for s in SLOTS)
    print(f"\nprefill ({kernel.DOT_PRECISION}): max relative error per row {out_err:.2e}, per state {state_err:.2e}")
    assert out_err <= BOUND and state_err <= BOUND
    lengths = [p + n for p, n in zip(PREFIXES, LENGTHS)]
    out_errs, state_errs = [], []
    for step in range(40):
        decode = _batch([1] * len(SLOTS), [n + step for n in lengths], SLOTS)
        q, k, v = _qkv(len(SLOTS), gen)
        out = kernel.lightning_attention(q, k, v, log_decay, fast_pool, decode)
        expected = reference.lightning_attention(q, k, v, log_decay, ref_pool, decode)
        out_errs.append(max(_rel(out[r], expected[r]) for r in range(len(SLOTS))))
        state_errs.append(max(_rel(fast_pool[s], ref_pool[s]) for s in SLOTS))
    print(f"decode, 40 steps: max relative error per row {max(out_errs):.2e}, per state {max(state_errs):.2e}")
    assert max(out_errs) <= BOUND and max(state_errs) <= BOUND
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in SLOTS]
    assert torch.equal(fast_pool[untouched], pool[untouched])


def test_dot_precision_choices() -> None:
    """Measures every input precision of the prefill dots (bf16 q/k/v; the fp32 operands are the decay-weighted
    scores, the state and the decayed keys); the default must meet the bound, the others are printed."""
    from hybridserve.ops.triton import lightning as kernel

    log_decay = _log_decay(30)  # slow decays: the state carries the most history
    pool, batch, (q, k, v), _ = _prefill_setup(1)
    ref_pool = pool.clone()
    expected = reference.lightning_prefill(q, k, v, log_decay, ref_pool, batch)
    errors = {}
    for precision in kernel.PRECISIONS:
        fast_pool = pool.clone()
        out = kernel.lightning_prefill(q, k, v, log_decay, fast_pool, batch, precision=precision)
        errors[precision] = (_rel(out, expected), max(_rel(fast_pool[s], ref_pool[s]) for s in SLOTS))
        print(f"\n{precision:>7}: output {errors[precision][0]:.2e}, state {errors[precision][1]:.2e}", end="")
    print()
    assert max(errors[kernel.DOT_PRECISION]) <= BOUND


def test_decode_replays_in_a_cuda_graph() -> None:
    """Fixed shapes, no allocation that depends on device data: the decode step captures and replays, with the
    same outputs and states as eager calls."""
    from hybridserve.ops.triton import lightning as kernel

    log_decay = _log_decay(0)
    gen = torch.Generator(device=CUDA).manual_seed(2)
    pool = 0.05 * torch.randn(NUM_SLOTS + 1, HEADS, DIM, DIM, device=CUDA, generator=gen)
    batch = _batch([1] * 4, [5, 9, 2, 30], [4, 12, 7, 2])
    q, k, v = _qkv(4, gen)
    eager_pool = pool.clone()
    eager = [kernel.lightning_attention(q, k, v, log_decay, eager_pool, batch) for _ in range(3)]
    graph_pool = pool.clone()
    kernel.lightning_attention(q, k, v, log_decay, graph_pool.clone(), batch)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.lightning_attention(q, k, v, log_decay, graph_pool, batch)
    graph_pool.copy_(pool)
    for step in range(3):
        graph.replay()
        assert torch.equal(out, eager[step])
    assert torch.equal(graph_pool, eager_pool)


# ------------------------------------------------------------------------------------------- issue 8's symptom


FLASH_LIGHTNING = tiny_ling_config(
    vocab_size=16384, hidden_size=4096, intermediate_size=9216, num_hidden_layers=4, layer_group_size=4,
    num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=DIM, group_norm_size=4, rope_theta=6e6,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    num_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4, moe_intermediate_size=1024,
    num_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, num_nextn_predict_layers=0,
)  # lightning layers 0-2 at flash widths, MLA layer 3; fewer experts than flash (the MoE is not under test)


@pytest.fixture(scope="module")
def flash_lightning_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ling-flash-lightning")
    tensors = {name: t.bfloat16() for name, t in random_ling_checkpoint(FLASH_LIGHTNING, seed=3).items()}
    write_checkpoint(directory, FLASH_LIGHTNING, tensors)
    return directory


def _greedy_alone(harness: CacheHarness, prompt: list[int], slot: int, steps: int) -> list[int]:
    tokens = [int(harness.run([harness.chunk(slot, prompt, 0, all_logits=False)])[0].argmax())]
    for step in range(steps - 1):
        tokens.append(int(harness.run([harness.chunk(slot, tokens[-1:], len(prompt) + step)])[0].argmax()))
    return tokens


def _together_forced(harness: CacheHarness, prompts: list[list[int]], forced: list[list[int]]) -> list[list[int]]:
    """All prompts prefilled together, then decoded together on the `forced` tokens: the argmax at every step."""
    chunks = [harness.chunk(slot, p, 0, all_logits=False) for slot, p in enumerate(prompts, start=1)]
    picks = [harness.run(chunks).argmax(-1).tolist()]
    for step in range(len(forced[0]) - 1):
        chunks = [harness.chunk(slot, [tokens[step]], len(p) + step)
                  for slot, (p, tokens) in enumerate(zip(prompts, forced), start=1)]
        picks.append(harness.run(chunks).argmax(-1).tolist())
    return [list(row) for row in zip(*picks)]


def test_four_requests_decoding_together_follow_the_fp32_argmax(flash_lightning_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 8: through fla, 4 requests decoding together picked the fp32 argmax 23% of the time (92% on the torch
    path). The fp32 CPU model decodes each prompt greedily alone; the bf16 GPU model decodes the 4 together,
    teacher-forced on those tokens, with the Triton kernels and then with the torch references on the same GPU."""
    steps = 32
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, FLASH_LIGHTNING["vocab_size"], (n,), generator=gen).tolist() for n in (100, 7, 65, 30)]
    cpu = CacheHarness(build_model(flash_lightning_dir, torch.float32, torch.device("cpu"))[0], num_pages=512)
    expected = [_greedy_alone(cpu, p, slot, steps) for slot, p in enumerate(prompts, start=1)]
    gpu_model = build_model(flash_lightning_dir, torch.bfloat16, CUDA)[0]

    def agreement() -> float:
        harness = CacheHarness(gpu_model, torch.bfloat16, num_pages=512, device="cuda")
        picks = _together_forced(harness, prompts, expected)
        return sum(a == b for row, ref in zip(picks, expected) for a, b in zip(row, ref)) / (len(prompts) * steps)

    kernels = agreement()
    use_triton = backends.use_triton
    with monkeypatch.context() as patch:
        patch.setattr(backends, "use_triton", lambda op, device: op not in ("lightning", "norm") and
                      use_triton(op, device))
        torch_path = agreement()
    print(f"\nfp32 argmax picked by the bf16 model, 4 requests decoding together: Triton kernels {kernels:.0%}, "
          f"torch references {torch_path:.0%}")
    assert kernels >= 0.85 and kernels >= torch_path - 0.05
