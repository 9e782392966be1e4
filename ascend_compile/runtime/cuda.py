"""The CUDA runtime: `torch.cuda.CUDAGraph` per bucket, one memory pool shared by every bucket.

Kernels on CUDA read sequence lengths from device buffers (`passes/device_lengths.py`), so a
captured graph needs no task updates: the runner's copy of each step's inputs into the graph's
static buffers is the whole update, one copy per input per step. Task groups, task updates and
external events are therefore not offered (it is a `GraphRuntime`, not a `TaskUpdateRuntime`).

Graphs of different buckets never replay at once, and each keeps its outputs alive, so they share
one graph memory pool: what one capture freed, a later one may reuse. Each capture runs on a side
stream after warm-up runs there, as PyTorch recommends, so lazy initialisation (library handles,
Triton compilation) happens before the capture, not inside it.

Random ops (a sampler's `multinomial`): `CUDAGraph.capture_begin` registers the default CUDA
generator of the current device with the graph (in C++, `aten/src/ATen/cuda/CUDAGraph.cpp`; other
generators need `CUDAGraph.register_generator_state`); during capture a philox kernel takes its seed
and offset from device tensors and advances only an intra-graph offset, and each replay first writes
the generator's current seed and offset there and advances the generator by the graph's total, so
every replay draws fresh numbers and the capture advances no eager state. The warm-up runs are eager
and would: they, and the capture (on the runtime's device, whose generator then is the one
registered), run under `generators_kept`, as inductor records its CUDA graphs under
`preserve_rng_state` and `torch.cuda.device` (`torch/_inductor/cudagraph_trees.py`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

import torch

from .base import DeviceGraph, GraphRuntime, generators_kept

#: Eager runs of a bucket graph on the capture stream before its capture (as
#: `torch.cuda.make_graphed_callables` does by default).
WARMUP_RUNS = 3


class CudaGraph(DeviceGraph):
    """One `torch.cuda.CUDAGraph`, captured on the runtime's side stream into its shared pool."""

    warms_up = True

    def __init__(self, runtime: "CudaRuntime") -> None:
        self.runtime = runtime
        self.graph = torch.cuda.CUDAGraph()

    def warmup(self, run: Callable[[], Any]) -> None:
        """`WARMUP_RUNS` eager runs on the capture stream, leaving the generators to the step."""
        stream = self.runtime.stream
        stream.wait_stream(torch.cuda.current_stream(self.runtime.device))
        with self.runtime.generators_kept(), torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                run()
        torch.cuda.current_stream(self.runtime.device).wait_stream(stream)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Capture on the runtime's device (the generator `capture_begin` registers is the current
        device's), stream and pool."""
        rt = self.runtime
        with rt.generators_kept(), torch.cuda.device(rt.device), \
                torch.cuda.graph(self.graph, pool=rt.pool, stream=rt.stream):
            yield

    def replay(self) -> None:
        self.graph.replay()


class CudaRuntime(GraphRuntime):
    """CUDA graphs on one device; the kernels read lengths on the device, so no task updates."""

    name = "cuda"
    verify_first_replays = True

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

    def graph(self, label: str = "") -> CudaGraph:
        """A new graph on the runtime's side stream and pool (`label`: the runner's name for it, unused by CUDA)."""
        return CudaGraph(self)

    def generators_kept(self) -> ContextManager[None]:
        """The CPU generator and this device's default CUDA generator, put back when the block ends
        (set outside any capture: `set_rng_state` is refused while capturing)."""
        return generators_kept(torch.cuda, self._device)

    def synchronize(self) -> None:
        self.synchronizes += 1
        torch.cuda.synchronize(self._device)

    def after_replay(self) -> None:
        """Nothing: the copies out of the graph's outputs run after it on the same stream, so the host
        never waits for the device within a step."""

    def describe(self) -> dict[str, Any]:
        return super().describe() | {
            "device_name": torch.cuda.get_device_name(self._device),
            "sms": self.num_sms,
        }
