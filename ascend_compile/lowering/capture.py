"""Capture one bucket graph on a runtime and build its update table.

Each PA/FIA call is captured as: event wait, event reset, task group begin, the kernel, task group
end. The update table keeps, per kernel node (by name), the group's handle, its event, the frozen
host arguments and which runner input refreshes each; applying it re-issues the kernel inside a
task update with the step's lengths and records the event, so the graph's wait releases.
Workspaces are the compiled artifact's slots, alive for its whole life.

A runtime without task updates (CUDA) captures graphs whose kernels read lengths on the device
(`passes/device_lengths.py`): they need no update entries, and a host-length kernel is refused
there, since its lengths would stay frozen; a graph compiled by an inner compiler (inductor) is
captured as its compiled code. Before capturing, `DeviceGraph.warmup` may run the graph eagerly,
for devices that must not initialise (or compile) anything inside a capture.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx

from ..errors import CaptureError
from ..passes.fx_utils import is_op
from ..passes.inner_compile import INNER_KEY
from ..passes.workspaces import KERNEL_OPS
from ..runtime.base import ExternalEvent, Runtime, TaskHandle

#: Positions of the host-list arguments of each kernel.
HOST_ARG_INDEX = {
    torch.ops.ascend.paged_attention: {"context_lens": 4},
    torch.ops.ascend.fused_infer_attention: {"actual_seq_lengths": 4, "actual_seq_lengths_kv": 5},
}


@dataclasses.dataclass
class LegacyBehaviour:
    """Test-only switches that force the historical bugs of DESIGN.md §7 back in."""

    skip_task_updates: bool = False  # case 2: replay with the lengths frozen at capture
    skip_event_waits: bool = False  # case 2: ... and no event to catch it
    weakref_workspace: bool = False  # case 3: workspace allocated in capture, held by a weak ref


LEGACY = LegacyBehaviour()


@contextlib.contextmanager
def legacy(**switches: bool) -> Iterator[None]:
    """Force historical behaviour for the duration of a test."""
    saved = dataclasses.replace(LEGACY)
    for name, value in switches.items():
        if not hasattr(LEGACY, name):
            raise ValueError(f"{name}: unknown legacy switch; known: {[f.name for f in dataclasses.fields(LEGACY)]}")
        setattr(LEGACY, name, value)
    try:
        yield
    finally:
        for field in dataclasses.fields(LEGACY):
            setattr(LEGACY, field.name, getattr(saved, field.name))


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
    refresh: dict[str, tuple[str, str]]  # kernel argument -> (runner input, conversion)

    def describe(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "kernel": self.kernel,
            "event": self.event is not None,
            "frozen_at_capture": {k: list(v) for k, v in self.frozen.items()},
            "refresh": {k: {"input": src, "conversion": kind} for k, (src, kind) in self.refresh.items()},
        }


class UpdateTable:
    """The update entries of one captured graph, keyed by kernel node name."""

    def __init__(self) -> None:
        self.entries: dict[str, UpdateEntry] = {}

    def add(self, entry: UpdateEntry) -> None:
        if entry.node in self.entries:
            raise ValueError(f"node: {entry.node} captured twice in one graph")
        self.entries[entry.node] = entry

    def apply(self, runtime: Runtime, host: Callable[[str, str], list[int]]) -> int:
        """Re-issue every entry with the step's host lists (`host(input, conversion)`); returns the count."""
        if LEGACY.skip_task_updates:
            return 0
        for entry in self.entries.values():
            args = list(entry.args)
            index = HOST_ARG_INDEX[entry.op.overloadpacket]
            for name, (source, kind) in entry.refresh.items():
                args[index[name]] = host(source, kind)
            with runtime.task_update(entry.handle):
                entry.impl(*args)
            if entry.event is not None:
                entry.event.record()
        return len(self.entries)

    def describe(self) -> list[dict[str, Any]]:
        return [e.describe() for e in self.entries.values()]


