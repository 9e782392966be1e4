"""The device-graph runtime interface every backend device implements (DESIGN.md §5).

Lowering talks only to this interface: capture a graph, group the tasks of one kernel call,
update a group's host arguments before a replay, order updates and replay with external events,
and allocate static memory that lives as long as the compiled artifact.
"""
from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes


@contextlib.contextmanager
def generators_kept(device_module: Any = None, device: torch.device | None = None) -> Iterator[None]:
    """The CPU generator, and `device_module`'s default generator of `device` (`torch.cuda`,
    `torch.npu`: both offer `get_rng_state(device)` / `set_rng_state(state, device)`), put back as
    they were when the block began once it ends.

    Why: a step that captures a graph runs its work before (warm-up) and, on the simulator, during
    the capture; random ops there (a sampler's `torch.multinomial`) would draw from the step's
    generator, and the replay that serves the step would then draw other numbers than eager does
    after the same seed. Work run to set a graph up must leave the generators to the step, as torch's
    own CUDA-graph recordings do (`torch/_inductor/cudagraph_trees.py` records under
    `torch._dynamo.utils.preserve_rng_state`, and so does torch_npu's `torch_npu/npu/_graph_tree.py`).
    """
    with _disable_current_modes():
        cpu = torch.random.get_rng_state()
        on_device = device_module.get_rng_state(device) if device_module is not None else None
    try:
        yield
    finally:
        with _disable_current_modes():
            torch.random.set_rng_state(cpu)
            if on_device is not None:
                device_module.set_rng_state(on_device, device)


class TaskHandle:
    """Opaque handle to a captured task group, returned by `Runtime.task_group_end`."""


class ExternalEvent(abc.ABC):
    """An event a graph waits on, recorded from outside it (the update stream)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Inside capture: make the graph wait here until the event is recorded."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Inside capture: clear the event so the next replay waits for a fresh record."""

    @abc.abstractmethod
    def record(self) -> None:
        """Outside capture (after an update): release the graph's wait."""


class DeviceGraph(abc.ABC):
    """One captured graph."""

    @abc.abstractmethod
    def capture(self) -> ContextManager[None]:
        """Context in which the ops issued are recorded into this graph."""

    @abc.abstractmethod
    def replay(self) -> None:
        """Launch the recorded work. May return before it finishes: call `Runtime.synchronize`."""

    #: Whether `warmup` runs the work (then an op that ran there and fails in the capture is one the
    #: device cannot capture).
    warms_up: bool = False

    def warmup(self, run: Callable[[], Any]) -> None:
        """Before `capture`: run the work eagerly where the device needs that (CUDA initialises
        libraries and compiles kernels lazily, which must not happen inside a capture). By default
        nothing: a simulator or ACL graph records ops as they come."""


