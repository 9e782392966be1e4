"""One kernel launch on the ACL-graph simulator: what the device does when it runs a task.

Capture runs each recorded op once and a replay runs its tasks again; both go through `Launcher`,
so the two behave alike: a `wait_tensor` first completes the collective in flight to its operand,
and a kernel short of workspace overruns it into its neighbours (`overrun.py`) or raises, by the
runtime's `overflow` option. Its own module so that tasks can run without knowing the runtime.
"""
from __future__ import annotations

from typing import Any

from ...errors import CaptureError, ReplayError, WorkspaceTooSmall
from .classify import is_wait
from .collectives import InFlight
from .memory import SimMemory
from .overrun import widen_workspace

#: What a kernel short of workspace may do.
OVERFLOW_MODES = ("write", "raise")


class Launcher:
    """Runs ops as the simulated device: `overflow` "write" overruns a short workspace, as the
    device does, "raise" re-raises its `WorkspaceTooSmall`; `in_flight` holds collectives' outputs."""

    def __init__(self, memory: SimMemory, overflow: str) -> None:
        if overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be 'write' or 'raise', got {overflow!r}")
        self.memory = memory
        self.overflow = overflow
        self.in_flight = InFlight()

    def launch(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], label: str, capturing: bool) -> Any:
        """Call `op` (during a capture when `capturing`, else in a replay); a `WorkspaceTooSmall`
        becomes an overrun of the workspace (or is re-raised)."""
        if is_wait(op):
            self.in_flight.complete(args[0] if args else kwargs["tensor"])
        try:
            return op(*args, **kwargs)
        except WorkspaceTooSmall as err:
            if self.overflow == "raise":
                err.args = (f"{err.args[0]} [in {label}]",)
                raise
            error = CaptureError if capturing else ReplayError
            args, kwargs = widen_workspace(op, args, kwargs, err, label, self.memory.locate, error)
        return op(*args, **kwargs)
