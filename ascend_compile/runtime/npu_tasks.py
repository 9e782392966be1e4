"""The handles of an ACL graph's task groups and the external events that order their updates, as the
Ascend runtime (`npu.py`) gives them to the update table."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import ExternalEvent, TaskHandle

if TYPE_CHECKING:
    from .npu import NpuGraph, NpuRuntime


class NpuTaskHandle(TaskHandle):
    """A captured task group: torch_npu's handle and the graph it belongs to."""

    def __init__(self, native: Any, graph: "NpuGraph", index: int) -> None:
        self.native = native
        self.graph = graph
        self.index = index

    def __repr__(self) -> str:
        return f"NpuTaskHandle({self.graph.name} group {self.index})"


class NpuEvent(ExternalEvent):
    """A `torch.npu.ExternalEvent`: waited on and reset by the graph on the capture stream,
    recorded by the task update on the update stream. `name` is the FX node's."""

    def __init__(self, runtime: "NpuRuntime", name: str) -> None:
        self._runtime = runtime
        self.name = name
        self.native = runtime.npu.ExternalEvent()

    def wait(self) -> None:
        """Inside capture: the graph waits here until the event is recorded."""
        self.native.wait(self._runtime.capture_stream)

    def reset(self) -> None:
        """Inside capture: clear the event so the next replay waits for a fresh record."""
        self.native.reset(self._runtime.capture_stream)

    def record(self) -> None:
        """After the task update, on the update stream: release the graph's wait."""
        self.native.record(self._runtime.update_stream)

    def __repr__(self) -> str:
        return f"NpuEvent({self.name!r})"
