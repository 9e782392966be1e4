"""The runtime without graphs: bucket graphs run op by op, for devices with no graph runtime."""
from __future__ import annotations

import torch

from .base import DeviceGraph, ExternalEvent, Runtime, TaskHandle


class EagerRuntime(Runtime):
    """Allocates static buffers on a device and runs nothing as a graph."""

    name = "eager"
    supports_graphs = False
    needs_task_updates = False

    def __init__(self, device: torch.device) -> None:
        self._device = torch.device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self._device)

    def _no_graphs(self, what: str):
        raise RuntimeError(f"runtime: the eager runtime has no graphs ({what} is not available)")

    def graph(self) -> DeviceGraph:
        self._no_graphs("graph")

    def event(self, name: str) -> ExternalEvent:
        self._no_graphs("event")

    def task_group_begin(self) -> None:
        self._no_graphs("task_group_begin")

    def task_group_end(self) -> TaskHandle:
        self._no_graphs("task_group_end")

    def task_update_begin(self, handle: TaskHandle) -> None:
        self._no_graphs("task_update_begin")

    def task_update_end(self) -> None:
        self._no_graphs("task_update_end")

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
