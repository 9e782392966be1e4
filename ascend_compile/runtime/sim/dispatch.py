"""Dispatch recording of the ACL-graph simulator: how ops become tasks.

A device graph records kernel launches instead of Python calls, so the simulator sits under the
dispatcher: `CaptureMode` (a `TorchDispatchMode`) runs each device kernel once during a capture and
records it as a task with its operands as addresses, fresh outputs placed in the graph pool;
`UpdateMode` records the ops of a task update without running them (outputs are empty stand-ins);
`HostReadGuard` (a `TorchFunctionMode`) refuses the host reads that bypass the dispatcher.

An op that is not a kernel of the runtime's device (`DeviceKernels.is_kernel`: a Python custom op,
say) is not a task: both modes run its body with themselves still on (`decompose`), so the ops the
body issues are recorded one by one, as a device captures the kernels an op launches. A host read
inside it then fails the capture naming the op, and a replay runs the recorded ops, never the body.

Both recordings freeze operands the same way (`record_operands`) and name tasks the same way
(`DeviceKernels.task_kind`), which is what lets a task update be matched against its group. Apart
from the runtime because it is the one part of the simulator that talks to the dispatcher.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ...errors import HostSync
from .classify import ALLOCATION_OPS, HOST_READ_METHODS, aliases_inputs, arg, is_cpu_dense, is_view, storage_id, syncs_host
from .kernels import DeviceKernels
from .launch import Launcher
from .memory import SimMemory
from .streams import SimStream
from .tasks import IssuedOp, OpTask, Recording
from .updates import SimTaskHandle


def record_operands(
    memory: SimMemory, kernels: DeviceKernels, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple, dict]:
    """A task's operands: tensors as addresses, host tensor inputs (`DeviceKernels.host_inputs`)
    as copies made now, when the call is issued, as torch_npu's ATB binding clones every CPU tensor
    input and its launch holds the clone (op-plugin `op_plugin/utils/custom_functions/atb/
    AtbCommon.cpp`, `ParamSetter::Input`): the caller may free or overwrite its tensor at once."""
    args, kwargs = pytree.tree_map(memory.describe, (args, kwargs))
    for name in kernels.host_input_args(op):
        key, value = arg(op, args, kwargs, name)
        if isinstance(value, torch.Tensor):
            with _disable_current_modes():
                copy = value.clone()
            if isinstance(key, int):
                args = (*args[:key], copy, *args[key + 1:])
            else:
                kwargs = {**kwargs, key: copy}
    return args, kwargs


#: Where an op's body is dispatched to when it is decomposed: the CPU kernel (the simulated device's
#: memory is CPU memory), below the Python key, so the op does not reach the mode again.
BODY_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def inside(enclosing: list[Any]) -> str:
    """" inside <op>" for the ops whose bodies are being recorded (innermost first), for errors."""
    if not enclosing:
        return ""
    chain = " inside ".join(str(op) for op in reversed(enclosing))
    return f" inside {chain} (not a kernel of this device: recorded as the ops its body issues)"


class HostReadGuard(TorchFunctionMode):
    """Refuses tensor-to-host conversions that bypass the dispatcher (`tolist`) `during` a capture
    (or a task update); `enclosing` is that recording's list of ops being decomposed, which the
    error names."""

    def __init__(self, enclosing: list[Any], during: str) -> None:
        super().__init__()
        self.enclosing = enclosing
        self.during = during

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in HOST_READ_METHODS:
            raise HostSync(
                f"Tensor.{func.__name__}(){inside(self.enclosing)} during {self.during}: a device graph "
                f"cannot copy device data to the host; do host conversions before capture (or before the "
                f"task update)"
            )
        return func(*args, **(kwargs or {}))


def decompose(mode: TorchDispatchMode, guard: HostReadGuard, func: Any, args: Any, kwargs: Any) -> Any:
    """Run `func`'s body with `mode` and `guard` on (a Python op's call left the guard off while it
    dispatched), so that `mode` sees, and records, each op the body issues and `guard` refuses its
    host conversions; `guard.enclosing` names `func` while it runs."""
    guard.enclosing.append(func)
    try:
        with guard, mode:
            return func.redispatch(BODY_KEYS, *args, **kwargs)
    finally:
        guard.enclosing.pop()


class CaptureMode(TorchDispatchMode):
    """Runs each device kernel once and records it as a task of `recording`, with fresh outputs in
    the graph pool; any other op is decomposed into the ops its body issues. Enter it inside its
    `guard`, which refuses host conversions for the whole capture.

    Source: a capture records "NPU work on the current stream" and a replay replays "the NPU work
    captured by this graph" (torch_npu 2.14 `npu/graphs.py`, `NPUGraph.capture_begin`, `replay`):
    kernel launches, not the Python that issued them. Host reads: "Ops that synchronize the CPU with
    the GPU (e.g., .item() calls) are prohibited" in a capture (PyTorch's CUDA Graphs notes,
    Constraints), which torch_npu's `NPUGraph`, a port of torch's `cuda/graphs.py`, inherits; a
    data-dependent output shape is such a synchronisation (the host must learn the size)."""

    def __init__(self, recording: Recording, memory: SimMemory, kernels: DeviceKernels, launcher: Launcher,
                 fault: RuntimeError | None = None) -> None:
        """`fault`: the device's error to raise at the capture's first op (`faults.py`), if any."""
        super().__init__()
        self.recording = recording
        self.memory = memory
        self.kernels = kernels
        self.launcher = launcher
        self.guard = HostReadGuard([], "graph capture")
        self.fault = fault

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.fault is not None:
            fault, self.fault = self.fault, None
            raise fault
        kwargs = kwargs or {}
        memory = self.memory
        if func in ALLOCATION_OPS:
            return pytree.tree_map_only(torch.Tensor, lambda t: memory.like(t, capturing=True), func(*args, **kwargs))
        if not self.kernels.is_kernel(func):
            return decompose(self, self.guard, func, args, kwargs)
        if syncs_host(func, args, kwargs) and any(
            memory.locate(t) is not None for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        ):
            raise HostSync(
                f"{func}{inside(self.guard.enclosing)} during graph capture reads device data on the host (.item(), "
                f"int(tensor), bool(tensor), a data-dependent output shape, ...); a device graph cannot "
                f"record a host synchronisation: move it out of the captured region"
            )
        if is_view(func):
            result = func(*args, **kwargs)
            if aliases_inputs(result, args, kwargs):
                return result
            # A "maybe view" op (reshape, contiguous, ... seen whole under inference mode) that
            # copied: it launches a kernel, so it is recorded like any other op.
        label = f"{self.recording.label()} ({func})"
        frozen_args, frozen_kwargs = record_operands(memory, self.kernels, func, args, kwargs)
        kind = self.kernels.task_kind(func, args, kwargs)
        result = self.launcher.launch(func, args, kwargs, label, capturing=True)
        inputs = {storage_id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        flat, spec = pytree.tree_flatten(result)
        fresh = []
        for i, out in enumerate(flat):
            if is_cpu_dense(out) and storage_id(out) not in inputs:
                flat[i] = memory.like(out, capturing=True)
                self.launcher.in_flight.deliver(func, out, flat[i])
                fresh.append((i, memory.describe(flat[i])))
        self.recording.tasks.append(OpTask(func, frozen_args, frozen_kwargs, fresh, label, kind))
        return pytree.tree_unflatten(flat, spec)


class UpdateMode(TorchDispatchMode):
    """Records the ops of a task update of `handle`, to be issued on `stream`, instead of running
    them; an op that is not a device kernel is decomposed, as at capture, its host conversions
    refused. Source: torch_npu re-issues each recorded op between `graph_task_update_begin` and
    `graph_task_update_end` (`npu/graphs.py`, `update_capture_record`), so an update is the ops a
    call issues, in order. Outputs are fresh stand-ins, not the captured tasks' buffers: an op whose body passes an
    intermediate from one kernel to the next does not update soundly (a device's re-issued kernels
    would allocate it anew too); ops that write their outputs in place (`out=`) do."""

    def __init__(self, memory: SimMemory, kernels: DeviceKernels, handle: SimTaskHandle, stream: SimStream) -> None:
        super().__init__()
        self.memory = memory
        self.kernels = kernels
        self.handle = handle
        self.stream = stream
        self.issued: list[IssuedOp] = []
        self.guard = HostReadGuard([], "a task update")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if is_view(func):
            return func(*args, **kwargs)
        if not self.kernels.is_kernel(func):
            return decompose(self, self.guard, func, args, kwargs)
        if syncs_host(func, args, kwargs):
            raise HostSync(
                f"{func}{inside(self.guard.enclosing)} in the task update of {self.handle!r} reads device data on "
                f"the host; an update is recorded, not run, so there is nothing to read: move it out"
            )
        frozen_args, frozen_kwargs = record_operands(self.memory, self.kernels, func, args, kwargs)
        self.issued.append(IssuedOp(func, self.kernels.task_kind(func, args, kwargs), frozen_args, frozen_kwargs))
        if not func._schema.returns:
            return None
        meta_args, meta_kwargs = pytree.tree_map_only(
            torch.Tensor,
            lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"),
            (args, kwargs),
        )
        return pytree.tree_map_only(
            torch.Tensor,
            lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu"),
            func(*meta_args, **meta_kwargs),
        )