class CaptureInterpreter(fx.Interpreter):
    """Runs a bucket graph inside a capture, wrapping each kernel call for updates."""

    def __init__(
        self,
        gm: fx.GraphModule,
        runtime: Runtime,
        table: UpdateTable,
        workspaces: Callable[[fx.Node], torch.Tensor],
    ) -> None:
        super().__init__(gm)
        self.runtime = runtime
        self.table = table
        self.workspaces = workspaces

    def run_node(self, n: fx.Node) -> Any:
        if is_op(n, torch.ops.ascend.workspace):
            return self._workspace(n)
        if any(is_op(n, op) for op in KERNEL_OPS):
            return self._kernel(n)
        return super().run_node(n)

    def _workspace(self, n: fx.Node) -> torch.Tensor:
        if not LEGACY.weakref_workspace:
            return self.workspaces(n)
        owned = super().run_node(n)
        return self.runtime.weak_alias(owned)

    def _kernel(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if kwargs:
            raise ValueError(f"{n.name}: kernel nodes take positional arguments only")
        runtime = self.runtime
        if not runtime.needs_task_updates:
            raise CaptureError(
                f"{n.name}: {n.target} takes host-side lengths, which a graph on runtime {runtime.name!r} "
                f"(no task updates) would freeze at their capture values; rewrite the graph with "
                f"passes.device_lengths.use_device_lengths so the kernel reads them on the device"
            )
        event = None
        if not LEGACY.skip_event_waits:
            event = runtime.event(n.name)
            event.wait()
            event.reset()
        impl = runtime.kernel(n.target)
        runtime.task_group_begin()
        result = impl(*args)
        handle = runtime.task_group_end()
        index = HOST_ARG_INDEX[n.target.overloadpacket]
        frozen = {name: list(args[i]) for name, i in index.items()}
        aliases = [runtime.weak_alias(a) if isinstance(a, torch.Tensor) else a for a in args]
        refresh = {name: tuple(n.meta["ascend_host_args"][name]) for name in index}
        self.table.add(
            UpdateEntry(n.name, n.meta["ascend_kernel"]["kernel"], handle, event, n.target, impl, aliases, frozen, refresh)
        )
        return result


class WarmupInterpreter(fx.Interpreter):
    """Runs a bucket graph eagerly with the runtime's kernels (`Runtime.kernel`), so the warm-up
    before a capture sets up the very kernels the capture records."""

    def __init__(self, gm: fx.GraphModule, runtime: Runtime) -> None:
        super().__init__(gm)
        self.runtime = runtime

    def run_node(self, n: fx.Node) -> Any:
        if any(is_op(n, op) for op in KERNEL_OPS):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return self.runtime.kernel(n.target)(*args, **kwargs)
        return super().run_node(n)


def workspace_env(gm: fx.GraphModule, workspaces: Callable[[fx.Node], torch.Tensor]) -> dict[fx.Node, torch.Tensor]:
    """An interpreter environment giving each `ascend.workspace` node its artifact-owned slot."""
    return {n: workspaces(n) for n in gm.graph.nodes if is_op(n, torch.ops.ascend.workspace)}


def capture_graph(
    gm: fx.GraphModule,
    runtime: Runtime,
    args: Sequence[Any],
    workspaces: Callable[[fx.Node], torch.Tensor],
) -> tuple[Any, Any, UpdateTable]:
    """Capture `gm` on `runtime` with `args`; returns (device graph, static outputs, update table).

    A graph compiled by an inner compiler (`passes/inner_compile.py`) is captured as its compiled
    code, which holds no task groups: only a runtime without task updates can run it.
    """
    table = UpdateTable()
    graph = runtime.graph()
    inner = gm.meta.get(INNER_KEY)
    if inner is None:
        env = workspace_env(gm, workspaces)
        graph.warmup(lambda: WarmupInterpreter(gm, runtime).run(*args, initial_env=env))
        with graph.capture():
            outputs = CaptureInterpreter(gm, runtime, table, workspaces).run(*args)
        return graph, outputs, table
    if runtime.needs_task_updates:
        raise CaptureError(
            f"inner_compiler {inner.compiler!r}: its compiled graphs hold no task groups, which runtime "
            f"{runtime.name!r} needs for its updates"
        )
    graph.warmup(lambda: inner(args, workspaces))
    with graph.capture():
        outputs = inner(args, workspaces)
    return graph, outputs, table
