"""Tasks of the ACL-graph simulator: what a capture records and a replay runs.

A task is one kernel launch with its operands as simulated addresses (`MemRef`) and frozen host
values, or one event action. A graph's tasks are its `Recording`; `program` turns them into the
items a replay queues on its stream, and `IssuedOp` is one op a task update issued, not yet landed.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import torch
import torch.utils._pytree as pytree

from .launch import Launcher
from .memory import MemRef
from .pool import Region
from .streams import EventState, RecordWork, ResetWork, SimStream, TaskAccess, WaitWork, Work


def _resolve(x: Any) -> Any:
    return x.resolve() if isinstance(x, MemRef) else x


class OpTask:
    """One recorded kernel launch: the op and its operands as addresses and frozen host values.

    A task inside a task group can be updated; its `access` then tracks the updates that rewrite its
    operands and the replays that read them, so that an unordered pair is reported as a race."""

    __slots__ = ("op", "kind", "label", "args", "kwargs", "fresh", "access", "_bound")

    def __init__(
        self,
        op: torch._ops.OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        fresh: list[tuple[int, MemRef]],
        label: str,
        kind: str,
    ) -> None:
        self.op = op
        self.kind = kind
        self.label = label
        self.fresh = fresh
        self.access: Optional[TaskAccess] = None
        self.rebind(args, kwargs)

    def rebind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Replace the operands (a task update landing); they are resolved again at the next run."""
        self.args = args
        self.kwargs = kwargs
        self._bound: Optional[tuple[tuple[Any, ...], dict[str, Any], list[tuple[int, torch.Tensor]]]] = None

    def writes(self) -> list[MemRef]:
        """The simulated memory this task writes: operands its schema marks as written."""
        written = []
        for i, argument in enumerate(self.op._schema.arguments):
            info = argument.alias_info
            if info is not None and info.is_write:
                value = self.kwargs.get(argument.name, self.args[i] if i < len(self.args) else None)
                written.extend(v for v in pytree.tree_leaves(value) if isinstance(v, MemRef))
        return written

    def reads(self) -> list[MemRef]:
        """Every simulated-memory operand of the task."""
        return [v for v in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(v, MemRef)]

    def run(self, launcher: Launcher, stream: SimStream) -> None:
        """Execute the task at its recorded addresses on `stream`; fresh outputs land where they
        were captured."""
        if self.access is not None:
            self.access.read(stream, self.label)
        if self._bound is None:
            args, kwargs = pytree.tree_map(_resolve, (self.args, self.kwargs))
            self._bound = (args, kwargs, [(i, ref.resolve()) for i, ref in self.fresh])
        args, kwargs, outs = self._bound
        result = launcher.launch(self.op, args, kwargs, self.label, capturing=False)
        if outs:
            flat = [result] if isinstance(result, torch.Tensor) else pytree.tree_leaves(result)
            for i, dst in outs:
                launcher.in_flight.deliver(self.op, flat[i], dst)


#: The stream item each event action of a graph becomes when the graph is launched.
_EVENT_WORK = {"wait": WaitWork, "reset": ResetWork, "record": RecordWork}


class EventTask:
    """A recorded wait on, record of, or reset of an event; at replay, an item of the replay's stream."""

    __slots__ = ("event", "action", "kind", "label")

    def __init__(self, event: EventState, action: str, label: str) -> None:
        self.event = event
        self.action = action
        self.kind = f"event.{action}:{event.name}"
        self.label = label

    def work(self) -> Work:
        """The stream item that performs this action when the replay reaches it."""
        return _EVENT_WORK[self.action](f"{self.label} ({self.kind})", self.event)


Task = Union[OpTask, EventTask]

#: A stream item of a replay: one event action, or a run of op tasks between two.
Item = Union[list[OpTask], EventTask]


class IssuedOp(NamedTuple):
    """One op a task update issued: the op, its task kind and its frozen operands."""

    op: torch._ops.OpOverload
    kind: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class Recording:
    """What the capture of one graph recorded: its tasks in order, how many task groups they hold,
    and (computed on demand, dropped when an update lands) the static inputs its replays read."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tasks: list[Task] = []
        self.groups = 0
        self.static_inputs: Optional[dict[Region, str]] = None

    def label(self) -> str:
        """The label of the next task recorded."""
        return f"{self.name} task {len(self.tasks)}"


def program(tasks: list[Task]) -> list[Item]:
    """The tasks as stream items: each event action alone, the op tasks between them together
    (nothing can order anything inside such a run, so running it as one item loses no race)."""
    items: list[Item] = []
    for task in tasks:
        if isinstance(task, EventTask):
            items.append(task)
        elif items and isinstance(items[-1], list):
            items[-1].append(task)
        else:
            items.append([task])
    return items
