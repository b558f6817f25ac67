"""Kernel launches per decode step, from a torch.profiler trace, for ZAYA1 and Ling-2.6 at real widths.

Each model is built from a random checkpoint (ZAYA1-8B widths; Ling-2.6-flash widths with one layer group:
lightning + MLA layers, dense FFN and MoE), a batch of sequences is prefilled, then one decode step is traced.
The count is the number of CUDA kernels (and memcpy/memset) the step runs, divided by the number of decoder
layers for the per-layer figure; the most frequent kernel names are listed to show where launches come from.

    python -m benchmarks.ops launches [--batch 8] [--zaya-layers 4] [--ling-layers 4] [--out launches.json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hybridserve.demo import write_random_checkpoint
from hybridserve.models.released import zaya1_8b_config
from hybridserve.ops.backends import select_kernels
from hybridserve.runtime.build_model import build_model
from tests.helpers import CacheHarness
from tests.reference.ling_naive import flash_config, random_ling_checkpoint, write_checkpoint


def _zaya_dir(layers: int) -> Path:
    directory = Path(tempfile.mkdtemp(prefix="zaya-launches-"))
    config = zaya1_8b_config(layers) | {"vocab_size": 32768}
    write_random_checkpoint(directory, config)
    return directory


def _ling_dir(layers: int) -> Path:
    directory = Path(tempfile.mkdtemp(prefix="ling-launches-"))
    config = flash_config(num_hidden_layers=layers, layer_group_size=layers, first_k_dense_replace=1,
                          vocab_size=32768, lightning_decay_variant="hf_remote_code", max_position_embeddings=4096)
    write_checkpoint(directory, config, {n: t.bfloat16() for n, t in random_ling_checkpoint(config, 0).items()})
    return directory


def count_decode_launches(directory: Path, batch: int, prompt_len: int = 64) -> dict:
    model, config = build_model(directory, torch.bfloat16, torch.device("cuda"))
    harness = CacheHarness(model, torch.bfloat16, num_pages=batch * (prompt_len // 16 + 4), page_size=16,
                           num_slots=batch + 1, device="cuda")
    slots = range(1, batch + 1)
    harness.run([harness.chunk(s, list(range(3, 3 + prompt_len)), 0, all_logits=False) for s in slots])
    for step in range(3):  # warm-up: compile and tune every kernel
        harness.run([harness.chunk(s, [5], prompt_len + step) for s in slots])
    torch.cuda.synchronize()
    chunks = [harness.chunk(s, [7], prompt_len + 3) for s in slots]
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        harness.run(chunks)
        torch.cuda.synchronize()
    kernels = Counter(e.name for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    total = sum(kernels.values())
    layers = len(model.model.layers)
    return {"layers": layers, "batch": batch, "launches_per_step": total, "launches_per_layer": total / layers,
            "top_kernels": kernels.most_common(25)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--zaya-layers", type=int, default=4)
    parser.add_argument("--ling-layers", type=int, default=4)
    parser.add_argument("--kernel-backend", default="auto", choices=["auto", "torch"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    select_kernels(torch.device("cuda"), args.kernel_backend)
    results = {"zaya1": count_decode_launches(_zaya_dir(args.zaya_layers), args.batch),
               "ling2_6": count_decode_launches(_ling_dir(args.ling_layers), args.batch)}
    for name, r in results.items():
        print(f"{name}: {r['launches_per_step']} launches per decode step over {r['layers']} layers "
              f"= {r['launches_per_layer']:.1f} per layer (batch {r['batch']}, kernels={args.kernel_backend})")
        for kernel, n in r["top_kernels"][:12]:
            print(f"    {n:5d}  {kernel[:110]}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
