"""Task groups and task updates of the ACL-graph simulator.

A capture may enclose tasks in a group (`task_group_begin` / `task_group_end`); the group's handle
(`SimTaskHandle`) is what a later task update names. The update is recorded on the host
(`dispatch.UpdateMode`), checked against the group by the runtime, and queued on a stream; `land`
is what happens when the device reaches it: each task takes its new operands, and the access
tracking of `streams` sees the write (so an unordered replay is a race). Its own module so that the
lifetime of a group, from capture to every update, reads in one place.
"""
from __future__ import annotations

from ..base import TaskHandle
from .streams import SimStream
from .tasks import EventTask, IssuedOp, OpTask, Recording, Task


class SimTaskHandle(TaskHandle):
    """The tasks one `task_group_begin` / `task_group_end` pair enclosed, for later task updates;
    `owner` is the runtime that captured them."""

    def __init__(self, recording: Recording, index: int, tasks: tuple[Task, ...], owner: object) -> None:
        self.recording = recording
        self.index = index
        self.group = tasks
        self.owner = owner

    @property
    def tasks(self) -> tuple[str, ...]:
        """The kinds of the grouped tasks (op names), which an update must issue again in order."""
        return tuple(t.kind for t in self.group)

    def matches(self, issued: list[IssuedOp]) -> bool:
        """Whether an update issued the group's ops again, one for one, with the same kinds."""
        return len(issued) == len(self.group) and all(
            isinstance(t, OpTask) and t.op is i.op and t.kind == i.kind for t, i in zip(self.group, issued)
        )

    def __repr__(self) -> str:
        return f"SimTaskHandle({self.recording.name} group {self.index}: {list(self.tasks)})"


def waited_node(tasks: list[Task]) -> str:
    """" (node X)" when `tasks` (those just before a task group) wait on event X, the FX node's name."""
    waits = [t.event.name for t in tasks if isinstance(t, EventTask) and t.action == "wait"]
    return f" (node {waits[-1]})" if waits else ""


def land(handle: SimTaskHandle, issued: list[IssuedOp], label: str, stream: SimStream) -> None:
    """A task update reaching the device: each task of the group takes its new operands."""
    for task, op in zip(handle.group, issued):
        task.access.update(stream, label)
        task.rebind(op.args, op.kwargs)
    handle.recording.static_inputs = None
