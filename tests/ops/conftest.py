"""Kernel tests: on a CUDA machine they run the Triton kernels on the GPU (bf16 included); elsewhere through
Triton's interpreter (TRITON_INTERPRET=1, fp32/fp16 only: bf16 inputs are not emulated faithfully there).

The variable must be set before any kernel module is imported (`triton.jit` reads it at decoration time), which
is why it is set here, when pytest collects this directory, and why kernel modules are imported inside the tests'
modules only after this conftest ran.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# Dtypes a kernel test should cover here: the interpreter only does fp32 / fp16 faithfully.
KERNEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
