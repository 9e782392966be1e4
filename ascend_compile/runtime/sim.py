"""The ACL-graph simulator: a device-graph runtime on the CPU that behaves like the device.

It is the default runtime on CPU and the test bed for the passes, the lowering and the runner
(DESIGN.md §5), so it must fail where an Ascend ACL graph (or a CUDA graph) fails instead of
quietly computing the eager answer:

- capture records ops as **tasks** (a `TorchDispatchMode`); their operands are memory addresses, and
  everything allocated during a capture is poisoned (0xFF bytes: NaN, -1) when it ends, so nothing
  can depend on capture-time values;
- memory comes from simulated device pools with addresses (`sim_pool.py`): a block freed during a
  capture is handed to a later allocation of that capture or of a later one;
- host arguments (lists of ints) are frozen at capture; only a task update changes them, and it must
  issue the same ops as the task group it replaces;
- a kernel short of workspace writes past it into its neighbours (or raises, by option);
- a replay waiting on an external event that was never recorded raises instead of hanging;
- a kernel with a zero-length fast path (`SimRuntime.zero_length_fast_path`; by default the ascend
  PA and FIA) called with every length 0 launches another task than with real lengths, so a task
  captured that way cannot be updated to real lengths (the update is refused);
- host tensors a kernel reads when its task runs (`SimRuntime.reads_on_host`, e.g. ATB's CPU
  `context_lens`) are held weakly by the task, as the device holds only their address: one freed
  before the task runs is an error;
- an op that sets itself up on its first call (`SimRuntime.first_call`) may not make that call
  inside a capture;
- host reads of device data during capture (`.item()`, `.tolist()`, data-dependent shapes) raise;
- a functional collective (`_c10d_functional`) is issued again by every replay, in captured order,
  and its output reaches its captured address only once its work completes: at the graph's
  `wait_tensor` of it, or at the end of the graph.

Replay is asynchronous: `SimGraph.replay` launches, `SimRuntime.synchronize` runs every launched
replay in order. Task updates and event records issued in between therefore reach that replay, as
the graph's event wait guarantees on the device.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterator, Optional, Union

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..errors import AscendCompileError, CaptureError, ReplayError, TaskUpdateMismatch, WorkspaceTooSmall
from .base import DeviceGraph, ExternalEvent, Runtime, TaskHandle
from .sim_pool import Segment, SimPool, extent_bytes

logger = logging.getLogger("ascend_compile.sim")

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
    """One recorded kernel launch: the op and its operands as addresses and frozen host values."""

    __slots__ = ("op", "kind", "label", "args", "kwargs", "fresh", "_bound")

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
        self.rebind(args, kwargs)

    def rebind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Replace the operands (a task update); they are resolved again at the next run."""
        self.args = args
        self.kwargs = kwargs
        self._bound: Optional[tuple[tuple[Any, ...], dict[str, Any], list[tuple[int, torch.Tensor]]]] = None

    def run(self, runtime: SimRuntime) -> None:
        """Execute the task at its recorded addresses; fresh outputs land where they were captured."""
        if self._bound is None:
            args, kwargs = pytree.tree_map(_resolve, (self.args, self.kwargs))
            self._bound = (args, kwargs, [(i, ref.resolve()) for i, ref in self.fresh])
        args, kwargs, outs = self._bound
        result = runtime._launch(self.op, args, kwargs, self.label)
        if outs:
            flat = [result] if isinstance(result, torch.Tensor) else pytree.tree_leaves(result)
            for i, dst in outs:
                runtime._deliver(self.op, flat[i], dst)


class _EventTask:
    """A recorded wait on, record of, or reset of an external event."""

    __slots__ = ("event", "action", "kind", "label")

    def __init__(self, event: SimEvent, action: str, label: str) -> None:
        self.event = event
        self.action = action
        self.kind = f"event.{action}:{event.name}"
        self.label = label

    def run(self, runtime: SimRuntime) -> None:
        """Apply the event action as the device would when the graph reaches it."""
        self.event._apply(self.action, self.label)


_Task = Union[_OpTask, _EventTask]


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


