"""Ling-2.6 decode agreement on CUDA: how often the bf16 engine's greedy tokens are the fp32 reference's argmax,
per lightning implementation, with requests decoded together and one at a time (issue 8's table).

Setup: Ling-2.6-flash widths (hidden 4096, 32 heads x 128, MLA 1536/512/128/64/128, 256 experts top-8 in groups
8/4 x 1024 + 1 shared), 2 layers (lightning + dense FFN, MLA + MoE), vocab 32768, random 1/sqrt(fan_in) weights,
`lightning_decay_variant=hf_remote_code`, bf16; prompts of 33/97/211/300 tokens, 48 greedy tokens each, through
`LLM.generate` with `prompt_logprobs=1`. The oracle is the same checkpoint in fp32 with every op on its torch
reference, teacher-forced over each run's tokens. The lightning implementation is switched per run; every other op
runs its selected (Triton) kernel throughout.

    python benchmarks/ling_decode_agreement.py [--out results.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hybridserve.ops.triton as triton_ops  # noqa: E402
from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.ops import backends  # noqa: E402
from hybridserve.ops.reference import lightning as reference  # noqa: E402
from tests.helpers import add_tokenizer  # noqa: E402
from tests.reference.ling_naive import flash_config, random_ling_checkpoint, write_checkpoint  # noqa: E402

FLASH_2_LAYERS = flash_config(vocab_size=32768, lightning_decay_variant="hf_remote_code",
                              max_position_embeddings=4096)
PROMPT_LENGTHS = (33, 97, 211, 300)
NEW_TOKENS = 48


def lightning_variants() -> dict[str, types.ModuleType | None]:
    """name -> a module with `lightning_attention` standing in for ops.triton.lightning (None: the torch path).

    "fla-chunk" is fla-core's chunk kernel with `g_gamma` for prefill, the call issue 8 found writing NaN states
    (see ops/triton/lightning_fla.py); kept here so the table shows the failure next to the fix."""
    variants: dict[str, types.ModuleType | None] = {"torch": None}
    try:
        from hybridserve.ops.triton import lightning as own
        variants["triton"] = own
    except ImportError:
        return variants
    try:
        from fla.ops.simple_gla import chunk_simple_gla

        from hybridserve.ops.triton import lightning_fla as fla
    except ImportError:
        return variants

    def fla_chunk_prefill(q, k, v, log_decay, state_pool, batch):
        cu_host = torch.tensor([*batch.query_starts, sum(batch.query_lens)], dtype=torch.long)
        out, final = chunk_simple_gla(q.float()[None], k.float()[None], v.float()[None], g_gamma=log_decay.float(),
                                      initial_state=reference.initial_states(state_pool, batch),
                                      output_final_state=True, cu_seqlens=cu_host.to(q.device),
                                      cu_seqlens_cpu=cu_host)
        state_pool[batch.state_slots] = final
        return out[0].float()

    fla_chunk = types.ModuleType("lightning_fla_chunk")
    fla_chunk.lightning_attention = lambda q, k, v, g, pool, batch: (
        fla.lightning_attention if batch.is_decode else fla_chunk_prefill)(q, k, v, g, pool, batch)
    variants["fla-decode"] = fla
    variants["fla-chunk"] = fla_chunk
    return variants


@contextlib.contextmanager
def lightning_as(module: types.ModuleType | None, selection: dict[str, str]):
    """Run with the engine's kernel selection, the lightning op replaced by `module` (None: torch reference)."""
    saved = (dict(backends._selected), getattr(triton_ops, "lightning", None), sys.modules.get(
        "hybridserve.ops.triton.lightning"))
    backends._selected.update(selection)
    if module is None:
        backends._selected["lightning"] = "torch"
    else:
        backends._selected["lightning"] = "triton"
        triton_ops.lightning = module
        sys.modules["hybridserve.ops.triton.lightning"] = module
    try:
        yield
    finally:
        backends._selected.clear()
        backends._selected.update(saved[0])
        if saved[1] is not None:
            triton_ops.lightning = saved[1]
            sys.modules["hybridserve.ops.triton.lightning"] = saved[2]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, FLASH_2_LAYERS["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def generate(llm: LLM, batch: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """(generated tokens, top-1 of each prompt position's logprobs) per prompt."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    return [(o.outputs[0].token_ids, [_top1(d) for d in o.prompt_logprobs[1:]]) for o in outs]


def _top1(logprobs: dict[int, float]) -> int:
    return max(logprobs, key=logprobs.get)


def oracle_top1(oracle: LLM, sequence: list[int]) -> list[int]:
    """The fp32 reference's argmax after every prefix of `sequence` (position p predicts token p + 1)."""
    out = oracle.generate([{"prompt_token_ids": sequence}],
                          SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1))[0]
    return [_top1(d) for d in out.prompt_logprobs[1:]] + [out.outputs[0].token_ids[0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="ling-flash-2l-"))
    tensors = {name: t.bfloat16() for name, t in random_ling_checkpoint(FLASH_2_LAYERS, seed=0).items()}
    write_checkpoint(directory, FLASH_2_LAYERS, tensors)
    add_tokenizer(directory)
    # The planner counts memory already in use against each engine's share, so the second one gets a larger one.
    common = dict(device="cuda", max_model_len=1024, enable_prefix_caching=False)
    oracle = LLM(str(directory), dtype="float32", kernel_backend="torch", gpu_memory_utilization=0.35, **common)
    oracle_selection = dict(backends._selected)
    engine = LLM(str(directory), dtype="bfloat16", gpu_memory_utilization=0.7, **common)
    selection = dict(backends._selected)
    batch = prompts()
    rows = []
    for name, module in lightning_variants().items():
        for arrangement in ("together", "alone"):
            with lightning_as(module, selection):
                runs = generate(engine, batch) if arrangement == "together" else \
                    [generate(engine, [p])[0] for p in batch]
            decode_hits = decode_total = prefill_hits = prefill_total = 0
            for prompt, (tokens, prompt_top1) in zip(batch, runs):
                with lightning_as(None, oracle_selection):
                    expected = oracle_top1(oracle, prompt + tokens[:-1])
                # expected[p] predicts token p + 1: prompt positions, then the NEW_TOKENS decode picks.
                prefill_hits += sum(a == b for a, b in zip(prompt_top1, expected[:len(prompt) - 1]))
                prefill_total += len(prompt) - 1
                decode_hits += sum(a == b for a, b in zip(tokens, expected[len(prompt) - 1:]))
                decode_total += len(tokens)
            rows.append({"lightning": name, "arrangement": arrangement,
                         "decode_agreement": decode_hits / decode_total,
                         "prefill_agreement": prefill_hits / prefill_total})
            print(f"{name:<28} {arrangement:<9} decode {decode_hits / decode_total:6.1%}  "
                  f"prefill top-1 {prefill_hits / prefill_total:6.1%}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": FLASH_2_LAYERS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
