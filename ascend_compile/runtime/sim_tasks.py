"""Tasks of the ACL-graph simulator (`runtime/sim.py`): what a capture records and a replay runs.

A task is one kernel launch with its operands as simulated addresses (`_MemRef`) and frozen host
values, or one event action. Also here: how the simulator classifies ops (views, host syncs,
allocations, functional collectives), since capture and task updates both need it, and how a
captured graph's tasks become the items a replay queues on its stream (`_program`).
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.utils._pytree as pytree

from ..errors import ReplayError
from .sim_pool import Segment
from .sim_streams import EventState, RecordWork, ResetWork, SimStream, TaskAccess, WaitWork, Work

if TYPE_CHECKING:
    from .sim import SimRuntime

_aten = torch.ops.aten

#: Ops whose output shape depends on tensor data: a device must synchronise with the host to run them.
_DATA_DEPENDENT_SHAPE = frozenset(
    {_aten.nonzero, _aten.masked_select, _aten._unique, _aten._unique2, _aten.unique_consecutive, _aten.unique_dim}
)
#: Ops that only allocate: on a device they launch no kernel, so capture records no task for them.
_ALLOCATION_OPS = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_strided.default,
        _aten.empty_like.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
    }
)
#: Tensor methods that copy device data to the host without going through an aten op.
_HOST_READ_METHODS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy})
#: Namespace of the functional collectives, and the op that waits for one to complete.
_COLLECTIVES = "_c10d_functional"
_WAIT_TENSOR = "_c10d_functional::wait_tensor"


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def _is_view(func: torch._ops.OpOverload) -> bool:
    """True for ops that only make a new tensor over existing memory: no kernel, no task."""
    if torch.Tag.inplace_view in func.tags:
        return True
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _syncs_host(func: torch._ops.OpOverload) -> bool:
    """True for ops a device graph cannot capture because the host must read device data."""
    return torch.Tag.data_dependent_output in func.tags or func.overloadpacket in _DATA_DEPENDENT_SHAPE


def _is_wait(func: torch._ops.OpOverload) -> bool:
    """True for `wait_tensor`, after which a functional collective's output may be read."""
    return func._schema.name == _WAIT_TENSOR


def _completes_at_wait(func: torch._ops.OpOverload) -> bool:
    """True for a functional collective: it returns before its work is done, and c10d keys that work
    by the output's storage, so the output is written, and may be read, only once it is waited on."""
    return func.namespace == _COLLECTIVES and not _is_wait(func)


def _aliases_inputs(result: Any, args: Any, kwargs: Any) -> bool:
    """True when every tensor `result` holds shares storage with a tensor operand."""
    inputs = {_storage_id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return all(_storage_id(t) in inputs for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor))


def _is_cpu_dense(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.layout == torch.strided


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _MemRef:
    """Where a tensor operand of a task lives in simulated memory: what a task stores instead of it."""

    __slots__ = ("segment", "offset", "dtype", "shape", "stride")

    def __init__(
        self, segment: Segment, offset: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]
    ) -> None:
        self.segment = segment
        self.offset = offset
        self.dtype = dtype
        self.shape = shape
        self.stride = stride

    def resolve(self) -> torch.Tensor:
        """A tensor at this address that does not own the memory (the graph uses it, it doesn't own it)."""
        return self.segment.view(self.offset, self.dtype, self.shape, self.stride)

    def __repr__(self) -> str:
        return f"<{self.segment.pool.name}#{self.segment.index}+{self.offset:#x} {self.dtype} {list(self.shape)}>"


class _HostRef:
    """A host tensor a task reads when it runs, held weakly: the device keeps its address, not it."""

    __slots__ = ("ref", "name")

    def __init__(self, tensor: torch.Tensor, name: str) -> None:
        self.ref = weakref.ref(tensor)
        self.name = name

    def resolve(self) -> torch.Tensor:
        tensor = self.ref()
        if tensor is None:
            raise ReplayError(
                f"{self.name}: the host tensor this task reads when it runs was freed before it ran; keep it "
                f"alive until the device has run the task (until the next synchronize, or for the graph's life)"
            )
        return tensor

    def __repr__(self) -> str:
        return f"<host tensor {self.name}>"


def _resolve(x: Any) -> Any:
    return x.resolve() if isinstance(x, (_MemRef, _HostRef)) else x


def _arg(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> tuple[Any, Any]:
    """(key, value) of argument `name` of a call of `op`: its position in `args`, or its keyword."""
    if name in kwargs:
        return name, kwargs[name]
    names = [a.name for a in op._schema.arguments]
    index = names.index(name)
    return (index, args[index]) if index < len(args) else (None, None)


def _all_zero(lengths: Any) -> bool:
    """Whether a host length argument (a list of ints or a host tensor) holds only zeros."""
    if isinstance(lengths, torch.Tensor):
        return not bool(torch.count_nonzero(lengths))
    return not any(lengths or ())


class _OpTask:
    """One recorded kernel launch: the op and its operands as addresses and frozen host values.

    A task inside a task group can be updated; its `access` then tracks the updates that rewrite its
    operands and the replays that read them, so that an unordered pair is reported as a race."""

    __slots__ = ("op", "kind", "label", "args", "kwargs", "fresh", "access", "_bound")

    def __init__(
        self,
        op: torch._ops.OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        fresh: list[tuple[int, _MemRef]],
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

    def writes(self) -> list[_MemRef]:
        """The simulated memory this task writes: operands its schema marks as written."""
        written = []
        for i, arg in enumerate(self.op._schema.arguments):
            info = arg.alias_info
            if info is not None and info.is_write:
                value = self.kwargs.get(arg.name, self.args[i] if i < len(self.args) else None)
                written.extend(v for v in pytree.tree_leaves(value) if isinstance(v, _MemRef))
        return written

    def reads(self) -> list[_MemRef]:
        """Every simulated-memory operand of the task."""
        return [v for v in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(v, _MemRef)]

    def run(self, runtime: SimRuntime, stream: SimStream) -> None:
        """Execute the task at its recorded addresses on `stream`; fresh outputs land where they
        were captured."""
        if self.access is not None:
            self.access.read(stream, self.label)
        if self._bound is None:
            args, kwargs = pytree.tree_map(_resolve, (self.args, self.kwargs))
            self._bound = (args, kwargs, [(i, ref.resolve()) for i, ref in self.fresh])
        args, kwargs, outs = self._bound
        result = runtime._launch(self.op, args, kwargs, self.label)
        if outs:
            flat = [result] if isinstance(result, torch.Tensor) else pytree.tree_leaves(result)
            for i, dst in outs:
                runtime._in_flight.deliver(self.op, flat[i], dst)


#: The stream item each event action of a graph becomes when the graph is launched.
_EVENT_WORK = {"wait": WaitWork, "reset": ResetWork, "record": RecordWork}


class _EventTask:
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


_Task = Union[_OpTask, _EventTask]

#: A stream item of a replay: one event action, or a run of op tasks between two.
_Item = Union[list[_OpTask], _EventTask]


def _program(tasks: list[_Task]) -> list[_Item]:
    """The tasks as stream items: each event action alone, the op tasks between them together
    (nothing can order anything inside such a run, so running it as one item loses no race)."""
    program: list[_Item] = []
    for task in tasks:
        if isinstance(task, _EventTask):
            program.append(task)
        elif program and isinstance(program[-1], list):
            program[-1].append(task)
        else:
            program.append([task])
    return program
