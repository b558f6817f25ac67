"""Speculative decoding on the H200: the verify paths of the recurrent kernels at real widths in bf16, and whole runs
at real widths (two layers, fp32) replaying the verify and draft CUDA graphs.

- Kernels: the CCA conv kernel's verify rows at ZAYA1-8B widths (8 q / 2 kv heads x 128) and the lightning verify
  kernel at Ling-2.6-flash widths (32 heads x 128), bf16 inputs against the fp32 references (the bounds of
  tests/ops: conv q/k 3e-3 of the output scale, exact copies for values and states; lightning 5e-5 relative for
  fp32 inputs; for bf16 inputs both sides upcast the same rounded values, so the same bound holds).
- Engine: greedy output with speculation (ZAYA1 n-gram, Ling MTP; drafts replayed from the plain run with every
  third token wrong, so verify rows accept none, some or all of their drafts) equals the plain eager run token for
  token, logprobs within 1e-4 (verify rows run other kernels than decode rows: prefill-shaped attention, other GEMM
  shapes), with the verify graphs (and Ling's draft graphs) really replayed. A capture would have failed on any
  device-to-host sync in those forwards.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.engine.drafts import ReplayDrafts
from tests.gpu.models import largest_logprob_difference, write_two_layer_model

pytestmark = pytest.mark.gpu(engine=True)


def test_conv_verify_rows_at_zaya1_8b_widths() -> None:
    from tests.ops.test_conv_kernel import VERIFY, run_conv_case

    for dtype in (torch.bfloat16, torch.float32):
        for form in ("heads", "columns"):
            run_conv_case(VERIFY, dtype, form, page_size=16, q_heads=8, k_heads=2, d=128, verify={0, 2, 4, 5})


def test_lightning_verify_rows_at_flash_widths() -> None:
    from hybridserve.ops.reference import lightning as reference
    from hybridserve.ops.triton import lightning as kernel
    from tests.ops.test_lightning_kernel import verify_batch

    heads, d = 32, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [(5, 1, True), (1, 2, False), (4, 3, True), (200, 4, False), (2, 5, True)]  # (tokens, slot, verify)
    batch = verify_batch(rows, first_draft_slot=6, prefix=40)
    draft_slot = 6 + sum(n - 1 for n, _, verify in rows if verify)
    tokens = sum(n for n, _, _ in rows)
    q, k, v = (torch.randn(tokens, heads, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    log_decay = -torch.rand(heads, device="cuda", generator=gen) * 1.7
    pool = torch.randn(draft_slot, heads, d, d, device="cuda", generator=gen)
    got_pool, ref_pool = pool.clone(), pool.clone()
    out = kernel.lightning_attention(q, k, v, log_decay, got_pool, batch)
    expected = reference.lightning_attention(q, k, v, log_decay, ref_pool, batch)
    assert ((out - expected).norm() / expected.norm()).item() <= 5e-5
    for slot in range(draft_slot):
        assert ((got_pool[slot] - ref_pool[slot]).norm() / ref_pool[slot].norm()).item() <= 5e-5, slot


@pytest.mark.parametrize("model, method", [("zaya", "ngram"), ("ling", "mtp")])
def test_speculative_graph_runs_match_plain_eager_decode(model: str, method: str, tmp_path: Path) -> None:
    write_two_layer_model(model, tmp_path, mtp=method == "mtp")
    # 32 running requests: verify graphs cover as many tokens as the largest decode graph (32 rows of 1 token, 8 of
    # 1 + 3), so every verify step of these 8 requests fits one.
    options = dict(dtype="float32", device="cuda", max_num_batched_tokens=1024, max_running_requests=32,
                   max_model_len=2048, gpu_memory_utilization=0.25, use_tqdm=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (5, 40, 130, 17, 300, 64, 9, 250)]
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(str(tmp_path), enforce_eager=True, disable_overlap_schedule=True, **options)
    expected = plain.generate(inputs, params)
    del plain
    torch.cuda.empty_cache()

    llm = LLM(str(tmp_path), speculative_config={"method": method, "num_speculative_tokens": 3}, **options)
    runner = llm.engine.runner
    assert runner.verify_graphs is not None and (runner.graphs is None) == (method == "mtp")
    replays = {"verify": 0, "draft": 0}
    for name, graphs in (("verify", runner.verify_graphs._graphs), ("draft", runner.verify_graphs._draft_graphs)):
        for graph in graphs.values():
            graph.replay = (lambda replay, name: lambda: (replays.__setitem__(name, replays[name] + 1),
                                                          replay())[1])(graph.replay, name)
    verify_steps = 0
    launch = runner.launch

    def counting_launch(plan):
        nonlocal verify_steps
        # Verify steps with decode-shaped rows only (a step that also prefills, e.g. a prompt's tail after its
        # page-aligned snapshot, runs eagerly).
        verify_steps += any(c.num_drafts for c in plan.chunks) and \
            all(len(c.token_ids) == 1 + c.num_drafts for c in plan.chunks)
        return launch(plan)

    runner.launch = counting_launch
    wrong = {tuple(p): [(t + 1) % 1000 if j % 3 == 2 else t for j, t in enumerate(o.outputs[0].token_ids)]
             for p, o in zip(prompts, expected)}
    llm.engine.set_draft_source(ReplayDrafts(wrong, key=lambda request: tuple(request.prompt_token_ids)))
    got = llm.generate(inputs, params)
    worst = largest_logprob_difference(expected, got)
    stats = llm.engine.stats()
    print(f"\n{model} {method}: largest logprob difference speculative graphs vs plain eager {worst:.2e}; replays "
          f"{replays} over {verify_steps} decode-shaped verify steps; accepted {stats['spec_accepted_tokens']} of "
          f"{stats['spec_draft_tokens']} drafts")
    assert worst <= 1e-4
    # Every such step replays the verify graphs (Ling's plain decode steps do too: its draft layer replaces the
    # decode graphs).
    assert verify_steps > 4 and replays["verify"] >= verify_steps
    assert (replays["draft"] >= verify_steps) if method == "mtp" else replays["draft"] == 0
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    reserve = runner.graph_reserve
    pool = sum(graphs.memory_bytes for graphs in (runner.verify_graphs, runner.graphs, runner.prefill_graphs)
               if graphs is not None)  # one pool: what each capture added to it
    print(f"{model}: graph pool {pool / 2**20:.0f} MiB, reserved {reserve / 2**20:.0f} MiB")
    assert 0 < pool <= reserve
