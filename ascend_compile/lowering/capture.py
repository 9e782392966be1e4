"""Capture one bucket graph on a runtime and build its update table.

Each PA/FIA call is captured as: event wait, event reset, task group begin, the kernel, task group
end. The update table keeps, per kernel node (by name), the group's handle, its event, the frozen
host arguments and which host list refreshes each (`kernel_call.HostArg`); applying it re-issues
the kernel inside a task update with the step's lengths and records the event, so the graph's wait
releases (`UpdateSchedule`). Workspaces are the compiled artifact's slots, alive for its whole life
(`WorkspaceLifetime`). Any other op the runtime binds to a device kernel (`Runtime.kernel`, e.g.
the KV-cache write on torch_npu) is warmed up and captured as that kernel.

A runtime without task updates (CUDA) captures graphs whose kernels read lengths on the device
(`passes/device_lengths.py`): they need no update entries, and a host-length kernel is refused
there, since its lengths would stay frozen; a graph compiled by an inner compiler (inductor) is
captured as its compiled code. Before capturing, `DeviceGraph.warmup` may run the graph eagerly,
for devices that must not initialise (or compile) anything inside a capture.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from ..errors import AscendCompileError, CaptureError, HostSync, UncapturableOp
from ..passes.fx_utils import is_op
from ..passes.inner_compile import INNER_KEY
from ..passes.kernel_call import HostArg, HostSource, KernelCall, is_kernel, with_host_lengths
from ..runtime.base import ExternalEvent, GraphRuntime, Runtime, TaskHandle, TaskUpdateRuntime
from .capture_failures import device_resource_error

#: The tensor a workspace node stands for, in the graph being captured.
WorkspaceFor = Callable[[fx.Node], torch.Tensor]


class UpdateSchedule:
    """How captured kernels' host arguments stay current (DESIGN.md §4): in the graph, each kernel
    waits on an external event; after each launch, `apply` re-issues every kernel with the step's
    lengths in a task update and records its event, which releases the wait. Substitute a schedule
    (through `targets.Target.updates`) to change that; the tests reproduce DESIGN.md §7 case 2 so."""

    def guard(self, runtime: TaskUpdateRuntime, name: str) -> ExternalEvent | None:
        """Inside capture, before a kernel: the event it waits on (reset for the next replay)."""
        event = runtime.event(name)
        event.wait()
        event.reset()
        return event

    def apply(self, table: "UpdateTable", runtime: TaskUpdateRuntime, host: Mapping[HostSource, list[int]]) -> int:
        """After a launch: refresh every entry of `table` with the step's host lists."""
        return table.apply(runtime, host)


class WorkspaceLifetime:
    """Where a captured kernel's workspace lives: by default the compiled artifact's slot, allocated
    outside every graph pool and alive as long as the artifact, so nothing later can take its memory.
    Substitute one (through `targets.Target.workspaces`) to change that; the tests reproduce
    DESIGN.md §7 case 3 so."""

    def during_capture(self, runtime: GraphRuntime, slot: torch.Tensor, allocate: Callable[[], torch.Tensor]
                       ) -> torch.Tensor:
        """The tensor a workspace node gives the kernels captured with it (`allocate`: a fresh one
        from the graph pool, as the node itself would)."""
        return slot


@dataclasses.dataclass
class UpdateEntry:
    """One captured task group whose host arguments are refreshed before every replay."""

    node: str
    kernel: str
    handle: TaskHandle
    event: ExternalEvent | None
    op: Any  # the ascend kernel op
    impl: Callable[..., Any]  # what runs it on the runtime (`Runtime.kernel`)
    args: list[Any]  # the kernel's arguments, tensors as non-owning aliases
    frozen: dict[str, list[int]]  # host arguments as captured
    host_args: tuple[HostArg, ...]  # which host list refreshes each host argument

    def __post_init__(self) -> None:
        #: (position in `args`, host list) of each host argument, found once (not per step)
        refreshed = with_host_lengths(self.op, list(range(len(self.args))), {a.kernel_arg: a for a in self.host_args})
        self.positions = [(i, a.source) for i, a in enumerate(refreshed) if isinstance(a, HostArg)]
        self.sources = frozenset(source for _, source in self.positions)

    def arguments(self, host: Mapping[HostSource, list[int]]) -> list[Any]:
        """The kernel's arguments with the step's host lists in place of the captured ones."""
        args = list(self.args)
        for i, source in self.positions:
            args[i] = host[source]
        return args

    def describe(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "kernel": self.kernel,
            "event": self.event is not None,
            "frozen_at_capture": {k: list(v) for k, v in self.frozen.items()},
            "refresh": {a.kernel_arg: {"input": a.source.source, "conversion": a.source.conversion.value}
                        for a in self.host_args},
        }


