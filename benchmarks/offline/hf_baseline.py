"""The offline benchmark's baseline: HF transformers `generate` on the same model and prompts, in static batches
of up to `--hf-batch` left-padded prompts, sampling as our engine does (its own random init with dummy weights)."""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.offline.scenarios import counted_tokens, unit
from benchmarks.offline.timing import sync


def run_hf(model_dir: str, workloads: dict, args: argparse.Namespace) -> dict[str, float]:
    """Per scenario of `workloads`: HF's tok/s over its batches, after a warm-up."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.load_format == "dummy":  # no weights on disk: HF's own random init (the timing does not depend on it)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device)
    model.eval()
    model.generation_config.eos_token_id = None
    rates = {}
    for name, (prompts, outputs) in workloads.items():
        size = min(args.hf_batch, len(prompts))
        batches = [list(range(i, min(i + size, len(prompts)))) for i in range(0, len(prompts), size)]
        _hf_generate(model, [prompts[0]], 2, args)  # warm-up
        sync(args.device)
        start = time.perf_counter()
        for batch in batches:
            _hf_generate(model, [prompts[i] for i in batch], max(outputs[i] for i in batch), args)
        sync(args.device)
        rates[name] = counted_tokens(name, prompts, outputs) / (time.perf_counter() - start)
        print(f"HF transformers {name} (static batches of {size}): {rates[name]:.1f} {unit(name)}", flush=True)
    return rates


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, args: argparse.Namespace) -> None:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=args.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=args.device)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0, pad_token_id=0)
