"""A capture that fails for a device reason costs that one graph, never the server (issue 48, item 2).

The device can refuse a capture for reasons that are not the graph's: no stream left at `capture_begin`
(ACL error 207008, "Stream resources are insufficient", which vLLM-Ascend special-cases there), memory
run out inside the capture, an error at `capture_end`. Such a graph is not captured: its steps are served
piecewise where a piecewise graph holds them, else eagerly (the runner's `_not_full`), one WARNING says
so, `stats["failed_captures"]` counts it, and every other graph keeps being captured and replayed. Each
graph is tried once: a budget that ran out fails each later capture at its `capture_begin`, and no step.

With several ranks (tensor parallel), every rank must serve a step the same way: a graph captured on
one rank and not on another would issue its collectives in other launches (and, on a device, other
streams). So after each capture of a graph holding collectives, its ranks agree: the capture stands
only where it succeeded on every rank of each process group its collectives name (one all-reduce of a
flag per group and capture, at start-up only). Collectives a custom op hides in its body (no group
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


def device_error(err: BaseException) -> bool:
    """Whether `err` is the device runtime's own error (not one of this package's, nor a Python one)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and not isinstance(err, AscendCompileError) and bool(DEVICE_ERROR.search(str(err)))


def device_resource_error(err: BaseException) -> bool:
    """Whether `err` says the device ran out of memory or streams: inside a capture, not the op's fault."""
    return device_error(err) and (isinstance(err, torch.OutOfMemoryError) or bool(RESOURCE_ERROR.search(str(err))))


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


def agreed_failure(failed: bool, groups: list[Any], device: torch.device) -> bool:
    """Whether a capture failed on any rank of `groups` (this rank's `failed` included): one all-reduce
    (max) of a flag per group, the same calls in the same order on every rank."""
    import torch.distributed as dist

    for group in groups:
        flag = torch.tensor([int(failed)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        failed = bool(flag.item())
    return failed


class CaptureFailures:
    """The graphs of one compiled artifact whose capture failed for a device reason, and why."""

    def __init__(self, stats: Any, device: torch.device) -> None:
        self.stats = stats
        self.device = device
        self.graphs: dict[str, str] = {}  # graph name -> why it serves no step

    def device_failure(self, name: str, bucket: int, specialization: tuple, err: RuntimeError) -> RuntimeError:
        """`err`, raised by the capture of graph `name` (bucket `bucket`, keeping `specialization`'s sizes as
        seen), where it is the device's own error; else it is raised again, or, where the graph keeps sizes
        as seen, `specialization_error` in its place."""
        if device_error(err):
            return err
        if isinstance(err, AscendCompileError) or not specialization:
            raise err
        raise specialization_error(name, bucket, specialization, err) from err

    def settle(self, name: str, gm: fx.GraphModule, error: BaseException | None) -> str | None:
        """After the capture of graph `name` (`gm`) ended with the device's `error` (None: it succeeded):
        why the graph serves no step (its capture failed here or on another rank of its collectives'
        groups: logged once, counted), or None where it stands."""
        groups = collective_groups(gm)
        failed = agreed_failure(error is not None, groups, self.device) if groups else error is not None
        if not failed:
            return None
        if error is not None:
            why = f"{name}: its capture failed on the device ({first_line(error)})"
        else:
            why = f"{name}: its capture failed on another rank of its collectives' groups"
        self.graphs[name] = why
        self.stats["failed_captures"] += 1
        log.warning("ascend_compile: %s: its steps are served piecewise or eagerly; every other graph is still "
                    "captured", why)
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