class UpdateTable:
    """The update entries of one captured graph, keyed by kernel node name, and the host lists their
    tasks were last updated with (`issued`)."""

    def __init__(self) -> None:
        self.entries: dict[str, UpdateEntry] = {}
        self.sources: set[HostSource] = set()  # every entry's
        self.issued: dict[HostSource, list[int]] = {}

    def add(self, entry: UpdateEntry) -> None:
        if entry.node in self.entries:
            raise ValueError(f"node: {entry.node} captured twice in one graph")
        self.entries[entry.node] = entry
        self.sources |= entry.sources

    def apply(self, runtime: TaskUpdateRuntime, host: Mapping[HostSource, list[int]]) -> int:
        """Re-issue each entry with the step's host lists, and record its event; returns how many were
        re-issued. Where the runtime's task updates persist (`TaskUpdateRuntime.task_updates_persist`),
        an entry whose host lists all equal those last issued is not re-issued: its task already holds
        them (each list is compared once per step, not per layer). Soundness: `issued` is set only
        after every entry was issued, the table lives and dies with its captured graph (a capture or a
        failed replay makes a new one), and the event is recorded either way, so the replay waits for
        exactly what it waited for before."""
        changed = {s for s in self.sources if self.issued.get(s) != host[s]}
        persist = runtime.task_updates_persist and bool(self.issued)
        count = 0
        for entry in self.entries.values():
            if not persist or not entry.sources.isdisjoint(changed):
                with runtime.task_update(entry.handle):
                    entry.impl(*entry.arguments(host))
                count += 1
            if entry.event is not None:
                entry.event.record()
        self.issued = {s: list(host[s]) for s in self.sources}
        return count

    def describe(self) -> list[dict[str, Any]]:
        return [e.describe() for e in self.entries.values()]


class CaptureInterpreter(fx.Interpreter):
    """Runs a graph inside a capture, wrapping each kernel call for updates."""

    def __init__(self, gm: fx.GraphModule, runtime: GraphRuntime, table: UpdateTable, workspaces: WorkspaceFor,
                 schedule: UpdateSchedule, lifetime: WorkspaceLifetime, warmed_up: bool = False) -> None:
        super().__init__(gm)
        self.runtime = runtime
        self.table = table
        self.workspaces = workspaces
        self.schedule = schedule
        self.lifetime = lifetime
        self.warmed_up = warmed_up  # the graph ran eagerly on these inputs just before (`DeviceGraph.warms_up`)

    def run_node(self, n: fx.Node) -> Any:
        if is_op(n, torch.ops.ascend.workspace):
            return self.lifetime.during_capture(self.runtime, self.workspaces(n),
                                                lambda: fx.Interpreter.run_node(self, n))
        if is_kernel(n):
            return self._kernel(KernelCall.of(n))
        try:
            return run_bound(self, self.runtime, n)
        except RuntimeError as err:
            if self._uncapturable(n, err):
                raise UncapturableOp(n.name, n.target, err) from err
            raise

    def _uncapturable(self, n: fx.Node, err: RuntimeError) -> bool:
        """Whether `err`, raised by node `n` inside the capture, says its op cannot be captured: a host
        read the simulator refused (`HostSync`) in an op the runtime does not bind to a kernel, or,
        after an eager warm-up of the same graph on the same inputs ran it, any error of the device's
        own (on a device a capture refuses a host synchronisation with an error of its runtime)."""
        if n.op not in ("call_function", "call_method"):  # a tensor method (`.item()`): never a bound kernel
            return False
        if n.op == "call_function" and self.runtime.kernel(n.target) is not n.target or device_resource_error(err):
            return False  # a kernel of the device, or the device out of memory or streams: not the op's doing
        return isinstance(err, HostSync) or (self.warmed_up and not isinstance(err, AscendCompileError))

    def _kernel(self, call: KernelCall) -> Any:
        n = call.node
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if kwargs:
            raise ValueError(f"{n.name}: kernel nodes take positional arguments only")
        runtime = self.runtime
        if not call.meta.host_args:
            return runtime.kernel(n.target)(*args)
        if not isinstance(runtime, TaskUpdateRuntime):
            raise CaptureError(
                f"{n.name}: {n.target} takes host-side lengths, which a graph on runtime {runtime.name!r} "
                f"(no task updates) would freeze at their capture values; rewrite the graph with "
                f"passes.device_lengths.use_device_lengths so the kernel reads them on the device"
            )
        event = self.schedule.guard(runtime, n.name)
        impl = runtime.kernel(n.target)
        runtime.task_group_begin()
        result = impl(*args)
        handle = runtime.task_group_end()
        aliases = [runtime.weak_alias(a) if isinstance(a, torch.Tensor) else a for a in args]
        self.table.add(UpdateEntry(n.name, call.meta.kernel, handle, event, n.target, impl, aliases,
                                   call.host_lengths(args), call.meta.host_args))
        return result


