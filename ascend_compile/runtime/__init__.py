"""Device graph runtimes: the CPU ACL-graph simulator, Ascend NPUs (torch_npu), CUDA graphs, and eager (no graphs)."""
from __future__ import annotations

import logging

import torch

from .base import Runtime

log = logging.getLogger("ascend_compile")


def resolve_runtime(name: str, device: torch.device) -> str:
    """The runtime `name` means for tensors on `device`: "auto" is "npu" for tensors on an NPU when
    torch_npu imports and reports a device, else the simulator on CPU, cuda on CUDA, else eager."""
    if name != "auto":
        return name
    from . import npu

    device = torch.device(device)
    if device.type == npu.NPU_DEVICE_TYPE and npu.available():
        return "npu"
    if device.type == "cpu":
        return "sim"
    if device.type == "cuda":
        return "cuda"
    log.warning("ascend_compile: no graph runtime for device %s yet: bucket graphs run eagerly", device)
    return "eager"


def create_runtime(name: str, device: torch.device, sim_overflow: str = "write") -> Runtime:
    """The runtime `name` (resolved by `resolve_runtime`) for tensors on `device`."""
    device = torch.device(device)
    name = resolve_runtime(name, device)
    if name == "sim":
        if device.type != "cpu":
            raise ValueError(f"runtime: the simulator runs on the CPU, but the graph's tensors are on {device}")
        from .sim import SimRuntime

        return SimRuntime(overflow=sim_overflow)
    if name == "npu":
        from .npu import NpuRuntime

        return NpuRuntime(device)
    if name == "cuda":
        from .cuda import CudaRuntime

        return CudaRuntime(device)
    if name == "eager":
        from .eager import EagerRuntime

        return EagerRuntime(device)
    raise ValueError(f"runtime: unknown runtime {name!r}")
