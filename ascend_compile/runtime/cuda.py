"""The CUDA runtime: `torch.cuda.CUDAGraph` per bucket, one memory pool shared by every bucket.

Kernels on CUDA read sequence lengths from device buffers (`passes/device_lengths.py`), so a
captured graph needs no task updates: the runner's copy of each step's inputs into the graph's
static buffers is the whole update, one copy per input per step. Task groups, task updates and
external events are therefore not offered (it is a `GraphRuntime`, not a `TaskUpdateRuntime`).

Graphs of different buckets never replay at once, and each keeps its outputs alive, so they share
one graph memory pool: what one capture freed, a later one may reuse. Each capture runs on a side
stream after warm-up runs there, as PyTorch recommends, so lazy initialisation (library handles,
Triton compilation) happens before the capture, not inside it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from .base import DeviceGraph, GraphRuntime

#: Eager runs of a bucket graph on the capture stream before its capture (as
#: `torch.cuda.make_graphed_callables` does by default).
WARMUP_RUNS = 3


class CudaGraph(DeviceGraph):
    """One `torch.cuda.CUDAGraph`, captured on the runtime's side stream into its shared pool."""

    def __init__(self, runtime: "CudaRuntime") -> None:
        self.runtime = runtime
        self.graph = torch.cuda.CUDAGraph()

    def warmup(self, run: Callable[[], Any]) -> None:
        stream = self.runtime.stream
        stream.wait_stream(torch.cuda.current_stream(self.runtime.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                run()
        torch.cuda.current_stream(self.runtime.device).wait_stream(stream)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        with torch.cuda.graph(self.graph, pool=self.runtime.pool, stream=self.runtime.stream):
            yield

    def replay(self) -> None:
        self.graph.replay()


class CudaRuntime(GraphRuntime):
    """CUDA graphs on one device; the kernels read lengths on the device, so no task updates."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"runtime: the cuda runtime needs the graph's tensors on a CUDA device, got {device}")
        if not torch.cuda.is_available():
            raise ValueError("runtime: the cuda runtime needs CUDA, but torch.cuda.is_available() is False")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._device = torch.device("cuda", index)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_sms(self) -> int:
        """Streaming multiprocessors of the device (the split counts fill them)."""
        return torch.cuda.get_device_properties(self._device).multi_processor_count

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self._device)

    def graph(self) -> CudaGraph:
        return CudaGraph(self)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def after_replay(self) -> None:
        """Nothing: the copies out of the graph's outputs run after it on the same stream, so the host
        never waits for the device within a step."""

    def describe(self) -> dict[str, Any]:
        return super().describe() | {
            "device_name": torch.cuda.get_device_name(self._device),
            "sms": self.num_sms,
        }