class WarmupInterpreter(fx.Interpreter):
    """Runs a bucket graph eagerly with the runtime's bindings (`Runtime.kernel`), so the warm-up
    before a capture sets up the very kernels the capture records."""

    def __init__(self, gm: fx.GraphModule, runtime: Runtime) -> None:
        super().__init__(gm)
        self.runtime = runtime

    def run_node(self, n: fx.Node) -> Any:
        return run_bound(self, self.runtime, n)


def run_bound(interpreter: fx.Interpreter, runtime: Runtime, n: fx.Node) -> Any:
    """Run node `n` as `runtime` binds its op (`Runtime.kernel`: a device kernel in place of an op
    whose Python body a device graph could not record, e.g. the KV-cache write on torch_npu), or as
    the node itself."""
    if n.op == "call_function":
        impl = runtime.kernel(n.target)
        if impl is not n.target:
            args, kwargs = interpreter.fetch_args_kwargs_from_env(n)
            return impl(*args, **kwargs)
    return fx.Interpreter.run_node(interpreter, n)


def workspace_env(gm: fx.GraphModule, workspaces: WorkspaceFor) -> dict[fx.Node, torch.Tensor]:
    """An interpreter environment giving each `ascend.workspace` node its artifact-owned slot."""
    return {n: workspaces(n) for n in gm.graph.nodes if is_op(n, torch.ops.ascend.workspace)}


def capture_graph(gm: fx.GraphModule, runtime: GraphRuntime, args: Sequence[Any], workspaces: WorkspaceFor,
                  schedule: UpdateSchedule, lifetime: WorkspaceLifetime, label: str = "") -> tuple[Any, Any, UpdateTable]:
    """Capture `gm` on `runtime` with `args` into a graph the runner calls `label`; returns (device
    graph, static outputs, update table).

    A graph compiled by an inner compiler (`passes/inner_compile.py`) is captured as its compiled
    code, which holds no task groups: only a runtime without task updates can run it.
    """
    table = UpdateTable()
    graph = runtime.graph(label)
    inner = gm.meta.get(INNER_KEY)
    if inner is None:
        env = workspace_env(gm, workspaces)
        graph.warmup(lambda: WarmupInterpreter(gm, runtime).run(*args, initial_env=env))
        with graph.capture():
            outputs = CaptureInterpreter(gm, runtime, table, workspaces, schedule, lifetime, graph.warms_up).run(*args)
        return graph, outputs, table
    if isinstance(runtime, TaskUpdateRuntime):
        raise CaptureError(
            f"inner_compiler {inner.compiler!r}: its compiled graphs hold no task groups, which runtime "
            f"{runtime.name!r} needs for its updates"
        )
    graph.warmup(lambda: inner(args, workspaces))
    with graph.capture():
        outputs = inner(args, workspaces)
    return graph, outputs, table
