"""Where start-up time goes (issue 48, item 3): seconds per phase of the compile under way.

On a device, start-up is mostly captures (vLLM-Ascend's users report 1.2-3.3 s per ACL graph), and the
rest is spread over work no log names: dynamo's trace, the passes, the device probes (workspace
queries), the kernel timing of `kernel_policy="auto"`, the graph-memory estimate. Each such piece of
work is marked with `timed(phase)`; while a compile runs (`recording`), its seconds go to that compile's
ledger, and always to the process's (`PROCESS`: an estimate a runtime asks for after the compile is
counted there). A phase timed inside another is taken out of the outer one, so the phases add up to
the wall time. The bottom of the package, like `errors.py`: every layer may mark its work.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import time
from typing import Any, Callable, Iterator, TypeVar

#: The phases of a compile, in the order they run (captures are timed per graph by the runner).
PHASES = ("dynamo_trace", "passes", "probes", "kernel_timing", "memory_estimate")

#: Every phase's seconds in this process.
PROCESS: collections.Counter = collections.Counter()
_ACTIVE: list[collections.Counter] = []  # the ledgers of the compiles under way, innermost last
_OPEN: list[list[float]] = []  # per timed block under way: the seconds of the blocks timed inside it

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def recording(ledger: collections.Counter) -> Iterator[collections.Counter]:
    """Send the seconds of the work timed in this block to `ledger` too."""
    _ACTIVE.append(ledger)
    try:
        yield ledger
    finally:
        _ACTIVE.pop()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the block's seconds, less those of the blocks timed inside it, as phase `name`."""
    _OPEN.append([0.0])
    start = time.perf_counter()
    try:
        yield
    finally:
        total = time.perf_counter() - start
        inner = _OPEN.pop()[0]
        if _OPEN:
            _OPEN[-1][0] += total
        add(name, total - inner)


def add(name: str, seconds: float) -> None:
    """Count `seconds` of phase `name` (to the compile under way, if any, and the process)."""
    PROCESS[name] += seconds
    if _ACTIVE:
        _ACTIVE[-1][name] += seconds


def timed(name: str) -> Callable[[F], F]:
    """A decorator: each call of the function is phase `name` (`phase`)."""
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with phase(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


class DynamoClock:
    """When dynamo began compiling the frame under way, from its start callback (torch >= 2.4 calls
    `torch._dynamo.callback.callback_handler`'s start callbacks before it traces a frame): the seconds
    from there to the backend's call are dynamo's trace."""

    started: float | None = None

    @classmethod
    def install(cls) -> None:
        """Register the start callback where it is not (`torch._dynamo.reset()` clears the callbacks)."""
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:  # an older torch: dynamo's trace not timed
            return
        if cls._start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(cls._start)

    @classmethod
    def _start(cls, *args: Any) -> None:
        cls.started = time.perf_counter()

    @classmethod
    def trace_seconds(cls) -> float | None:
        """Seconds since dynamo began the frame now calling the backend (None: not known)."""
        return None if cls.started is None else time.perf_counter() - cls.started
