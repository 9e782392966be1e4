"""Functional collectives in flight on the ACL-graph simulator.

A functional collective (`_c10d_functional`) returns before its work is done, and c10d keys that
work by the output's storage: on the device its output reaches its captured address only when the
work completes, at the graph's `wait_tensor` of it or at the end of the graph. `InFlight` holds
those outputs until then. It is its own module because capture, replay and the kernel launch all
deliver into it and complete from it, and none of them owns it. Source: torch's functional
collectives return an `AsyncCollectiveTensor` whose value is defined only after `wait_tensor`
(`torch/distributed/_functional_collectives.py`); the poison before it is the model of HCCL
running asynchronously on its own stream.
"""
from __future__ import annotations

from typing import Any

import torch

from .classify import completes_at_wait


class InFlight:
    """Outputs of functional collectives not yet delivered, keyed by their captured address."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def deliver(self, op: Any, result: torch.Tensor, dst: torch.Tensor) -> None:
        """Put a fresh output of `op` at its captured address `dst`: at once, or, for a functional
        collective, when it completes. Until then `dst` holds poison, whatever the CPU backend's
        timing: gloo has the result by now, an asynchronous HCCL/NCCL collective would not, and a
        read before the wait must show up as garbage here as it would there."""
        if completes_at_wait(op):
            self._pending[dst.data_ptr()] = (result, dst)
            poison(dst)
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


def poison(t: torch.Tensor) -> None:
    """Fill `t` with what no real result holds: NaN for floating types, the smallest value for
    integers (True for booleans)."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).min)
