"""The ACL-graph simulator's runtime and graphs: the capture / replay / task-update protocol.

`SimRuntime` is the `TaskUpdateRuntime` of the simulator (the rules it enforces are listed in the
package docstring); `SimGraph` is one captured graph. Everything they rely on sits below them in
this package, one concern per module.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...errors import AscendCompileError, CaptureError, ReplayError, TaskUpdateMismatch
from ..base import DeviceGraph, TaskHandle, TaskUpdateRuntime, generators_kept
from .dispatch import CaptureMode, UpdateMode
from .events import SimEvent
from .faults import CaptureFaults
from .inputs import check_unchanged, snapshot, static_inputs
from .kernels import DeviceKernels
from .launch import Launcher
from .memory import SimMemory, contiguous_stride
from .pool import Region, Segment
from .streams import CallWork, EventState, SimDevice, SimStream, TaskAccess
from .tasks import EventTask, Item, OpTask, Recording, program
from .updates import SimTaskHandle, land, waited_node

logger = logging.getLogger("ascend_compile.sim")

#: The ascend ops the simulated device has kernels for: PA, FIA and the MLA kernel (FIA v2's latent
#: form), and the cache writes (the device the simulator models has them, as Ascend's ATB has
#: ReshapeAndCache and aclnn ScatterPaKvCache; the ops' bodies are those kernels' references).
#: Every other ascend op (the unified `ascend.attention`, `ascend.workspace`) is recorded as the ops its body issues.
SIM_KERNELS = frozenset({"ascend::paged_attention", "ascend::fused_infer_attention", "ascend::reshape_and_cache",
                         "ascend::mla_fused_infer_attention", "ascend::mla_cache_write"})


class SimGraph(DeviceGraph):
    """A graph captured on the simulator: a list of tasks replayed at fixed addresses."""

    def __init__(self, runtime: SimRuntime, name: str, label: str = "") -> None:
        self._runtime, self.name, self.label = runtime, name, label  # label: the runner's name (`faults.py`)
        self.recording = Recording(name)
        self._captured = False
        self._program: list[Item] = []

    @property
    def tasks(self) -> tuple[str, ...]:
        """The kind of every recorded task, in order: `str(op)` (e.g. "aten.mm.default") or
        "event.<wait|reset|record>:<name>"."""
        return tuple(t.kind for t in self.recording.tasks)

    @property
    def captured(self) -> bool:
        """Whether a capture of this graph completed."""
        return self._captured

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the ops issued in this context (they run once too, but for a collective's communication).

        The device is drained first. Fresh outputs are placed in the runtime's graph pool; when
        the context ends, every block allocated during it is poisoned, and the CPU generator is
        put back where the capture found it: random ops ran once like every op, but a device's
        capture launches nothing, so it draws nothing; each replay draws (`replay`).
        """
        rt = self._runtime
        with rt.faults.capture(self) as inside:  # the device may refuse it (`faults.py`)
            rt._begin_capture(self)
            try:
                mode = CaptureMode(self.recording, rt._memory, rt.device_kernels, rt._launcher, inside)
                with generators_kept(), mode.guard, mode:
                    yield
            finally:
                group_open = rt._end_capture(self)
            if group_open:
                raise CaptureError(f"capture of {self.name} ended inside a task group: call task_group_end()")
        self._program = program(self.recording.tasks)
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
            if isinstance(part, EventTask):
                queue.enqueue(stream, part.work())
            else:
                queue.enqueue(stream, CallWork(part[0].label, functools.partial(rt._run_tasks, part)))
        queue.enqueue(stream, CallWork(f"{self.name} end", lambda s: rt._launcher.in_flight.complete_all()))

    def _static_inputs(self) -> dict[Region, str]:
        """General-pool memory the graph reads and never writes (its static inputs), each with the
        first task reading it; computed again after an update lands."""
        recording = self.recording
        if recording.static_inputs is None:
            recording.static_inputs = static_inputs(recording.tasks)
        return recording.static_inputs

    def __repr__(self) -> str:
        return f"SimGraph({self.name!r}, {len(self.recording.tasks)} tasks, captured={self._captured})"


