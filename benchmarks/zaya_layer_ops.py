"""Launches one ZAYA1 decoder layer issues per decode step, counted on CPU: a 3-layer model minus a 2-layer one.

The ZAYA kernels (conv, norm, zaya_qk, zaya_router) run through Triton's interpreter and each call counts as one
launch; every other aten op that would launch a CUDA kernel is counted by a dispatch mode (views and allocations
launch nothing); attention and MoE, other kernels' work, count as calls of their entry points, reported apart.
This checks the design without a GPU; on one, benchmarks/decode_launches.py counts the real CUDA launches.

    python benchmarks/zaya_layer_ops.py [--batch 4]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ZAYA_KERNELS = ("conv", "norm", "zaya_qk", "zaya_router")
_NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "alias", "_unsafe_view", "_reshape_alias"}


def tiny_zaya_config(num_layers: int) -> dict:
    return {"model_type": "zaya", "architectures": ["ZayaForCausalLM"], "num_hidden_layers": num_layers,
            "vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "moe_intermediate_size": 32, "num_experts": 4, "router_hidden_size": 16, "num_experts_per_tok": 1,
            "max_position_embeddings": 4096, "eos_token_id": 1, "layer_types": ["hybrid"] * num_layers}


class _AtenCounter(TorchDispatchMode):
    """Counts aten ops that launch a kernel (not views, not allocations), except while paused."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in _NO_LAUNCH:
            self.ops[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _counted_cpu_step(counts: Counter):
    """Interpreted ZAYA kernels and entry-point calls of attention / MoE counted into `counts` (prefixed names)."""
    import triton.runtime.interpreter as interpreter

    from hybridserve.layers import moe
    from hybridserve.models import zaya
    from hybridserve.ops import backends

    aten = _AtenCounter()

    def opaque(label, fn):
        def run(*args, **kwargs):
            counts[label] += 1
            aten.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                aten.paused -= 1
        return run

    original_run = interpreter.InterpretedFunction.run

    def launch(self, *args, **kwargs):
        return opaque(f"triton.{self.fn.__name__}", original_run)(self, *args, **kwargs)

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(backends, "use_triton", lambda op, device: op in ZAYA_KERNELS))
        stack.enter_context(mock.patch.object(interpreter.InterpretedFunction, "run", launch))
        stack.enter_context(mock.patch.object(zaya, "paged_attention", opaque("entry.attention", zaya.paged_attention)))
        stack.enter_context(mock.patch.object(moe, "fused_experts", opaque("entry.moe", moe.fused_experts)))
        stack.enter_context(aten)
        yield
    counts.update(aten.ops)


def decode_step_launches(num_layers: int, batch_size: int) -> Counter:
    """Launch counts of one decode forward (rows at prefix 3 over zeroed caches: the values do not matter)."""
    from hybridserve.cache.kv_pool import KVPool
    from hybridserve.cache.state_pool import StatePool
    from hybridserve.core.batch import ScheduledChunk, build_forward_batch
    from hybridserve.demo import write_random_checkpoint
    from hybridserve.runtime.model_loader import build_model

    dtype, device, page_size = torch.float32, torch.device("cpu"), 16
    with tempfile.TemporaryDirectory() as directory:
        write_random_checkpoint(Path(directory), tiny_zaya_config(num_layers))
        model, _ = build_model(directory, dtype, device)
    kv = KVPool(model.kv_cache_spec(dtype), batch_size + 1, page_size, device)
    state = StatePool(model.state_spec(dtype), batch_size, device)
    model.bind_caches([kv.layer(i) for i in range(num_layers)], [state.layer(i) for i in range(num_layers)])
    chunks = [ScheduledChunk([5], 3, [row + 1], row + 1, True, [0]) for row in range(batch_size)]
    batch = build_forward_batch(chunks, page_size, device, model.history_len)

    counts: Counter = Counter()
    with _counted_cpu_step(counts), torch.inference_mode():
        model(batch)
    return counts


def launches_per_layer(batch_size: int) -> Counter:
    """What one more decoder layer adds to a decode step."""
    more, fewer = (decode_step_launches(n, batch_size) for n in (3, 2))
    more.subtract(fewer)
    return +more


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="decode rows")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    per_layer = launches_per_layer(args.batch)
    for name, count in sorted(per_layer.items()):
        print(f"{count:4d}  {name}")
    entries = {n: c for n, c in per_layer.items() if n.startswith("entry.")}
    print(f"total {sum(per_layer.values())} per layer (attention and MoE counted as {sum(entries.values())} entry "
          "calls; their kernels add their own launches)")


if __name__ == "__main__":
    main()