class SimEvent(ExternalEvent):
    """An external event; `name` (the FX node's name) is what errors report.

    Inside capture each call records a task; outside capture it takes effect at once. A recorded
    wait whose event is not set when the replay reaches it raises `ReplayError` (the device hangs).
    """

    def __init__(self, runtime: SimRuntime, name: str) -> None:
        self._runtime = runtime
        self.name = name
        self._recorded = False

    @property
    def recorded(self) -> bool:
        """Whether the event is set (recorded and not reset since)."""
        return self._recorded

    def wait(self) -> None:
        """Inside capture: the graph waits here at replay until the event is recorded."""
        self._runtime._event_action(self, "wait")

    def reset(self) -> None:
        """Inside capture: clear the event, so the next replay needs a fresh `record`."""
        self._runtime._event_action(self, "reset")

    def record(self) -> None:
        """Outside capture: set the event, releasing the wait of the next replay to run."""
        self._runtime._event_action(self, "record")

    def _apply(self, action: str, where: str) -> None:
        if action == "record":
            self._recorded = True
        elif action == "reset":
            self._recorded = False
        elif not self._recorded:
            raise ReplayError(
                f"{where}: waits on external event {self.name!r}, which was never recorded for this "
                f"replay (on a device the graph would hang here); record it after the task update "
                f"and before synchronize()"
            )

    def __repr__(self) -> str:
        return f"SimEvent({self.name!r}, recorded={self._recorded})"


class SimGraph(DeviceGraph):
    """A graph captured on the simulator: a list of tasks replayed at fixed addresses."""

    def __init__(self, runtime: SimRuntime, name: str) -> None:
        self._runtime = runtime
        self.name = name
        self._tasks: list[_Task] = []
        self._groups = 0
        self._captured = False

    @property
    def tasks(self) -> tuple[str, ...]:
        """The kind of every recorded task, in order: `str(op)` (e.g. "aten.mm.default") or
        "event.<wait|reset|record>:<name>"."""
        return tuple(t.kind for t in self._tasks)

    @property
    def captured(self) -> bool:
        """Whether a capture of this graph completed."""
        return self._captured

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the ops issued in this context (they also run once, on the real tensors).

        Replays still pending are run first. Fresh outputs are placed in the runtime's graph pool;
        when the context ends, every block allocated during it is poisoned.
        """
        rt = self._runtime
        rt._begin_capture(self)
        try:
            with _HostReadGuard(), _CaptureMode(rt, self):
                yield
        finally:
            group_open = rt._end_capture(self)
        if group_open:
            raise CaptureError(f"capture of {self.name} ended inside a task group: call task_group_end()")
        self._captured = True

    def replay(self) -> None:
        """Launch the graph; it runs at the next `SimRuntime.synchronize`."""
        if not self._captured:
            raise ReplayError(f"{self.name} cannot be replayed: it was never captured (or its capture failed)")
        if self._runtime._capturing is not None:
            raise ReplayError(f"cannot replay {self.name} while {self._runtime._capturing.name} is being captured")
        self._runtime._pending.append(self)

    def _execute(self) -> None:
        for task in self._tasks:
            task.run(self._runtime)
        self._runtime._complete_all()

    def __repr__(self) -> str:
        return f"SimGraph({self.name!r}, {len(self._tasks)} tasks, captured={self._captured})"


class _HostReadGuard(TorchFunctionMode):
    """During capture, refuses tensor-to-host conversions that bypass the dispatcher (`tolist`)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _HOST_READ_METHODS:
            raise CaptureError(
                f"Tensor.{func.__name__}() during graph capture: a device graph cannot copy device data "
                f"to the host; do host conversions before capture (or before the task update)"
            )
        return func(*args, **(kwargs or {}))


