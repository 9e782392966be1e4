"""Functional collectives in flight on the ACL-graph simulator (`runtime/sim.py`).

A functional collective (`_c10d_functional`) returns before its work is done, and c10d keys that
work by the output's storage: on the device its output reaches its captured address only when the
work completes, at the graph's `wait_tensor` of it or at the end of the graph. `InFlight` holds
those outputs until then. It is its own module because capture, replay and the kernel launch all
deliver into it and complete from it, and none of them owns it.
"""
from __future__ import annotations

from typing import Any

import torch

from .sim_tasks import _completes_at_wait


class InFlight:
    """Outputs of functional collectives not yet delivered, keyed by their captured address."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def deliver(self, op: Any, result: torch.Tensor, dst: torch.Tensor) -> None:
        """Put a fresh output of `op` at its captured address `dst`: at once, or, for a functional
        collective, when it completes (the result is not written before then)."""
        if _completes_at_wait(op):
            self._pending[dst.data_ptr()] = (result, dst)
        else:
            dst.copy_(result)

    def complete(self, tensor: torch.Tensor) -> None:
        """Wait for the collective in flight to `tensor`'s address, if any, and deliver its output."""
        pending = self._pending.pop(tensor.data_ptr(), None)
        if pending is not None:
            result, dst = pending
            torch.ops._c10d_functional.wait_tensor(result)
            dst.copy_(result)

    def complete_all(self) -> None:
        """Complete every collective still in flight: the end of a graph joins its work, as on the device."""
        for _, dst in list(self._pending.values()):
            self.complete(dst)
