"""A capture that fails for a device reason costs that one graph, never the server (issue 48, item 2).

The device can refuse a capture for reasons that are not the graph's: no stream left at `capture_begin`
(ACL error 207008, "Stream resources are insufficient", which vLLM-Ascend special-cases there), memory
run out inside the capture, an error at `capture_end`. Such a graph is not captured: its steps are served
piecewise where a piecewise graph holds them, else eagerly (the runner's `_not_full`), one WARNING says
so, `stats["failed_captures"]` counts it, and every other graph keeps being captured and replayed.

A device out of streams (207008) stays out of them: each later `capture_begin` would fail the same way and
cost its seconds of warm-up. So after the first, no graph not yet captured is tried (`begin` raises
`NotTried`): one WARNING says so, and those graphs' steps are served on pieces already captured, else
eagerly (`stats["captures_not_tried"]`). A graph captured before and captured again (its inputs moved) is
still tried: its old graph, freed, gave its stream back.

With several ranks (tensor parallel), every rank must serve a step the same way: a graph captured on
one rank and not on another would issue its collectives in other launches (and, on a device, other
streams). So after each capture of a graph holding collectives, its ranks agree: the capture stands
only where it succeeded on every rank of each process group its collectives name (one all-reduce of a
outcome per group and capture, at start-up only: a rank out of streams makes every rank stop). Collectives a custom op hides in its body (no group
named in the graph) are not seen: those graphs decide per rank.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import fx

from ..errors import AscendCompileError, CaptureError

log = logging.getLogger("ascend_compile")

#: A device runtime's own errors: torch_npu's `NPU_CHECK_ERROR` ("NPU function error: <call>, error code
#: is <code>", torch_npu 2.10.0.post4 `lib/libtorch_npu.so`), torch's "CUDA error: ...", and running out
#: of device memory ("NPU out of memory", "CUDA out of memory", torch.OutOfMemoryError).
DEVICE_ERROR = re.compile(r"error code is \d+|CUDA error|out of memory")
#: Of those, the ones that say the device ran out of a resource (memory, streams): never an op's doing.
RESOURCE_ERROR = re.compile(r"out of memory|error code is 207008|Stream resources are insufficient")
#: Of those, the device out of streams (ACL's 207008 at `capture_begin`): every later capture would fail too.
STREAMS_OUT = re.compile(r"error code is 207008|Stream resources are insufficient")
#: A capture's outcome, agreed by the ranks as its maximum: it stood, it failed, the device's streams ran out.
STOOD, FAILED, STREAMS_RAN_OUT = 0, 1, 2


class NotTried(RuntimeError):
    """A capture not begun: the device's streams ran out at an earlier one (`CaptureFailures.begin`)."""


def device_error(err: BaseException) -> bool:
    """Whether `err` is the device runtime's own error (not one of this package's, nor a Python one)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and not isinstance(err, AscendCompileError) and bool(DEVICE_ERROR.search(str(err)))


def device_resource_error(err: BaseException) -> bool:
    """Whether `err` says the device ran out of memory or streams: inside a capture, not the op's fault."""
    return device_error(err) and (isinstance(err, torch.OutOfMemoryError) or bool(RESOURCE_ERROR.search(str(err))))


def streams_out(err: BaseException) -> bool:
    """Whether `err` says the device has no stream left for a graph (or is `NotTried` for that reason)."""
    return isinstance(err, NotTried) or (device_error(err) and bool(STREAMS_OUT.search(str(err))))


def first_line(err: BaseException) -> str:
    """`err`'s type and the first line of its message (a device error's text runs on for lines)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def collective_groups(gm: fx.GraphModule) -> list[Any]:
    """The process groups the graph's functional collectives name (`_c10d_functional` ops' `group_name`),
    in name order; none where torch.distributed is not initialised."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return []
    names = set()
    for node in gm.graph.nodes:
        op = node.target.default if isinstance(node.target, torch._ops.OpOverloadPacket) else node.target
        if node.op != "call_function" or getattr(op, "namespace", None) != "_c10d_functional":
            continue
        for i, arg in enumerate(op._schema.arguments):
            if arg.name == "group_name":
                names.add(node.args[i] if i < len(node.args) else node.kwargs[arg.name])
    return [dist.distributed_c10d._resolve_process_group(name) for name in sorted(names)]


