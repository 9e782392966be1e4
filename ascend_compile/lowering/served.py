"""Which compiled artifact served a call through dynamo, and with what.

The direct dispatcher (`ascend_compile.dispatch`) sends a call through dynamo with a probe set on
this thread; the artifact dynamo runs reports itself, the arguments dynamo gathered for it and what
it returned. From that the dispatcher learns how to call the artifact without dynamo, and checks
what it learnt against what dynamo did.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator, Sequence

_local = threading.local()


@dataclasses.dataclass(frozen=True)
class Served:
    """One call of an artifact: the artifact, the arguments it was given and its result."""

    artifact: Any
    args: Sequence[Any]
    result: Any


@contextlib.contextmanager
def probe() -> Iterator[list[Served]]:
    """The calls artifacts report inside the block, in order (probes nest: each sees every call)."""
    calls: list[Served] = []
    outer = getattr(_local, "probes", ())
    _local.probes = (*outer, calls)
    try:
        yield calls
    finally:
        _local.probes = outer


@contextlib.contextmanager
def unreported() -> Iterator[None]:
    """Calls inside the block are not reported: a wrapper that dynamo calls in the artifact's place
    (the vLLM integration's deferred compile) reports itself instead, since the direct dispatcher
    must call what dynamo calls, with whatever checks that wrapper makes."""
    outer = getattr(_local, "silent", False)
    _local.silent = True
    try:
        yield
    finally:
        _local.silent = outer


def report(artifact: Any, args: Sequence[Any], result: Any) -> None:
    """An artifact was called (a no-op unless a probe is set on this thread, outside `unreported`)."""
    probes = getattr(_local, "probes", ())
    if probes and not getattr(_local, "silent", False):
        served = Served(artifact, args, result)
        for calls in probes:
            calls.append(served)
