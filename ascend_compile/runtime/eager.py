"""The runtime without graphs: bucket graphs run op by op, for devices with no graph runtime."""
from __future__ import annotations

import torch

from .base import Runtime


class EagerRuntime(Runtime):
    """Allocates static buffers on a device and runs nothing as a graph."""

    name = "eager"

    def __init__(self, device: torch.device) -> None:
        self._device = torch.device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self._device)

    def synchronize(self) -> None:
        self.synchronizes += 1
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
