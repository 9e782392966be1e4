"""Python's cyclic garbage collector paused while the compiler builds long-lived objects."""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off for the block: the passes and a capture allocate tens of thousands of
    long-lived objects (FX nodes, recorded tasks), and every few hundred allocations the collector
    walks the young heap, and now and then the whole of it, which inside dynamo's compile holds the
    traced model too (a third of the passes' time on a 64-layer model). What they make is not
    garbage; anything that is gets collected once the collector resumes."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
