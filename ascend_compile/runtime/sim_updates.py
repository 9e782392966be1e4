"""Task groups and task updates of the ACL-graph simulator (`runtime/sim.py`).

A capture may enclose tasks in a group (`task_group_begin` / `task_group_end`); the group's handle
(`SimTaskHandle`) is what a later task update names. The update is recorded on the host
(`sim_dispatch._UpdateMode`), checked against the group in `SimRuntime.task_update_end`, and queued
on a stream; `_land` is what happens when the device reaches it: each task takes its new operands,
and the access tracking of `sim_streams` sees the write (so an unordered replay is a race). Its own
module so that the lifetime of a group, from capture to every update, reads in one place.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import TaskHandle
from .sim_streams import SimStream
from .sim_tasks import _EventTask, _Task

if TYPE_CHECKING:
    from .sim import SimGraph


class SimTaskHandle(TaskHandle):
    """The tasks one `task_group_begin` / `task_group_end` pair enclosed, for later task updates."""

    def __init__(self, graph: SimGraph, index: int, tasks: tuple[_Task, ...]) -> None:
        self.graph = graph
        self.index = index
        self._tasks = tasks

    @property
    def tasks(self) -> tuple[str, ...]:
        """The kinds of the grouped tasks (op names), which an update must issue again in order."""
        return tuple(t.kind for t in self._tasks)

    def __repr__(self) -> str:
        return f"SimTaskHandle({self.graph.name} group {self.index}: {list(self.tasks)})"


def _waited_node(tasks: list[_Task]) -> str:
    """" (node X)" when `tasks` (those just before a task group) wait on event X, the FX node's name."""
    waits = [t.event.name for t in tasks if isinstance(t, _EventTask) and t.action == "wait"]
    return f" (node {waits[-1]})" if waits else ""


def _land(handle: SimTaskHandle, recorded: list[tuple[Any, str, tuple, dict]], label: str, stream: SimStream) -> None:
    """A task update reaching the device: each task of the group takes its new operands."""
    for task, (_, _, args, kwargs) in zip(handle._tasks, recorded):
        task.access.update(stream, label)
        task.rebind(args, kwargs)
    handle.graph._inputs = None