class _CaptureMode(TorchDispatchMode):
    """Runs each op once and records it as a task of `graph`, with fresh outputs in the graph pool."""

    def __init__(self, runtime: SimRuntime, graph: SimGraph) -> None:
        super().__init__()
        self.runtime = runtime
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rt = self.runtime
        if func in _ALLOCATION_OPS:
            return pytree.tree_map_only(torch.Tensor, rt._graph_tensor_like, func(*args, **kwargs))
        if _syncs_host(func) and any(
            rt._locate(t) is not None for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        ):
            raise CaptureError(
                f"{func} during graph capture reads device data on the host (.item(), bool(tensor), "
                f"a data-dependent output shape, ...); a device graph cannot record a host "
                f"synchronisation: move it out of the captured region"
            )
        if _is_view(func):
            result = func(*args, **kwargs)
            if _aliases_inputs(result, args, kwargs):
                return result
            # A "maybe view" op (reshape, contiguous, ... seen whole under inference mode) that
            # copied: it launches a kernel, so it is recorded like any other op.
        label = f"{self.graph.name} task {len(self.graph._tasks)} ({func})"
        frozen_args, frozen_kwargs = rt._record_operands(func, args, kwargs)
        kind = rt._task_kind(func, args, kwargs)
        result = rt._launch(func, args, kwargs, label)
        inputs = {_storage_id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        flat, spec = pytree.tree_flatten(result)
        fresh = []
        for i, out in enumerate(flat):
            if _is_cpu_dense(out) and _storage_id(out) not in inputs:
                flat[i] = rt._graph_tensor_like(out)
                rt._deliver(func, out, flat[i])
                fresh.append((i, rt._describe(flat[i])))
        self.graph._tasks.append(_OpTask(func, frozen_args, frozen_kwargs, fresh, label, kind))
        return pytree.tree_unflatten(flat, spec)


class _UpdateMode(TorchDispatchMode):
    """Records the ops of a task update instead of running them."""

    def __init__(self, runtime: SimRuntime, handle: SimTaskHandle) -> None:
        super().__init__()
        self.runtime = runtime
        self.handle = handle
        self.recorded: list[tuple[Any, str, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_view(func):
            return func(*args, **kwargs)
        frozen_args, frozen_kwargs = self.runtime._record_operands(func, args, kwargs)
        self.recorded.append((func, self.runtime._task_kind(func, args, kwargs), frozen_args, frozen_kwargs))
        if not func._schema.returns:
            return None
        meta_args, meta_kwargs = pytree.tree_map_only(
            torch.Tensor,
            lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"),
            (args, kwargs),
        )
        return pytree.tree_map_only(
            torch.Tensor,
            lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu"),
            func(*meta_args, **meta_kwargs),
        )


class SimRuntime(Runtime):
    """The ACL-graph simulator (see the module docstring for the device rules it enforces).

    `segment_bytes`: size of each simulated memory segment (a larger request gets its own).
    `overflow`: what a kernel short of workspace does: "write" past its buffer, as the device
    does, or "raise" its `WorkspaceTooSmall`.
    """

    name = "sim"
    supports_graphs = True
    needs_task_updates = True

    def __init__(self, segment_bytes: int = 64 << 20, overflow: str = "write") -> None:
        if overflow not in ("write", "raise"):
            raise ValueError(f"overflow must be 'write' or 'raise', got {overflow!r}")
        self.overflow = overflow
        self._general = SimPool("general", segment_bytes)
        self._graph_pool = SimPool("graph", segment_bytes)
        self._capturing: Optional[SimGraph] = None
        self._group_start: Optional[int] = None
        self._captured_blocks: list[tuple[Segment, int, int]] = []
        self._update: Optional[_UpdateMode] = None
        self._pending: list[SimGraph] = []
        self._in_flight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._graph_count = 0
        self._fast_paths: dict[Any, str] = {}
        self._host_reads: dict[Any, tuple[str, ...]] = {}
        self._set_up: set[str] = set()
        self.zero_length_fast_path(torch.ops.ascend.paged_attention, "context_lens")
        self.zero_length_fast_path(torch.ops.ascend.fused_infer_attention, "actual_seq_lengths_kv")

    def zero_length_fast_path(self, op: Any, lengths: str) -> None:
        """Declare that kernel `op` (an op packet) takes a fast path when every value of its host
        argument `lengths` is 0: on the device it then launches other work (or none) than for real
        lengths, so such a call records another task kind (`<op>[all lengths 0]`), and a task update
        to real lengths does not match it. A kernel must be captured with lengths it really runs."""
        self._fast_paths[op] = lengths

    def reads_on_host(self, op: Any, *names: str) -> None:
        """Declare that op packet `op` reads its tensor arguments `names` on the host when its task
        runs (after the call returned, with a task queue): tasks hold them weakly, and running a task
        whose host tensor was freed raises."""
        self._host_reads[op] = names

    def first_call(self, name: str) -> None:
        """Called by a kernel each time it runs: its first call sets it up (tiling caches, binaries,
        allocations), which a device cannot do inside a capture, so a first call during a capture
        raises. Run the work once eagerly before capturing (`DeviceGraph.warmup`)."""
        if name in self._set_up:
            return
        if self._capturing is not None:
            raise CaptureError(
                f"{name}: first call inside the capture of {self._capturing.name}; the op sets itself up on its "
                f"first call, which the device cannot do while capturing: run it eagerly before capturing"
            )
        self._set_up.add(name)

    @property
    def device(self) -> torch.device:
        """Simulated device memory is CPU memory."""
        return torch.device("cpu")

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised memory from the general pool, or from the graph pool during a capture."""
        shape = tuple(shape)
        with _disable_current_modes():
            return self._allocate(shape, _contiguous_stride(shape), dtype)

    def graph(self) -> SimGraph:
        """A new graph; all graphs of this runtime share its graph pool."""
        self._graph_count += 1
        return SimGraph(self, f"graph{self._graph_count}")

    def event(self, name: str) -> SimEvent:
        """A new, unrecorded external event named `name`."""
        return SimEvent(self, name)

    def task_group_begin(self) -> None:
        """Inside capture: the tasks recorded from here to `task_group_end` form one group."""
        graph = self._require_capture("task_group_begin()")
        if self._group_start is not None:
            raise CaptureError("task_group_begin(): a task group is already open (task groups do not nest)")
        self._group_start = len(graph._tasks)

    def task_group_end(self) -> SimTaskHandle:
        """Inside capture: close the open group and return its handle."""
        graph = self._require_capture("task_group_end()")
        if self._group_start is None:
            raise CaptureError("task_group_end() without task_group_begin()")
        tasks = tuple(graph._tasks[self._group_start :])
        self._group_start = None
        if not tasks:
            raise CaptureError("empty task group: no op was issued between task_group_begin() and task_group_end()")
        graph._groups += 1
        return SimTaskHandle(graph, graph._groups - 1, tasks)

    def task_update_begin(self, handle: TaskHandle) -> None:
        """Outside capture: record (without running) the ops issued until `task_update_end`."""
        if not isinstance(handle, SimTaskHandle) or handle.graph._runtime is not self:
            raise AscendCompileError(f"task_update_begin(): {handle!r} is not a task group of this runtime")
        if self._capturing is not None:
            raise CaptureError("task_update_begin() during capture: task updates are issued outside capture")
        if self._update is not None:
            raise AscendCompileError(
                f"task_update_begin(): the update of {self._update.handle!r} is still open (call task_update_end())"
            )
        mode = _UpdateMode(self, handle)
        mode.__enter__()
        self._update = mode

    def task_update_end(self) -> None:
        """Check the recorded ops match the group's tasks one for one, then give the tasks their
        operands, for every replay not yet run (pending ones included)."""
        mode = self._update
        if mode is None:
            raise AscendCompileError("task_update_end() without task_update_begin()")
        self._update = None
        mode.__exit__(None, None, None)
        tasks = mode.handle._tasks
        got = [kind for _, kind, _, _ in mode.recorded]
        if len(got) != len(tasks) or any(
            not isinstance(t, _OpTask) or t.op is not op or t.kind != kind
            for t, (op, kind, _, _) in zip(tasks, mode.recorded)
        ):
            raise TaskUpdateMismatch(
                f"task update of {mode.handle.graph.name} group {mode.handle.index} must issue the same ops as "
                f"the group: expected {len(tasks)} {list(mode.handle.tasks)}, got {len(got)} {got}"
            )
        for task, (_, _, args, kwargs) in zip(tasks, mode.recorded):
            task.rebind(args, kwargs)
        logger.debug("updated %r", mode.handle)

    def synchronize(self) -> None:
        """Run every launched replay, in launch order, as a device would: outside any dispatch
        mode and without autograd (so in-place writes to inference-mode caches are allowed)."""
        if self._capturing is not None:
            raise CaptureError(f"synchronize() during the capture of {self._capturing.name}")
        pending, self._pending = self._pending, []
        if pending:
            with _disable_current_modes(), torch.inference_mode():
                for graph in pending:
                    graph._execute()

    def weak_alias(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor at the same simulated address that does not keep the block allocated."""
        where = self._locate(tensor)
        if where is None:
            return tensor
        segment, offset = where
        with _disable_current_modes():
            return segment.view(offset, tensor.dtype, tuple(tensor.shape), tensor.stride())

    def address_of(self, tensor: torch.Tensor) -> tuple[str, int, int]:
        """`(pool, segment index, byte offset)` of the tensor's first element; ValueError if the
        tensor is not in this simulator's memory (a parameter, a user's KV cache)."""
        where = self._locate(tensor)
        if where is None:
            raise ValueError("tensor is not in this simulator's memory")
        segment, offset = where
        return segment.pool.name, segment.index, offset

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Per pool ("general", "graph"): reserved_bytes, allocated_bytes, segments, free_blocks."""
        return {pool.name: pool.stats() for pool in (self._general, self._graph_pool)}

    def describe(self) -> dict[str, Any]:
        """What the dump records about this runtime."""
        return {**super().describe(), "segment_bytes": self._general.segment_bytes, "overflow": self.overflow}

    def _allocate(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        pool = self._general if self._capturing is None else self._graph_pool
        block = pool.allocate(extent_bytes(shape, stride, dtype))
        if self._capturing is not None:
            self._captured_blocks.append((block.segment, block.offset, block.size))
        return pool.tensor(block, shape, stride, dtype)

    def _graph_tensor_like(self, t: torch.Tensor) -> torch.Tensor:
        if not _is_cpu_dense(t):
            return t
        return self._allocate(tuple(t.shape), t.stride(), t.dtype)

    def _locate(self, t: torch.Tensor) -> Optional[tuple[Segment, int]]:
        if not _is_cpu_dense(t):
            return None
        ptr = t.data_ptr()
        return self._general.locate(ptr) or self._graph_pool.locate(ptr)

    def _task_kind(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The kind of task a call of `op` launches: its name, marked when its zero-length fast path
        is taken."""
        lengths = self._fast_paths.get(op.overloadpacket)
        if lengths is not None and _all_zero(_arg(op, args, kwargs, lengths)[1]):
            return f"{op}[all lengths 0]"
        return str(op)

    def _record_operands(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """A task's operands: tensors as addresses, host tensors the op reads when it runs held weakly."""
        args, kwargs = pytree.tree_map(self._describe, (args, kwargs))
        for name in self._host_reads.get(op.overloadpacket, ()):
            key, value = _arg(op, args, kwargs, name)
            if isinstance(value, torch.Tensor):
                if isinstance(key, int):
                    args = (*args[:key], _HostRef(value, name), *args[key + 1:])
                else:
                    kwargs = {**kwargs, key: _HostRef(value, name)}
        return args, kwargs

    def _describe(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        where = self._locate(x)
        if where is None:
            return x
        return _MemRef(where[0], where[1], x.dtype, tuple(x.shape), x.stride())

    def _require_capture(self, what: str) -> SimGraph:
        if self._capturing is None:
            raise CaptureError(f"{what} outside capture")
        return self._capturing

    def _begin_capture(self, graph: SimGraph) -> None:
        if self._capturing is not None:
            raise CaptureError(f"cannot capture {graph.name}: {self._capturing.name} is being captured")
        if graph._captured or graph._tasks:
            raise CaptureError(f"{graph.name} was already captured; capture into a new graph")
        if self._update is not None:
            raise CaptureError(f"cannot capture {graph.name} inside the task update of {self._update.handle!r}")
        self.synchronize()
        self._capturing = graph

    def _end_capture(self, graph: SimGraph) -> bool:
        """Leave capture, poison what it allocated; True if a task group was left open."""
        self._capturing = None
        group_open = self._group_start is not None
        self._group_start = None
        blocks, self._captured_blocks = self._captured_blocks, []
        with _disable_current_modes():
            self._complete_all()
            for segment, offset, size in blocks:
                segment.data[offset : offset + size].fill_(0xFF)
        logger.debug(
            "captured %s: %d tasks; poisoned %d graph-pool blocks (%d bytes)",
            graph.name, len(graph._tasks), len(blocks), sum(b[2] for b in blocks),
        )
        return group_open

    def _event_action(self, event: SimEvent, action: str) -> None:
        graph = self._capturing
        if graph is None:
            event._apply(action, f"{action}() of {event.name!r} outside capture")
        else:
            graph._tasks.append(_EventTask(event, action, f"{graph.name} task {len(graph._tasks)}"))

    def _deliver(self, op: Any, result: torch.Tensor, dst: torch.Tensor) -> None:
        """Put a fresh output of `op` at its captured address `dst`: at once, or, for a functional
        collective, when it completes (the result is not written before then)."""
        if _completes_at_wait(op):
            self._in_flight[dst.data_ptr()] = (result, dst)
        else:
            dst.copy_(result)

    def _complete(self, tensor: torch.Tensor) -> None:
        """Wait for the collective in flight to `tensor`'s address, if any, and deliver its output."""
        pending = self._in_flight.pop(tensor.data_ptr(), None)
        if pending is not None:
            result, dst = pending
            torch.ops._c10d_functional.wait_tensor(result)
            dst.copy_(result)

    def _complete_all(self) -> None:
        """Complete every collective still in flight: the end of a graph joins its work, as on the device."""
        for _, dst in list(self._in_flight.values()):
            self._complete(dst)

    def _launch(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], label: str) -> Any:
        """Call `op`; a `WorkspaceTooSmall` becomes an overrun of the workspace (or is re-raised).
        A `wait_tensor` first completes the collective in flight to its operand's address."""
        if _is_wait(op):
            self._complete(args[0] if args else kwargs["tensor"])
        try:
            return op(*args, **kwargs)
        except WorkspaceTooSmall as err:
            if self.overflow == "raise":
                err.args = (f"{err.args[0]} [in {label}]",)
                raise
            args, kwargs = self._overrun(op, args, kwargs, err, label)
        return op(*args, **kwargs)

    def _overrun(
        self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], err: WorkspaceTooSmall, label: str
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The operands with the workspace widened to `err.needed` bytes in place, as the kernel
        would write them on the device: into whatever follows the buffer in its segment."""
        error = CaptureError if self._capturing is not None else ReplayError
        name = err.arg_name
        names = [a.name for a in op._schema.arguments]
        index = names.index(name) if name in names else len(names)
        if name in kwargs:
            buf = kwargs[name]
        elif index < len(args):
            buf = args[index]
        else:
            raise error(f"{label}: {err}; {op} was not passed an argument {name!r} to overrun") from err
        where = self._locate(buf)
        if where is None:
            raise error(
                f"{label}: {err}; the buffer is not simulator memory, so its overrun cannot be simulated"
            ) from err
        segment, offset = where
        count = -(-err.needed // buf.dtype.itemsize)
        if offset + count * buf.dtype.itemsize > segment.size:
            raise error(
                f"{label}: {err}; writing {err.needed} bytes from offset {offset} of {segment.pool.name} "
                f"segment {segment.index} runs past its end ({segment.size} bytes): the device would fault"
            ) from err
        logger.debug(
            "%s: workspace overrun: %s writes %d bytes into a %d-byte buffer", label, op, err.needed, err.given
        )
        wide = segment.view(offset, buf.dtype, (count,), (1,))
        if name in kwargs:
            return args, {**kwargs, name: wide}
        return (*args[:index], wide, *args[index + 1 :]), kwargs
