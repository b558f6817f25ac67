"""No Triton kernel argument may carry a name that Triton's GPU launcher uses itself.

On the GPU, a kernel launch first runs a binder that Triton generates from the kernel's signature
(`triton.runtime.jit.create_function_from_signature`): its arguments are the kernel's, and its body assigns its own
locals and reads globals of its namespace. A kernel argument of one of those names shadows them, and the launch fails
(the sampler's argument `params` did: "failed to specialize argument of type: dict"). The interpreter, which the CPU
tests run, never builds that binder, so only this check catches it before a GPU does. Helpers are held to the same
rule as launched kernels: one rule is simpler than tracking which functions are launched.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

triton = pytest.importorskip("triton")
from triton.runtime import jit  # noqa: E402

import hybridserve.ops.triton as kernels  # noqa: E402

# The binder's own locals (params, specialization, options) and its namespace's globals, as Triton 3.6 writes them;
# arguments with defaults also get a `default_<name>` global.
BINDER_NAMES = {"params", "specialization", "options", "specialize_impl", "backend", "JITCallable"}
OPTIONAL = {"lightning_fla"}  # needs fla-core, a GPU extra


def _kernel_modules():
    for info in pkgutil.iter_modules(kernels.__path__):
        try:
            yield importlib.import_module(f"{kernels.__name__}.{info.name}")
        except ImportError:
            if info.name not in OPTIONAL:
                raise


def _jit_functions():
    """(qualified name, argument names) of every Triton function defined in hybridserve.ops.triton."""
    for module in _kernel_modules():
        for name, value in vars(module).items():
            if isinstance(value, jit.KernelInterface) and value.fn.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", list(inspect.signature(value.fn).parameters)


def test_the_binder_still_uses_the_names_checked_here():
    source = inspect.getsource(jit.create_function_from_signature)
    assert all(name in source for name in BINDER_NAMES), "Triton's binder changed: update BINDER_NAMES"


def _clashes(arguments: list[str]) -> list[str]:
    return [a for a in arguments if a in BINDER_NAMES or a.startswith("default_")]


def test_no_kernel_argument_shadows_the_binder():
    functions = dict(_jit_functions())
    assert "hybridserve.ops.triton.sampling._pick_kernel" in functions  # the scan reaches the kernels
    assert len(functions) > 50
    assert {name: _clashes(args) for name, args in functions.items() if _clashes(args)} == {}


def test_the_sampler_kernels_old_signature_is_flagged():
    """The sampler's first block kernel as it failed on the H200, and a name the defaults' globals would take."""
    before_fix = ["logits", "params", "block_max", "vocab", "logits_stride", "blocks", "BLOCK", "USE_PDL"]
    assert _clashes(before_fix) == ["params"]
    assert _clashes(["x", "default_scale", "backend"]) == ["default_scale", "backend"]
    assert _clashes(["logits", "draw_params", "block_max"]) == []