class Runtime(abc.ABC):
    """A device the runner can stage static memory on and run kernels on.

    What else a runtime can do is its type: a `GraphRuntime` captures and replays graphs, a
    `TaskUpdateRuntime` also re-issues the host arguments of captured kernels before a replay. A
    runtime offers only what it supports; callers ask with `isinstance`.
    """

    name: str = "base"

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The torch device tensors of this runtime live on."""

    @abc.abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Static memory owned by the caller for as long as it holds the tensor."""

    #: How many times the host waited for the device (`synchronize`): the runner's `synchronizes` stat.
    synchronizes: int = 0

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all launched work, replays included (and count it in `synchronizes`)."""

    def kernel(self, op: Any) -> Callable[..., Any]:
        """The callable that runs an op of a graph on this runtime (warmed up, captured, and for
        kernels re-issued in task updates). By default the op itself; a runtime binding a vendor API
        returns its binding (an `ascend` op whose reference body a device could not capture)."""
        return op

    #: Whether `verify` checks this runtime's first replays by default: the devices, where no test
    #: of the project ran, do; the simulator, whose tests compare every step with eager, does not.
    verify_first_replays: bool = False

    def generators_kept(self) -> ContextManager[None]:
        """The random generators this runtime's work draws from, put back when the block ends (the CPU
        generator; device runtimes add their device's)."""
        return generators_kept()

    def weak_alias(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor on the same memory that does not keep it allocated (as vLLM's `weak_ref_tensors`).

        Update tables hold the captured kernels' arguments this way: the addresses the tasks read,
        without pinning memory the graph pool may hand to later allocations of the same capture.
        """
        return tensor

    def describe(self) -> dict[str, Any]:
        """What the dump records about this runtime."""
        return {"name": self.name, "device": str(self.device), "graphs": isinstance(self, GraphRuntime),
                "task_updates": isinstance(self, TaskUpdateRuntime)}


class GraphRuntime(Runtime):
    """A runtime that captures device graphs; its kernels read lengths on the device (no updates)."""

    @abc.abstractmethod
    def graph(self, label: str = "") -> DeviceGraph:
        """A new, empty graph whose captures share this runtime's graph memory pool (`label`: the
        runner's name for it, in the runtime's errors)."""

    def graph_budget(self) -> tuple[int | None, str]:
        """The most graphs this device can hold captured (None: no limit known), and where that figure
        comes from (`lowering/budget.py` fits a compile's graphs to it). By default none: a CUDA graph
        holds no stream of its own."""
        return None, "no limit known for this runtime"

    def after_replay(self) -> None:
        """After a replay (and its updates): make its results ready for what the host issues next.
        By default `synchronize`; a device whose later work is ordered on the same stream needs nothing."""
        self.synchronize()

    def after_piece(self) -> None:
        """After a piece's replay, before the host issues what reads its results (the eager nodes
        between pieces): nothing on a device, where that work queues behind the replay on the same
        stream (vLLM-Ascend's PIECEWISE replays do not synchronize either:
        `need_sync = self.runtime_mode == CUDAGraphMode.FULL`, vllm_ascend/compilation/acl_graph.py).
        The simulator, which runs eager ops on the host as they are issued, runs the stream first."""

    def after_piecewise_step(self) -> None:
        """At the end of a piecewise step, before the caller reads its outputs: `after_piece`."""
        self.after_piece()

    def replay_failed(self) -> None:
        """After a replay, its updates or the wait for it raised (the runner drops that graph): forget
        what the runtime carries from one replay to the next. By default nothing."""


class TaskUpdateRuntime(GraphRuntime):
    """A graph runtime whose kernels take host-side lengths frozen at capture, refreshed before each
    replay by task updates, ordered by external events (Ascend's ACL graphs; the simulator)."""

    #: Whether a task update stays in the graph for every later replay, so that a task whose host
    #: arguments are unchanged need not be re-issued. ACL graphs: torch_npu re-issues the op between
    #: `graph_task_update_begin` and `graph_task_update_end` (`npu/graphs.py`), which rewrites the
    #: captured task's parameters (`aclmdlRICaptureTaskUpdateBegin/End`), not one replay's; the
    #: simulator rebinds the task's operands (`tasks.OpTask.rebind`).
    task_updates_persist: bool = True

    @abc.abstractmethod
    def event(self, name: str) -> ExternalEvent:
        """A new external event; `name` appears in errors (use the FX node's name)."""

    @abc.abstractmethod
    def task_group_begin(self) -> None:
        """Inside capture: start grouping the tasks issued next."""

    @abc.abstractmethod
    def task_group_end(self) -> TaskHandle:
        """Inside capture: close the group and return its handle."""

    @abc.abstractmethod
    def task_update_begin(self, handle: TaskHandle) -> None:
        """Outside capture: the ops issued next replace the group's tasks (same number, same kinds)."""

    @abc.abstractmethod
    def task_update_end(self) -> None:
        """Finish the update started by `task_update_begin`."""

    @contextlib.contextmanager
    def task_update(self, handle: TaskHandle) -> Iterator[None]:
        """`task_update_begin` / `task_update_end` as a context."""
        self.task_update_begin(handle)
        try:
            yield
        finally:
            self.task_update_end()