def agreed_failure(outcome: int, groups: list[Any], device: torch.device) -> int:
    """A capture's worst outcome (`STOOD`, `FAILED`, `STREAMS_RAN_OUT`) over the ranks of `groups`, this
    rank's `outcome` included: one all-reduce (max) per group, the same calls in the same order on every rank."""
    import torch.distributed as dist

    for group in groups:
        flag = torch.tensor([outcome], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        outcome = int(flag.item())
    return outcome


class CaptureFailures:
    """The graphs of one compiled artifact whose capture failed for a device reason, and why."""

    def __init__(self, stats: Any, device: torch.device) -> None:
        self.stats = stats
        self.device = device
        self.graphs: dict[str, str] = {}  # graph name -> why it serves no step
        self.captured: set[str] = set()  # the graphs whose capture stood, once at least
        self.streams_out: str | None = None  # where the device's streams ran out: no new graph is tried

    def begin(self, name: str) -> None:
        """Before graph `name`'s capture: `NotTried` where the device's streams ran out at an earlier capture
        and `name` was never captured (a graph captured again gets the stream its old graph gave back)."""
        if self.streams_out is not None and name not in self.captured:
            raise NotTried(f"not tried: {self.streams_out}")

    def device_failure(self, name: str, bucket: int, specialization: tuple, err: RuntimeError) -> RuntimeError:
        """`err`, raised by the capture of graph `name` (bucket `bucket`, keeping `specialization`'s sizes as
        seen), where it is the device's own error; else it is raised again, or, where the graph keeps sizes
        as seen, `specialization_error` in its place."""
        if device_error(err) or isinstance(err, NotTried):
            return err
        if isinstance(err, AscendCompileError) or not specialization:
            raise err
        raise specialization_error(name, bucket, specialization, err) from err

    def settle(self, name: str, gm: fx.GraphModule, error: BaseException | None) -> str | None:
        """After the capture of graph `name` (`gm`) ended with the device's `error` (None: it succeeded):
        why the graph serves no step (its capture failed here or on another rank of its collectives'
        groups: logged once, counted; one `NotTried`: at DEBUG, counted apart), or None where it stands."""
        groups = collective_groups(gm)
        outcome = STOOD if error is None else STREAMS_RAN_OUT if streams_out(error) else FAILED
        outcome = agreed_failure(outcome, groups, self.device) if groups else outcome
        if outcome == STOOD:
            self.captured.add(name)
            return None
        if isinstance(error, NotTried):
            why = f"{name}: {error}"
            self.graphs[name] = why
            self.stats["captures_not_tried"] += 1
            log.debug("ascend_compile: %s", why)
            return why
        if error is not None:
            why = f"{name}: its capture failed on the device ({first_line(error)})"
        else:
            why = f"{name}: its capture failed on another rank of its collectives' groups"
        self.graphs[name] = why
        self.stats["failed_captures"] += 1
        rest = "every other graph is still captured"
        if outcome == STREAMS_RAN_OUT:
            self.streams_out = self.streams_out or f"the device's streams ran out at the capture of {name}"
            rest = "the device has no stream left: no graph not yet captured is tried again, their steps are " \
                   "served on pieces already captured, else eagerly"
        log.warning("ascend_compile: %s: its steps are served piecewise or eagerly; %s", why, rest)
        return why


def specialization_error(name: str, bucket: int, specialization: tuple, err: BaseException) -> CaptureError:
    """The error of a capture that failed (not for a device reason) in a graph keeping some step sizes as
    seen: the likely cause, a step size the model never equates with the token count, and its cure."""
    kept = ", ".join(f"{s}={v}" for s, v in specialization)
    return CaptureError(
        f"capturing {name} failed: the graph pads the step to {bucket} tokens and keeps "
        f"the sizes {kept} as seen; one of them may be a step size the model never equates with the "
        f"token count (e.g. positions [T, 1] beside ids [T] when every size is symbolic): name the step "
        f"dims (`ascend_compile.compile(model, options, step_dims=...)`). The capture's error: {err}"
    )
