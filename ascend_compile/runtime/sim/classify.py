"""How the ACL-graph simulator classifies ops and reads their arguments.

Capture, task updates and replays all ask the same questions of an op: does it launch a kernel or
only make a view or an allocation, must the host read device data to run it, is it a functional
collective, which of its arguments is `name`. The answers come from the op's schema and tags, never
from a list of op names where a tag says it; they live here, below every module that asks.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

_aten = torch.ops.aten

#: Ops that index with their `indices` argument: a boolean mask there becomes the indices of its
#: True elements (`nonzero`, torch's `expandTensors` in ATen's TensorAdvancedIndexing), a count
#: only the device knows.
MASK_INDEX_OPS = frozenset(
    {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
)
#: Ops that only allocate: on a device they launch no kernel, so capture records no task for them.
ALLOCATION_OPS = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_strided.default,
        _aten.empty_like.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
    }
)
#: Tensor methods that copy device data to the host without going through an aten op.
HOST_READ_METHODS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy})
#: Namespace of the functional collectives, and the op that waits for one to complete.
COLLECTIVES = "_c10d_functional"
WAIT_TENSOR = "_c10d_functional::wait_tensor"
#: Namespace of c10d's own collectives (`dist.all_reduce` is `c10d.allreduce_`): in place, and
#: returning a `Work` the caller waits on.
C10D = "c10d"


def is_view(func: torch._ops.OpOverload) -> bool:
    """True for ops that only make a new tensor over existing memory: no kernel, no task."""
    if torch.Tag.inplace_view in func.tags:
        return True
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def syncs_host(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True for a call a device graph cannot capture because the host must read device data: a value
    read back (`.item()`, `int(t)`, `bool(t)`: torch's tag `data_dependent_output`), an output whose
    shape depends on the data (tag `dynamic_output_shape`: nonzero, masked_select, unique, ...), or
    an index by a boolean mask."""
    if torch.Tag.data_dependent_output in func.tags:
        return True
    if func in MASK_INDEX_OPS:
        indices = arg(func, args, kwargs, "indices")[1] or ()
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return torch.Tag.dynamic_output_shape in func.tags


def is_wait(func: torch._ops.OpOverload) -> bool:
    """True for `wait_tensor`, after which a functional collective's output may be read."""
    return func._schema.name == WAIT_TENSOR


def completes_at_wait(func: torch._ops.OpOverload) -> bool:
    """True for a functional collective: it returns before its work is done, and c10d keys that work
    by the output's storage, so the output is written, and may be read, only once it is waited on."""
    return func.namespace == COLLECTIVES and not is_wait(func)


def is_c10d_collective(func: torch._ops.OpOverload) -> bool:
    """True for one of c10d's own collectives, which return the `Work` to wait on with their result."""
    return func.namespace == C10D


def storage_id(t: torch.Tensor) -> int:
    """An identity of `t`'s storage, shared by every view of it."""
    return t.untyped_storage()._cdata


def aliases_inputs(result: Any, args: Any, kwargs: Any) -> bool:
    """True when every tensor `result` holds shares storage with a tensor operand."""
    inputs = {storage_id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return all(storage_id(t) in inputs for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor))


def is_cpu_dense(x: Any) -> bool:
    """True for a strided CPU tensor: what simulated device memory can hold."""
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.layout == torch.strided


def arg(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> tuple[Any, Any]:
    """(key, value) of argument `name` of a call of `op`: its position in `args`, or its keyword;
    (None, None) when the call leaves it at its default."""
    if name in kwargs:
        return name, kwargs[name]
    names = [a.name for a in op._schema.arguments]
    index = names.index(name)
    return (index, args[index]) if index < len(args) else (None, None)


def all_zero(lengths: Any) -> bool:
    """Whether a host length argument (a list of ints or a host tensor) holds only zeros."""
    if isinstance(lengths, torch.Tensor):
        return not bool(torch.count_nonzero(lengths))
    return not any(lengths or ())


def one_query_token_each(ends: Any) -> bool:
    """Whether cumulative query ends (TND's `actual_seq_lengths`: a list of ints or a host tensor) give
    every sequence exactly one query token: `[1, 2, ..., n]`."""
    values = ends.tolist() if isinstance(ends, torch.Tensor) else list(ends or ())
    return bool(values) and values == list(range(1, len(values) + 1))
