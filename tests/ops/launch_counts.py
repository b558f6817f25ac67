"""Launches each decoder layer of ZAYA1 or Ling-2.6 issues per decode step, counted on CPU.

Each launch of the model's Triton kernels (through Triton's interpreter, so that they are plain Python calls) counts
once and is not run: the forward makes no host decision on device values (no device-to-host syncs), so its launches do
not depend on them; the launch zero-fills its tensor arguments instead, so the aten ops after it read defined values.
Every other aten op that would launch a CUDA kernel is counted by a dispatch mode (views and allocations launch
nothing); entry points kept opaque (ZAYA1's attention and MoE, whose kernels have their own launch accounting) count
as calls, reported apart. Forward hooks on the decoder layers attribute every launch to the layer running it
("outside" for the embedding and the final norm). This checks the design without a GPU; on one, `python -m
benchmarks.ops launches` counts the real CUDA launches (cuBLAS may add a split-K reduction per GEMM, which no CPU
count can see). The budgets are pinned by tests/ops/test_layer_launches.py; `python -m benchmarks.ops layer-launches`
prints the counts.
"""
from __future__ import annotations

import dataclasses
import tempfile
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "alias", "_unsafe_view", "_reshape_alias", "promote_types"}


def tiny_zaya_config(num_layers: int) -> dict:
    return {"model_type": "zaya", "architectures": ["ZayaForCausalLM"], "num_hidden_layers": num_layers,
            "vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "moe_intermediate_size": 32, "num_experts": 4, "router_hidden_size": 16, "num_experts_per_tok": 1,
            "max_position_embeddings": 4096, "eos_token_id": 1, "layer_types": ["hybrid"] * num_layers}


def tiny_ling_config(num_layers: int) -> dict:
    """The layout `python -m benchmarks.ops launches` measures on the GPU: one group of `num_layers` layers (the last
    MLA, the others lightning), layer 0 with the dense FFN, the rest MoE with a shared expert."""
    from tests.reference.ling_naive import tiny_ling_config as ling_config
    return ling_config(num_hidden_layers=num_layers, layer_group_size=num_layers, first_k_dense_replace=1,
                       num_nextn_predict_layers=0)


@dataclasses.dataclass(frozen=True)
class CountedModel:
    config: Callable[[int], dict]
    kernels: tuple[str, ...]  # ops (ops.backends names) run through the interpreter
    opaque: tuple[tuple[str, str], ...] = ()  # (module, entry point) counted as calls "entry.<entry point>"


MODELS = {
    "zaya": CountedModel(tiny_zaya_config, ("attention", "conv", "norm", "zaya_router", "moe", "linear",
                                            "fp8_linear", "fp8_moe")),
    "ling": CountedModel(tiny_ling_config, ("attention", "moe", "router", "lightning", "ling_norm", "activation",
                                            "linear", "fp8_linear", "fp8_moe")),
}


class _AtenCounter(TorchDispatchMode):
    """Counts aten ops that launch a kernel (not views, not allocations) under the current label, unless paused."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, Counter] = {}
        self.label = "outside"
        self.paused = 0

    def count(self, name: str) -> None:
        self.ops.setdefault(self.label, Counter())[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # counted as the ops it is made of (linear: mm; einsum: bmm and any copies), as on a GPU
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in _NO_LAUNCH:
            self.count(f"aten.{name}")
        return func(*args, **kwargs)


@contextmanager
def _counted(spec: CountedModel, model: torch.nn.Module, counter: _AtenCounter):
    """Interpreted kernels, opaque entry points and aten ops counted into `counter` by layer."""
    import importlib

    import triton.runtime.interpreter as interpreter

    from hybridserve.ops import backends

    def opaque(label, fn):
        def run(*args, **kwargs):
            if not counter.paused:
                counter.count(label)
            counter.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.paused -= 1
        return run

    def launch(self, *args, **kwargs):
        if counter.paused:
            return
        counter.count(f"triton.{self.fn.__name__}")
        counter.paused += 1
        try:  # not run: defined values (zeros) wherever the kernel may write, for the aten ops after it
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    value.zero_()
        finally:
            counter.paused -= 1

    def enter(index):
        def hook(module, args):
            counter.label = index
        return hook

    def leave(module, args, output):
        counter.label = "outside"

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(backends, "use_triton", lambda op, device: op in spec.kernels))
        stack.enter_context(mock.patch.object(interpreter.InterpretedFunction, "run", launch))
        for module_name, entry in spec.opaque:
            module = importlib.import_module(module_name)
            stack.enter_context(mock.patch.object(module, entry, opaque(f"entry.{entry}", getattr(module, entry))))
        for index, layer in enumerate(model.model.layers):
            stack.callback(layer.register_forward_pre_hook(enter(index)).remove)
            stack.callback(layer.register_forward_hook(leave).remove)
        stack.enter_context(counter)
        yield


def decode_step_launches(name: str, num_layers: int, batch_size: int, quantization: str | None = None
                         ) -> dict[int | str, Counter]:
    """Launch counts of one decode forward by layer index (and "outside"): rows at prefix 3 over zeroed caches (the
    values do not matter), after an uncounted forward, as a decode step runs after warm-up. `quantization`: the
    engine's option ("fp8": the projections and experts online FP8)."""
    from hybridserve.cache.kv_pool import KVPool
    from hybridserve.cache.state_pool import StatePool
    from hybridserve.core.batch import ScheduledChunk, build_forward_batch
    from hybridserve.demo import write_random_checkpoint
    from hybridserve.runtime.build_model import build_model

    spec = MODELS[name]
    # fp16 (which the interpreter runs faithfully) stands for bf16: the casts a 16-bit model makes are counted.
    dtype, device, page_size = torch.float16, torch.device("cpu"), 16
    with tempfile.TemporaryDirectory() as directory:
        write_random_checkpoint(Path(directory), spec.config(num_layers))
        model, _ = build_model(directory, dtype, device, quantization=quantization)
    kv_layers = model.kv_cache_spec(dtype).num_layers
    state_layers = model.state_spec(dtype).num_layers
    kv = KVPool(model.kv_cache_spec(dtype), batch_size + 1, page_size, device)
    state = StatePool(model.state_spec(dtype), batch_size, device)
    model.bind_caches([kv.layer(i) for i in range(kv_layers)], [state.layer(i) for i in range(state_layers)])
    chunks = [ScheduledChunk([5], 3, [row + 1], row + 1, True, [0]) for row in range(batch_size)]
    batch = build_forward_batch(chunks, page_size, device, model.history_len)

    counter = _AtenCounter()
    with torch.inference_mode():
        with _counted(spec, model, _AtenCounter()):  # not counted: first calls allocate (arrival counters) once
            model(batch)
        with _counted(spec, model, counter):
            model(batch)
    return counter.ops

