"""Which implementation each op runs: Triton kernels on CUDA, the pure-torch references everywhere else.

The model runner calls `select_kernels` once at start-up; it decides per op, logs the choice in one line, and warns
in one line when the Triton path was wanted but cannot be imported (the optional `gpu` extra). The references stay
the oracle of every kernel's tests, and the only path on CPU: CPU installs never import Triton.
"""
from __future__ import annotations

import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)

OPS = ("attention", "moe", "router", "conv", "lightning", "norm", "ling_norm", "activation",
       "zaya_router", "linear", "sampling", "fp8_linear", "fp8_moe")
CHOICES = ("auto", "triton", "torch")

_selected: dict[str, str] = {}


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _has_kernel(op: str) -> bool:
    """Whether `ops/triton/<op>.py` exists (found without importing it, so without importing Triton)."""
    return importlib.util.find_spec(f"hybridserve.ops.triton.{op}") is not None


def select_kernels(device: torch.device, preference: str = "auto") -> dict[str, str]:
    """Fix the backend of every op for this process: 'triton' on CUDA (unless `preference` is 'torch') for every op
    that has a kernel module, else 'torch'.

    `preference='triton'` on a device or install where the kernels cannot run is an error, not a silent fallback.
    """
    if preference not in CHOICES:
        raise ValueError(f"kernel backend must be one of {', '.join(CHOICES)}; got {preference!r}")
    backend = "torch"
    if device.type == "cuda" and preference != "torch":
        if _triton_importable():
            backend = "triton"
        elif preference == "triton":
            raise ValueError("kernel_backend='triton' needs the triton package: pip install 'hybridserve[gpu]'")
        else:
            logger.warning("Triton is not installed: every op runs its pure-torch reference on %s "
                           "(pip install 'hybridserve[gpu]' for the kernels)", device)
    elif preference == "triton":
        raise ValueError(f"kernel_backend='triton' needs a CUDA device; the engine runs on {device}")
    _selected.clear()
    _selected.update({op: backend if backend == "torch" or _has_kernel(op) else "torch" for op in OPS})
    logger.info("kernels: %s", " ".join(f"{op}={name}" for op, name in _selected.items()))
    return dict(_selected)


def any_triton() -> bool:
    """Whether `select_kernels` picked a Triton kernel for any op (so there is something to compile)."""
    return any(name == "triton" for name in _selected.values())


def all_triton() -> bool:
    """Whether `select_kernels` picked the Triton kernel for every op (the forward then never syncs the host)."""
    return bool(_selected) and all(name == "triton" for name in _selected.values())


def use_triton(op: str, device: torch.device) -> bool:
    """True when `op` should run its Triton kernel for tensors on `device` (never for CPU tensors)."""
    if device.type != "cuda":
        return False
    if not _selected:  # a model used outside an engine (tests, scripts): decide as `select_kernels` would
        return _triton_importable() and _has_kernel(op)
    return _selected[op] == "triton"
