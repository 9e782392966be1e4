"""What the ACL-graph simulator knows of a device's kernels, beyond their arguments.

Some kernels launch other work depending on their host arguments (a zero-length fast path), and
some read host tensors when their task runs. A runtime declares these per op packet; capture and
task updates then name tasks (`task_kind`) and freeze operands the same way, which is what lets a
task update be matched against the group it replaces.
"""
from __future__ import annotations

from typing import Any

from .classify import all_zero, arg


class DeviceKernels:
    """The kernel facts a runtime declared: zero-length fast paths, host tensors read at run time."""

    def __init__(self) -> None:
        self.fast_paths: dict[Any, str] = {}
        self.host_reads: dict[Any, tuple[str, ...]] = {}

    def task_kind(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The kind of task a call of `op` launches: its name, marked when its zero-length fast path
        is taken."""
        lengths = self.fast_paths.get(op.overloadpacket)
        if lengths is not None and all_zero(arg(op, args, kwargs, lengths)[1]):
            return f"{op}[all lengths 0]"
        return str(op)

    def host_read_args(self, op: Any) -> tuple[str, ...]:
        """The arguments of `op` its task reads on the host when it runs."""
        return self.host_reads.get(op.overloadpacket, ())
