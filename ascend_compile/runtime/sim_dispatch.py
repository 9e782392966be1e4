"""Dispatch recording of the ACL-graph simulator (`runtime/sim.py`): how ops become tasks.

A device graph records kernel launches instead of Python calls, so the simulator sits under the
dispatcher: `_CaptureMode` (a `TorchDispatchMode`) runs each op once during a capture and records it
as a task with its operands as addresses, fresh outputs placed in the graph pool; `_UpdateMode`
records the ops of a task update without running them (outputs are empty stand-ins);
`_HostReadGuard` (a `TorchFunctionMode`) refuses the host reads that bypass the dispatcher. Both
recordings freeze operands the same way (`record_operands`) and name tasks the same way
(`task_kind`), which is what lets a task update be matched against its group. Apart from `sim.py`
because it is the one part of the simulator that talks to the dispatcher.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import CaptureError
from .sim_memory import SimMemory
from .sim_streams import SimStream
from .sim_tasks import (_ALLOCATION_OPS, _HOST_READ_METHODS, _HostRef, _OpTask, _aliases_inputs, _all_zero, _arg,
                        _is_cpu_dense, _is_view, _storage_id, _syncs_host)

if TYPE_CHECKING:
    from .sim import SimGraph, SimRuntime
    from .sim_updates import SimTaskHandle


def task_kind(fast_paths: dict[Any, str], op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The kind of task a call of `op` launches: its name, marked when its zero-length fast path
    (`fast_paths`: op packet -> its lengths argument) is taken."""
    lengths = fast_paths.get(op.overloadpacket)
    if lengths is not None and _all_zero(_arg(op, args, kwargs, lengths)[1]):
        return f"{op}[all lengths 0]"
    return str(op)


def record_operands(
    memory: SimMemory, host_reads: dict[Any, tuple[str, ...]], op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple, dict]:
    """A task's operands: tensors as addresses, host tensors the op reads when it runs (`host_reads`:
    op packet -> argument names) held weakly."""
    args, kwargs = pytree.tree_map(memory.describe, (args, kwargs))
    for name in host_reads.get(op.overloadpacket, ()):
        key, value = _arg(op, args, kwargs, name)
        if isinstance(value, torch.Tensor):
            if isinstance(key, int):
                args = (*args[:key], _HostRef(value, name), *args[key + 1:])
            else:
                kwargs = {**kwargs, key: _HostRef(value, name)}
    return args, kwargs


class _HostReadGuard(TorchFunctionMode):
    """During capture, refuses tensor-to-host conversions that bypass the dispatcher (`tolist`)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _HOST_READ_METHODS:
            raise CaptureError(
                f"Tensor.{func.__name__}() during graph capture: a device graph cannot copy device data "
                f"to the host; do host conversions before capture (or before the task update)"
            )
        return func(*args, **(kwargs or {}))


class _CaptureMode(TorchDispatchMode):
    """Runs each op once and records it as a task of `graph`, with fresh outputs in the graph pool."""

    def __init__(self, runtime: SimRuntime, graph: SimGraph) -> None:
        super().__init__()
        self.runtime = runtime
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rt = self.runtime
        memory = rt._memory
        if func in _ALLOCATION_OPS:
            return pytree.tree_map_only(torch.Tensor, lambda t: memory.like(t, capturing=True), func(*args, **kwargs))
        if _syncs_host(func) and any(
            rt._locate(t) is not None for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        ):
            raise CaptureError(
                f"{func} during graph capture reads device data on the host (.item(), bool(tensor), "
                f"a data-dependent output shape, ...); a device graph cannot record a host "
                f"synchronisation: move it out of the captured region"
            )
        if _is_view(func):
            result = func(*args, **kwargs)
            if _aliases_inputs(result, args, kwargs):
                return result
            # A "maybe view" op (reshape, contiguous, ... seen whole under inference mode) that
            # copied: it launches a kernel, so it is recorded like any other op.
        label = f"{self.graph.name} task {len(self.graph._tasks)} ({func})"
        frozen_args, frozen_kwargs = record_operands(memory, rt._host_reads, func, args, kwargs)
        kind = task_kind(rt._fast_paths, func, args, kwargs)
        result = rt._launch(func, args, kwargs, label)
        inputs = {_storage_id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        flat, spec = pytree.tree_flatten(result)
        fresh = []
        for i, out in enumerate(flat):
            if _is_cpu_dense(out) and _storage_id(out) not in inputs:
                flat[i] = memory.like(out, capturing=True)
                rt._in_flight.deliver(func, out, flat[i])
                fresh.append((i, memory.describe(flat[i])))
        self.graph._tasks.append(_OpTask(func, frozen_args, frozen_kwargs, fresh, label, kind))
        return pytree.tree_unflatten(flat, spec)


class _UpdateMode(TorchDispatchMode):
    """Records the ops of a task update instead of running them."""

    def __init__(self, runtime: SimRuntime, handle: SimTaskHandle, stream: SimStream) -> None:
        super().__init__()
        self.runtime = runtime
        self.handle = handle
        self.stream = stream
        self.recorded: list[tuple[Any, str, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_view(func):
            return func(*args, **kwargs)
        rt = self.runtime
        frozen_args, frozen_kwargs = record_operands(rt._memory, rt._host_reads, func, args, kwargs)
        self.recorded.append((func, task_kind(rt._fast_paths, func, args, kwargs), frozen_args, frozen_kwargs))
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
