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
- the device runs work asynchronously on **streams** (`sim_streams.py`): a default, a capture and an
  update stream (more with `new_stream`). `SimGraph.replay` queues the graph's tasks on a stream,
  `task_update_end` queues the update on the update stream, events are recorded, waited on and reset
  on streams, and the queues drain on `synchronize` (or `advance`). Only events order two streams;
- a task update and a replay's kernel that no event orders are a race (`StreamRace`), as is a host
  write into a static input of a replay launched and not yet run (`ReplayError`); a replay waiting on
  an event that nothing queued can record raises naming the node, instead of hanging;
- a kernel with a zero-length fast path (`SimRuntime.zero_length_fast_path`; by default the ascend
  PA, FIA and MLA) called with every length 0 launches another task than with real lengths, so a task
  captured that way cannot be updated to real lengths (the update is refused);
- host tensors a kernel reads when its task runs (`SimRuntime.reads_on_host`, e.g. ATB's CPU
  `context_lens`) are held weakly by the task, as the device holds only their address: one freed
  before the task runs is an error;
- an op that sets itself up on its first call (`SimRuntime.first_call`) may not make that call
  inside a capture;
- host reads of device data during capture (`.item()`, `.tolist()`, data-dependent shapes) raise;
- random ops (a sampler's `multinomial`) draw from the CPU generator when a replay runs them, fresh
  numbers each replay; a capture draws nothing (the generator is put back), as on CUDA and torch_npu;
- a functional collective (`_c10d_functional`) is a device task of the replay's stream whose output
  reaches its captured address only when its work completes: at the graph's `wait_tensor` of it, or
  at the end of the graph; every replay issues it again, in captured order.

This module holds the runtime and its graphs; beside it, one concern per module: `sim_tasks`,
`sim_dispatch` (recording under the dispatcher), `sim_memory` over `sim_pool`, `sim_streams`,
`sim_events`, `sim_updates` (task groups and updates), `sim_inputs`, `sim_overrun`, `sim_collectives`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import AscendCompileError, CaptureError, ReplayError, TaskUpdateMismatch, WorkspaceTooSmall
from .base import DeviceGraph, TaskHandle, TaskUpdateRuntime, generators_kept
from .sim_collectives import InFlight
from .sim_dispatch import _CaptureMode, _HostReadGuard, _UpdateMode
from .sim_events import SimEvent
from .sim_inputs import Region, check_unchanged, snapshot, static_inputs
from .sim_memory import SimMemory
from .sim_overrun import widen_workspace
from .sim_pool import Segment
from .sim_streams import CallWork, SimDevice, SimStream, TaskAccess
from .sim_tasks import _EventTask, _Item, _OpTask, _Task, _contiguous_stride, _is_wait, _program
from .sim_updates import SimTaskHandle, _land, _waited_node

__all__ = ["SimEvent", "SimGraph", "SimRuntime", "SimTaskHandle"]

logger = logging.getLogger("ascend_compile.sim")


class SimGraph(DeviceGraph):
    """A graph captured on the simulator: a list of tasks replayed at fixed addresses."""

    def __init__(self, runtime: SimRuntime, name: str) -> None:
        self._runtime = runtime
        self.name = name
        self._tasks: list[_Task] = []
        self._groups = 0
        self._captured = False
        self._program: list[_Item] = []
        self._inputs: Optional[dict[Region, str]] = None

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

        The device is drained first. Fresh outputs are placed in the runtime's graph pool; when
        the context ends, every block allocated during it is poisoned, and the CPU generator is
        put back where the capture found it: random ops ran once like every op, but a device's
        capture launches nothing, so it draws nothing; each replay draws (`replay`).
        """
        rt = self._runtime
        rt._begin_capture(self)
        try:
            with generators_kept(), _HostReadGuard(), _CaptureMode(rt, self):
                yield
        finally:
            group_open = rt._end_capture(self)
        if group_open:
            raise CaptureError(f"capture of {self.name} ended inside a task group: call task_group_end()")
        self._program = _program(self._tasks)
        self._captured = True

    def replay(self, stream: Optional[SimStream] = None) -> None:
        """Launch the graph on `stream` (default: the current stream); it runs when the device
        drains that stream. Its static inputs are read as they are now: a host write into them
        before the replay runs is an error then. Its random ops draw from the CPU generator when
        they run: fresh numbers each replay, as a device graph's read the generator's offset."""
        rt = self._runtime
        if not self._captured:
            raise ReplayError(f"{self.name} cannot be replayed: it was never captured (or its capture failed)")
        if rt._capturing is not None:
            raise ReplayError(f"cannot replay {self.name} while {rt._capturing.name} is being captured")
        stream = stream or rt.current_stream
        queue = rt.device_queue
        saved = snapshot(self._static_inputs())
        queue.enqueue(stream, CallWork(f"{self.name} launch", lambda s: check_unchanged(self.name, saved)))
        for part in self._program:
            if isinstance(part, _EventTask):
                queue.enqueue(stream, part.work())
            else:
                queue.enqueue(stream, CallWork(part[0].label, functools.partial(rt._run_tasks, part)))
        queue.enqueue(stream, CallWork(f"{self.name} end", lambda s: rt._in_flight.complete_all()))

    def _static_inputs(self) -> dict[Region, str]:
        """General-pool memory the graph reads and never writes (its static inputs), each with the
        first task reading it; computed again after an update lands."""
        if self._inputs is None:
            self._inputs = static_inputs(self._tasks)
        return self._inputs

    def __repr__(self) -> str:
        return f"SimGraph({self.name!r}, {len(self._tasks)} tasks, captured={self._captured})"


class SimRuntime(TaskUpdateRuntime):
    """The ACL-graph simulator (see the module docstring for the device rules it enforces).

    `segment_bytes`: size of each simulated memory segment (a larger request gets its own).
    `overflow`: what a kernel short of workspace does: "write" past its buffer, as the device
    does, or "raise" its `WorkspaceTooSmall`.
    """

    name = "sim"

    def __init__(self, segment_bytes: int = 64 << 20, overflow: str = "write") -> None:
        if overflow not in ("write", "raise"):
            raise ValueError(f"overflow must be 'write' or 'raise', got {overflow!r}")
        self.overflow = overflow
        self._memory = SimMemory(segment_bytes)
        self._capturing: Optional[SimGraph] = None
        self._group_start: Optional[int] = None
        self._update: Optional[_UpdateMode] = None
        self.device_queue = SimDevice()
        self.default_stream = self.device_queue.stream("default")
        self.capture_stream = self.device_queue.stream("capture")
        self.update_stream = self.device_queue.stream("update", priority=-1)
        self._current: list[SimStream] = []
        self._in_flight = InFlight()
        self._graph_count = 0
        self._fast_paths: dict[Any, str] = {}
        self._host_reads: dict[Any, tuple[str, ...]] = {}
        self._set_up: set[str] = set()
        self.zero_length_fast_path(torch.ops.ascend.paged_attention, "context_lens")
        self.zero_length_fast_path(torch.ops.ascend.fused_infer_attention, "actual_seq_lengths_kv")
        self.zero_length_fast_path(torch.ops.ascend.mla_fused_infer_attention, "actual_seq_kvlen")

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

    def event(self, name: str, external: bool = True) -> SimEvent:
        """A new, unrecorded event named `name`: external (a flag, ACL's `ExternalEvent`), or an
        ordinary one that marks a point of a stream."""
        return SimEvent(self, name, external)

    def new_stream(self, name: str, priority: int = 0) -> SimStream:
        """Another stream of the device (lower `priority` is served first)."""
        return self.device_queue.stream(name, priority)

    @property
    def current_stream(self) -> SimStream:
        """Where replays go by default: the innermost `stream()` context's, else the default stream."""
        return self._current[-1] if self._current else self.default_stream

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[None]:
        """Make `stream` current for the block."""
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def advance(self, ticks: int) -> int:
        """Tick the simulated device clock: run up to `ticks` queued items without the host waiting
        for the rest; returns how many ran."""
        with _disable_current_modes(), torch.inference_mode():
            return self.device_queue.advance(ticks)

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
        start, self._group_start = self._group_start, None
        tasks = tuple(graph._tasks[start:])
        if not tasks:
            raise CaptureError("empty task group: no op was issued between task_group_begin() and task_group_end()")
        graph._groups += 1
        handle = SimTaskHandle(graph, graph._groups - 1, tasks)
        name = f"{graph.name} group {handle.index}" + _waited_node(graph._tasks[max(0, start - 2) : start])
        for task in tasks:
            if isinstance(task, _OpTask):
                task.access = TaskAccess(name)
        return handle

    def task_update_begin(self, handle: TaskHandle, stream: Optional[SimStream] = None) -> None:
        """Outside capture: record (without running) the ops issued until `task_update_end`, an
        update to be issued on `stream` (default: the update stream)."""
        if not isinstance(handle, SimTaskHandle) or handle.graph._runtime is not self:
            raise AscendCompileError(f"task_update_begin(): {handle!r} is not a task group of this runtime")
        if self._capturing is not None:
            raise CaptureError("task_update_begin() during capture: task updates are issued outside capture")
        if self._update is not None:
            raise AscendCompileError(
                f"task_update_begin(): the update of {self._update.handle!r} is still open (call task_update_end())"
            )
        mode = _UpdateMode(self, handle, stream or self.update_stream)
        mode.__enter__()
        self._update = mode

    def task_update_end(self) -> None:
        """Check the recorded ops match the group's tasks one for one, then issue the update on its
        stream: the tasks get their new operands when the device runs it, and a replay sees them
        only if an event orders the update before the replay's kernel (else `StreamRace`)."""
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
        handle, label = mode.handle, f"task update of {mode.handle.graph.name} group {mode.handle.index}"
        self.device_queue.enqueue(mode.stream, CallWork(label, functools.partial(_land, handle, mode.recorded, label)))
        logger.debug("issued the update of %r on %s", handle, mode.stream.name)

    def synchronize(self) -> None:
        """Wait for the device: drain every stream, as a device would, outside any dispatch mode
        and without autograd (so in-place writes to inference-mode caches are allowed)."""
        if self._capturing is not None:
            raise CaptureError(f"synchronize() during the capture of {self._capturing.name}")
        with _disable_current_modes(), torch.inference_mode():
            self.device_queue.drain()

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
        return self._memory.stats()

    def describe(self) -> dict[str, Any]:
        """What the dump records about this runtime."""
        return {**super().describe(), "segment_bytes": self._memory.general.segment_bytes, "overflow": self.overflow}

    def _allocate(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._memory.allocate(shape, stride, dtype, capturing=self._capturing is not None)

    def _locate(self, t: torch.Tensor) -> Optional[tuple[Segment, int]]:
        return self._memory.locate(t)

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
        with _disable_current_modes():
            self._in_flight.complete_all()
            blocks = self._memory.poison_captured()
        logger.debug(
            "captured %s: %d tasks; poisoned %d graph-pool blocks (%d bytes)",
            graph.name, len(graph._tasks), len(blocks), sum(b[2] for b in blocks),
        )
        return group_open

    def _run_tasks(self, tasks: list[_OpTask], stream: SimStream) -> None:
        """Run a replay's op tasks on `stream`."""
        for task in tasks:
            task.run(self, stream)

    def _launch(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], label: str) -> Any:
        """Call `op`; a `WorkspaceTooSmall` becomes an overrun of the workspace (or is re-raised).
        A `wait_tensor` first completes the collective in flight to its operand's address."""
        if _is_wait(op):
            self._in_flight.complete(args[0] if args else kwargs["tensor"])
        try:
            return op(*args, **kwargs)
        except WorkspaceTooSmall as err:
            if self.overflow == "raise":
                err.args = (f"{err.args[0]} [in {label}]",)
                raise
            error = CaptureError if self._capturing is not None else ReplayError
            args, kwargs = widen_workspace(op, args, kwargs, err, label, self._locate, error)
        return op(*args, **kwargs)
