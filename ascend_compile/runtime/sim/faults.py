"""Captures the simulated device refuses: a stream budget, and faults a test injects.

A device refuses captures for reasons of its own, none of them the graph's: an ACL graph holds a stream
from `capture_begin` until it is freed, and a device has a budget of them, past which `capture_begin`
fails with ACL error 207008 (vLLM-Ascend caps its captures at 1,800 graphs for it, `vllm_ascend/utils.py`,
`update_aclgraph_sizes`); memory can run out inside a capture; `capture_end` can fail. The simulator
raises these as the device's runtime does, a plain `RuntimeError` (not one of this package's errors)
whose text is torch_npu's: `NPU function error: <call>, error code is <code>` then `[Error]: <text>`
(torch_npu 2.10.0.post4 `lib/libtorch_npu.so` holds the format, the calls
`c10_npu::acl::AclmdlRICaptureBegin(capture_stream_, capture_mode)` and
`c10_npu::acl::AclmdlRICaptureEnd(capture_stream_, &model_ri)`, and the text "Stream resources are
insufficient."), or torch's `OutOfMemoryError` ("NPU out of memory. Tried to allocate ...").
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Iterator

import torch

#: ACL's error code for a device out of streams (`capture_begin` past the stream budget).
STREAM_EXHAUSTED = 207008
CAPTURE_BEGIN = "c10_npu::acl::AclmdlRICaptureBegin(capture_stream_, capture_mode)"
CAPTURE_END = "c10_npu::acl::AclmdlRICaptureEnd(capture_stream_, &model_ri)"
#: Where a capture can fail: at `capture_begin`, inside it (at its first op), at `capture_end`.
PHASES = ("begin", "inside", "end")


def device_error(call: str, code: int, text: str) -> RuntimeError:
    """A device runtime's error as torch_npu raises it (`NPU_CHECK_ERROR`'s format)."""
    return RuntimeError(f"NPU function error: {call}, error code is {code}\n[Error]: {text}")


def streams_exhausted(label: str) -> RuntimeError:
    """`capture_begin` refused: no stream left (the device's budget is spent)."""
    return device_error(CAPTURE_BEGIN, STREAM_EXHAUSTED,
                        "Stream resources are insufficient.\n        Check whether the number of streams meets the "
                        "requirements by referring to the description of the acl.rt.create_stream interface.")


def capture_begin_failed(label: str) -> RuntimeError:
    """`capture_begin` refused for a reason of that one capture (ACL's 507000, an internal error), not the
    device's streams: the graphs after it are still tried."""
    return device_error(CAPTURE_BEGIN, 507000, "Internal errors occur in the runtime module.")


def out_of_memory(label: str) -> RuntimeError:
    """An allocation inside the capture refused: the device's memory is spent."""
    return torch.OutOfMemoryError(f"NPU out of memory. Tried to allocate 2.00 MiB while capturing {label or 'a graph'}")


def capture_end_failed(label: str) -> RuntimeError:
    """`capture_end` refused (an invalidated capture; ACL's 507000, an internal error)."""
    return device_error(CAPTURE_END, 507000, "Internal errors occur in the runtime module.")


#: The device's error of each phase, by default: a fault of one capture (out of streams is the budget's,
#: or injected with `error=streams_exhausted`: after it, the runner tries no new graph).
DEFAULT_ERRORS: dict[str, Callable[[str], RuntimeError]] = {
    "begin": capture_begin_failed, "inside": out_of_memory, "end": capture_end_failed}


@dataclasses.dataclass(frozen=True)
class CaptureFault:
    """Fail every capture of the graph labelled `label` (the runner's name for it, e.g. "b4.decode",
    "p16 piece 0"; None: any), among those past the first `after` captures of the runtime (None: any),
    at `phase`, with `error(label)`."""

    label: str | None
    after: int | None
    phase: str
    error: Callable[[str], RuntimeError]

    def matches(self, label: str, ordinal: int) -> bool:
        """Whether the `ordinal`th capture (from 1), of the graph labelled `label`, fails here."""
        return (self.label is None or self.label == label) and (self.after is None or ordinal > self.after)


class CaptureFaults:
    """What makes the simulated device refuse a capture: its stream budget (`budget`: the streams
    captured graphs may hold, None: no limit) and the faults a test injected (`inject`)."""

    def __init__(self, budget: int | None) -> None:
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"stream_budget: expected a positive int or None (no limit), got {budget!r}")
        self.budget = budget
        self.held = 0  # streams held by captured graphs (and the one being captured)
        self.captures = 0  # captures begun
        self.faults: list[CaptureFault] = []

    def inject(self, label: str | None = None, after: int | None = None, phase: str = "begin",
               error: Callable[[str], RuntimeError] | None = None) -> CaptureFault:
        """Fail the captures `CaptureFault` says, with `error` (default: the device's error of the phase)."""
        if phase not in PHASES:
            raise ValueError(f"phase: expected one of {list(PHASES)}, got {phase!r}")
        fault = CaptureFault(label, after, phase, error or DEFAULT_ERRORS[phase])
        self.faults.append(fault)
        return fault

    @contextlib.contextmanager
    def capture(self, graph: Any) -> Iterator[RuntimeError | None]:
        """Around the capture of `graph` (its `label`, the runner's name for it): at `capture_begin` raise
        what the device would (out of streams, an injected fault), else take a stream; yield the fault to
        raise inside the capture, if any; at `capture_end`, raise an injected fault. A capture that fails
        gives its stream back; a captured graph, when it is freed."""
        label = graph.label
        self.captures += 1
        fault = self._fault(label, "begin")
        if fault is not None:
            raise fault
        if self.budget is not None and self.held >= self.budget:
            raise streams_exhausted(label)
        self.held += 1
        try:
            yield self._fault(label, "inside")
            fault = self._fault(label, "end")
            if fault is not None:
                raise fault
        except BaseException:
            self.release()
            raise
        weakref.finalize(graph, self.release)

    def release(self) -> None:
        """A captured graph freed, or a capture failed after `begin`: its stream back to the budget."""
        self.held -= 1

    def _fault(self, label: str, phase: str) -> RuntimeError | None:
        found = next((f for f in self.faults if f.phase == phase and f.matches(label, self.captures)), None)
        return None if found is None else found.error(label)
