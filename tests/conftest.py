"""Session setup: Triton's interpreter on machines without CUDA.

Triton decides between compiling and interpreting its kernels (its own library's too) when they
are defined, at import, from `TRITON_INTERPRET`; so it is set here, before any test imports
triton, and the Triton kernel tests run on the CPU (`tests/test_triton_kernels.py`). With CUDA the
same tests run the compiled kernels on the GPU.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
