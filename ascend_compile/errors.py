"""Exceptions shared by every layer.

They live at the bottom of the package so that the simulator (runtime/) can react to a kernel's
workspace error without importing the op library above it.
"""
from __future__ import annotations


class AscendCompileError(RuntimeError):
    """Base class of every error this package raises on purpose."""


class WorkspaceTooSmall(AscendCompileError):
    """A kernel was handed less workspace than its host-side tiling needs.

    Raised before the kernel writes anything, so a caller (the simulator emulating a device
    overrun) may retry it with a larger view of the same memory.
    """

    def __init__(self, kernel: str, needed: int, given: int, arg_name: str = "workspace") -> None:
        self.kernel = kernel
        self.needed = needed
        self.given = given
        self.arg_name = arg_name
        super().__init__(
            f"{kernel}: workspace too small: needs {needed} bytes for these sequence lengths, "
            f"given {given} bytes (argument '{arg_name}')"
        )


class CaptureError(AscendCompileError):
    """Something was done during graph capture that a device graph cannot record."""


class HostSync(CaptureError):
    """Device data read on the host (`.item()`, `.tolist()`, a data-dependent output shape) during a
    capture or a task update: a device graph records launches and cannot record a host read."""


class UncapturableOp(CaptureError):
    """An op of the graph (not one of the attention kernels) failed inside the capture though it runs
    eagerly, e.g. a custom op whose Python reads device data on the host: the graph cannot be captured,
    so the runner serves its steps eagerly. `node` and `op` name it; `cause` is the capture's error."""

    def __init__(self, node: str, op: object, cause: BaseException) -> None:
        self.node = node
        self.op = op
        self.cause = cause
        super().__init__(f"{op} (node {node}) cannot be captured: {cause}")


class ReplayError(AscendCompileError):
    """A captured graph could not be replayed as recorded (e.g. an event never recorded)."""


class TaskUpdateMismatch(AscendCompileError):
    """A task update issued other ops than the task group it replaces."""


class StreamRace(ReplayError):
    """Two accesses to one captured task that no event orders: a task update and a kernel reading the
    arguments it rewrites. On a device the kernel would run with the old or the new arguments."""
