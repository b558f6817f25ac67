"""Kernel tests: on a CUDA machine they run the Triton kernels on the GPU (bf16 included); elsewhere through
Triton's interpreter (TRITON_INTERPRET=1, fp32/fp16 only: bf16 inputs are not emulated faithfully there).

The variable must be set before triton is imported (`triton.jit` reads it at decoration time, also for
triton.language's own functions such as tl.max), which is why the root tests/conftest.py sets it first; it is set
here again for runs that bypass that file. Kernel modules are imported inside the tests' modules only.
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
