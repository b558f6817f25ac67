"""Triton kernels (CUDA; testable on CPU through TRITON_INTERPRET=1). Imported only through the `ops` entry points."""
