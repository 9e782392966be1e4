"""Device graph runtimes: the CPU ACL-graph simulator, and eager (no graphs)."""
from __future__ import annotations

import logging

import torch

from .base import Runtime

log = logging.getLogger("ascend_compile")


def create_runtime(name: str, device: torch.device, sim_overflow: str = "write") -> Runtime:
    """The runtime `name` for tensors on `device` ("auto": the simulator on CPU, eager elsewhere)."""
    device = torch.device(device)
    if name == "auto":
        name = "sim" if device.type == "cpu" else "eager"
        if name == "eager":
            log.warning("ascend_compile: no graph runtime for device %s yet: bucket graphs run eagerly", device)
    if name == "sim":
        if device.type != "cpu":
            raise ValueError(f"runtime: the simulator runs on the CPU, but the graph's tensors are on {device}")
        from .sim import SimRuntime

        return SimRuntime(overflow=sim_overflow)
    if name == "eager":
        from .eager import EagerRuntime

        return EagerRuntime(device)
    raise ValueError(f"runtime: unknown runtime {name!r}")
