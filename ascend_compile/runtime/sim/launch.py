"""One kernel launch on the ACL-graph simulator: what the device does when it runs a task.

Capture runs each recorded op once and a replay runs its tasks again; both go through `Launcher`,
so the two behave alike: a `wait_tensor` first completes the collective in flight to its operand,
and a kernel short of workspace overruns it into its neighbours (`overrun.py`) or raises, by the
runtime's `overflow` option; a c10d collective (`dist.all_reduce`'s `c10d.allreduce_`) completes
before the next task, as a collective issued on the stream does. Its own module so that tasks can
run without knowing the runtime.
"""
from __future__ import annotations

from typing import Any

from ...errors import CaptureError, ReplayError, WorkspaceTooSmall
import torch
import torch.utils._pytree as pytree

from .classify import completes_at_wait, is_c10d_collective, is_wait
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
        if capturing and completes_at_wait(op):
            return uncommunicated(op, args, kwargs)
        try:
            return wait_work(op, op(*args, **kwargs))
        except WorkspaceTooSmall as err:
            if self.overflow == "raise":
                err.args = (f"{err.args[0]} [in {label}]",)
                raise
            error = CaptureError if capturing else ReplayError
            args, kwargs = widen_workspace(op, args, kwargs, err, label, self.memory.locate, error)
        return wait_work(op, op(*args, **kwargs))


def uncommunicated(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A functional collective inside a capture: its outputs (shaped by its meta kernel), holding nothing.
    A device's capture records the collective and runs it at each replay only (docs/tensor_parallel.md
    quotes NCCL's and HCCL's graph-capture docs); running it at capture too would pair it with another
    rank's call, which that rank does not make where its device refused the capture (`faults.py`)."""
    meta = op(*pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), args), **kwargs)
    return pytree.tree_map_only(torch.Tensor, lambda m: torch.empty(m.shape, dtype=m.dtype), meta)


def wait_work(op: Any, result: Any) -> Any:
    """`result`, once the work a c10d collective returned with it is done: on the device the
    collective runs on the stream, in order, so the next task reads its result. `dist.all_reduce`
    waits too, but only on its own call, never on a replay's."""
    if is_c10d_collective(op):
        for leaf in pytree.tree_leaves(result):
            if isinstance(leaf, torch.ScriptObject):
                torch._C._distributed_c10d.Work.unbox(leaf).wait()
    return result