class SimRuntime(TaskUpdateRuntime):
    """The ACL-graph simulator (see the package docstring for the device rules it enforces).

    `segment_bytes`: size of each simulated memory segment (a larger request gets its own).
    `overflow`: what a kernel short of workspace does: "write" past its buffer, as the device
    does, or "raise" its `WorkspaceTooSmall`.
    `device_kernels`: the ops besides torch's own that the device has kernels for (op namespaces or
    qualified op names, `kernels.DeviceKernels`); every other op is recorded as the ops its body
    issues. By default `SIM_KERNELS`.
    `stream_budget`: the streams captured graphs may hold, one each (None: no limit; `faults.py`).
    """

    name = "sim"

    def __init__(
        self, segment_bytes: int = 64 << 20, overflow: str = "write", device_kernels: Iterable[str] = SIM_KERNELS,
        stream_budget: int | None = None,
    ) -> None:
        self.faults = CaptureFaults(stream_budget)
        self._memory = SimMemory(segment_bytes)
        self._launcher = Launcher(self._memory, overflow)
        self.device_kernels = DeviceKernels(device_kernels)
        self._capturing: Optional[SimGraph] = None
        self._group_start: Optional[int] = None
        self._update: Optional[UpdateMode] = None
        self.device_queue = SimDevice()
        self.default_stream = self.device_queue.stream("default")
        self.capture_stream = self.device_queue.stream("capture")
        self.update_stream = self.device_queue.stream("update", priority=-1)
        self._current, self._graph_count = [], 0
        self.zero_length_fast_path(torch.ops.ascend.paged_attention, "context_lens")
        self.zero_length_fast_path(torch.ops.ascend.fused_infer_attention, "actual_seq_lengths_kv")
        self.zero_length_fast_path(torch.ops.ascend.mla_fused_infer_attention, "actual_seq_kvlen")
        self.query_length_branches(torch.ops.ascend.fused_infer_attention, "actual_seq_lengths")
        self.query_length_branches(torch.ops.ascend.mla_fused_infer_attention, "actual_seq_qlen")

    @property
    def overflow(self) -> str:
        """What a kernel short of workspace does: "write" past its buffer or "raise"."""
        return self._launcher.overflow

    def zero_length_fast_path(self, op: Any, lengths: str) -> None:
        """Declare that kernel `op` (an op packet) takes a fast path when every value of its host
        argument `lengths` is 0: on the device it then launches other work (or none) than for real
        lengths, so such a call records another task kind (`<op>[all lengths 0]`), and a task update
        to real lengths does not match it. A kernel must be captured with lengths it really runs.

        A model, kept for the ascend PA and FIA: their host lengths choose the tiling, hence the
        launch, each time they are issued (a task update re-tiles, torch_npu `npu/graphs.py`,
        `update_capture_record`; FIA's tiling special-cases zero lengths, ops-transformer
        `fused_infer_attention_score_tiling_info_parser.cpp`), and no source says a batch of zeros
        launches what real lengths do; vLLM-Ascend captures with real lengths (its dummy run uses
        `SEQ_LEN_WITH_MAX_PA_WORKSPACE` or `max_query_len`, `model_runner_v1.py`)."""
        self.device_kernels.fast_paths[op] = lengths

    def query_length_branches(self, op: Any, ends: str) -> None:
        """Declare that kernel `op` (an op packet) takes one branch when its cumulative query ends `ends`
        give every sequence one query token and another otherwise: such a call records the task kind
        `<op>[S=1]` or `<op>[S>1]`, and a task update to the other branch does not match the task: a
        graph must be captured in the shape of the steps it serves. Source, the docs (torch_npu 2.14 `_op_plugin_docs.py` L8056, `_v2` L8580: S of 1 takes
        IncreFlashAttention, else PromptFlashAttention); the kernel source routes a TND call by head dim,
        rope and quantisation, not query lengths (ops-transformer c29bc106 `fused_infer_attention_score_tiling.cpp`
        `IsUsingIFA` L687-734; bfbbec83 L1259-1374, L1789-1803): this models the docs', the stricter reading.
        No source says a task update may move a captured task between the two; vLLM-Ascend keeps its decode
        graphs' shape at every update (`model_runner_v1.py`)."""
        self.device_kernels.query_branches[op] = ends

    def copies_host_inputs(self, op: Any, *names: str) -> None:
        """Declare that kernel `op` (an op packet) takes its tensor arguments `names` on the host and
        the device copies them when the call is issued (torch_npu's ATB binding clones every CPU tensor
        input, op-plugin `AtbCommon.cpp`, `ParamSetter::Input`): its task holds the copy, so the
        caller may free or overwrite its tensor as soon as the call returns."""
        self.device_kernels.host_inputs[op] = names

    def first_call(self, name: str) -> None:
        """Called by a kernel each time it runs (`DeviceKernels.first_call`: no first call inside a capture)."""
        self.device_kernels.first_call(name, self._capturing.name if self._capturing is not None else None)

    @property
    def device(self) -> torch.device:
        """Simulated device memory is CPU memory."""
        return torch.device("cpu")

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised memory from the general pool, or from the graph pool during a capture."""
        shape = tuple(shape)
        with _disable_current_modes():
            return self._memory.allocate(shape, contiguous_stride(shape), dtype, capturing=self._capturing is not None)

    def graph(self, label: str = "") -> SimGraph:
        """A new graph; all graphs of this runtime share its graph pool (`label`: the runner's name for it)."""
        self._graph_count += 1
        return SimGraph(self, f"graph{self._graph_count}", label)

    def event(self, name: str, external: bool = True) -> SimEvent:
        """A new, unrecorded event named `name`: external (a flag, ACL's `ExternalEvent`), or an
        ordinary one that marks a point of a stream."""
        return SimEvent(name, external, self._issue_event)

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
        self._group_start = len(graph.recording.tasks)

    def task_group_end(self) -> SimTaskHandle:
        """Inside capture: close the open group and return its handle."""
        recording = self._require_capture("task_group_end()").recording
        if self._group_start is None:
            raise CaptureError("task_group_end() without task_group_begin()")
        start, self._group_start = self._group_start, None
        tasks = tuple(recording.tasks[start:])
        if not tasks:
            raise CaptureError("empty task group: no op was issued between task_group_begin() and task_group_end()")
        recording.groups += 1
        handle = SimTaskHandle(recording, recording.groups - 1, tasks, self)
        name = f"{recording.name} group {handle.index}" + waited_node(recording.tasks[max(0, start - 2) : start])
        for task in tasks:
            if isinstance(task, OpTask):
                task.access = TaskAccess(name)
        return handle

    def task_update_begin(self, handle: TaskHandle, stream: Optional[SimStream] = None) -> None:
        """Outside capture: record (without running) the ops issued until `task_update_end`, an
        update to be issued on `stream` (default: the update stream)."""
        if not isinstance(handle, SimTaskHandle) or handle.owner is not self:
            raise AscendCompileError(f"task_update_begin(): {handle!r} is not a task group of this runtime")
        if self._capturing is not None:
            raise CaptureError("task_update_begin() during capture: task updates are issued outside capture")
        if self._update is not None:
            raise AscendCompileError(
                f"task_update_begin(): the update of {self._update.handle!r} is still open (call task_update_end())"
            )
        mode = UpdateMode(self._memory, self.device_kernels, handle, stream or self.update_stream)
        mode.__enter__()
        self._update = mode

    def task_update_end(self) -> None:
        """Check the recorded ops match the group's tasks one for one, then issue the update on its
        stream: the tasks get their new operands when the device runs it, and a replay sees them
        only if an event orders the update before the replay's kernel (else `StreamRace`).

        Source: torch_npu refuses an update whose count differs from the recorded ops
        (`npu/graphs.py`, `update_capture_record`) and re-issues each in place of its record; that
        a re-issued op must launch the kernel it replaces is the model of an update rewriting the
        captured task's arguments, not adding or replacing tasks."""
        mode = self._update
        if mode is None:
            raise AscendCompileError("task_update_end() without task_update_begin()")
        self._update = None
        mode.__exit__(None, None, None)
        handle = mode.handle
        label = f"task update of {handle.recording.name} group {handle.index}"
        if not handle.matches(mode.issued):
            got = [op.kind for op in mode.issued]
            raise TaskUpdateMismatch(
                f"{label} must issue the same ops as the group: expected {len(handle.group)} "
                f"{list(handle.tasks)}, got {len(got)} {got}"
            )
        self.device_queue.enqueue(mode.stream, CallWork(label, functools.partial(land, handle, mode.issued, label)))
        logger.debug("issued the update of %r on %s", handle, mode.stream.name)

    def synchronize(self) -> None:
        """Wait for the device: drain every stream, as a device would, outside any dispatch mode
        and without autograd (so in-place writes to inference-mode caches are allowed)."""
        if self._capturing is not None:
            raise CaptureError(f"synchronize() during the capture of {self._capturing.name}")
        self.synchronizes += 1
        with _disable_current_modes(), torch.inference_mode():
            self.device_queue.drain()

    def run_stream(self, stream: Optional[SimStream] = None) -> None:
        """Run what is queued on `stream` (default: the current one), and what it waits for, the host
        not waiting: the work a device would have done before the host's next op on that stream,
        which the simulator runs on the host at once. Not a synchronize."""
        with _disable_current_modes(), torch.inference_mode():
            self.device_queue.run_stream(stream or self.current_stream)

    def after_piece(self) -> None:
        """The eager ops the host issues next would queue behind the piece on the current stream:
        run that stream first (`run_stream`)."""
        self.run_stream()

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

    def graph_budget(self) -> tuple[int | None, str]:
        return self.faults.budget, "the simulator's stream_budget, one stream a graph (`faults.py`)"

    def describe(self) -> dict[str, Any]:
        """What the dump records about this runtime."""
        return {**super().describe(), "segment_bytes": self._memory.general.segment_bytes, "overflow": self.overflow}

    def _locate(self, t: torch.Tensor) -> Optional[tuple[Segment, int]]:
        return self._memory.locate(t)

    def _issue_event(self, event: EventState, action: str, stream: Optional[SimStream]) -> None:
        """An event action: inside capture a task of the graph; outside, issued on `stream` (a record
        by default on the update stream, where the updates it follows are; a wait or reset on the
        current stream)."""
        graph = self._capturing
        if graph is not None:
            graph.recording.tasks.append(EventTask(event, action, graph.recording.label()))
            return
        default = self.update_stream if action == "record" else self.current_stream
        task = EventTask(event, action, f"{action}() of {event.name!r} outside capture")
        self.device_queue.enqueue(stream or default, task.work())

    def _require_capture(self, what: str) -> SimGraph:
        if self._capturing is None:
            raise CaptureError(f"{what} outside capture")
        return self._capturing

    def _begin_capture(self, graph: SimGraph) -> None:
        if self._capturing is not None:
            raise CaptureError(f"cannot capture {graph.name}: {self._capturing.name} is being captured")
        if graph.captured or graph.recording.tasks:
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
            self._launcher.in_flight.complete_all()
            blocks = self._memory.poison_captured()
        logger.debug("captured %s: %d tasks; poisoned %d graph-pool blocks (%d bytes)", graph.name,
                     len(graph.recording.tasks), len(blocks), sum(b[2] for b in blocks))
        return group_open

    def _run_tasks(self, tasks: list[OpTask], stream: SimStream) -> None:
        """Run a replay's op tasks on `stream`."""
        for task in tasks:
            task.run(self._launcher, stream)
