"""Session setup: Triton's interpreter on machines without CUDA, and a collector tuned for the suite.

Triton decides between compiling and interpreting its kernels (its own library's too) when they
are defined, at import, from `TRITON_INTERPRET`; so it is set here, before any test imports
triton, and the Triton kernel tests run on the CPU (`tests/test_triton_kernels.py`). With CUDA the
same tests run the compiled kernels on the GPU.

Most of the suite's time is dynamo tracing small models, which allocates millions of short-lived
objects; with Python's default thresholds the cyclic collector runs thousands of times, walking
torch's own module objects each full pass (about 13% of `tests/test_backend.py`'s time). What the
imports made is frozen (never walked again) and collections are spaced out: about 15% less CPU
time per test file, the same behaviour (nothing here relies on when a cycle is collected; tests
that need a collection call `gc.collect()`).
"""
import gc
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

gc.freeze()
gc.set_threshold(20000, 20, 50)


def pytest_unconfigure(config) -> None:
    """What was frozen collectable again at the end, so that the interpreter's exit finds no
    live extension objects it would report as leaked."""
    gc.unfreeze()
    gc.collect()
