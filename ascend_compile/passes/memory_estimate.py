"""What a graph's captures will allocate, known before any: its allocations traced on fake tensors.

A capture allocates from the graph pool every tensor an op of the graph makes (an op's output that
is not a view of, or written into, memory that exists already) and frees each when the last node
using it has run (`fx.Interpreter` drops values after their last use); what the graph returns is
still allocated when the capture's run ends (`replay` hands those back: the runner keeps only weak
aliases of them, `lowering/graph_entry.py`). `trace_allocations` runs the graph once on its fake
values (dynamo's `example_value`s, sizes symbolic) under a dispatch mode that sees the ops a
capture records (a custom op the runtime does not run as one kernel, as the ops of its body), and
keeps that order of allocations and frees, each size an expression of the graph's size symbols.
`AllocationTrace.replay` evaluates it at a graph's symbol values over a pool model
(`runtime/pool_model.py`); what a set of captures reserves is what the model reserves after all
of them, in capture order (`pool_reserved`). Workspace nodes are the artifact's slots, not the
pool's. Nothing runs on a device.

It is an estimate where the target changes the graph at capture (`Target.specialize`: the npu
target's contiguous queries, CUDA's device lengths or inductor), and an op decomposed into several
counts all its temporaries as live until the op returns (an over-estimate). A graph whose fake run
fails has no trace (`None`, with the reason logged).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterable, Sequence

import sympy
import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import ledger
from .fx_utils import example_value
from .size_symbols import evaluate

log = logging.getLogger("ascend_compile")


@dataclasses.dataclass(frozen=True)
class AllocationTrace:
    """A graph's allocations in order: `("alloc", id, nbytes)` and `("free", id, None)`; the ids
    never freed are the graph's outputs. Sizes are ints or expressions of the graph's size symbols."""

    events: tuple[tuple[str, int, Any], ...]
    #: per output of the graph, the ids of the storages it holds
    outputs: tuple[tuple[int, ...], ...] = ()

    def replay(self, model: Any, values: dict[sympy.Symbol, int]) -> list[Any]:
        """Make the allocations and frees of one capture with the size symbols at `values` on
        `model`; the handles of what stays allocated (the outputs)."""
        return list(self.replay_held(model, values).values())

    def replay_held(self, model: Any, values: dict[sympy.Symbol, int]) -> dict[int, Any]:
        """As `replay`; what stays allocated by id (`outputs` names them)."""
        held, sizes = {}, {}
        for kind, ident, nbytes in self.events:
            if kind == "alloc":
                if nbytes not in sizes:  # a graph's sizes are a few expressions, each evaluated once
                    sizes[nbytes] = evaluate(nbytes, values)
                held[ident] = model.allocate(sizes[nbytes])
            else:
                model.release(held.pop(ident))
        return held


def pool_reserved(model: Any, captures: Iterable[tuple[AllocationTrace, dict[sympy.Symbol, int]]]) -> int:
    """What `model` (a fresh pool model) reserves after the `captures` (a graph's trace and its
    symbol values), in that order, each freeing all it allocated when it ends: a captured graph
    keeps no block, its outputs being weak aliases read right after each replay
    (`lowering/graph_entry.py`)."""
    for trace, values in captures:
        for handle in trace.replay(model, values):
            model.release(handle)
    return model.reserved_bytes()


def _symbolic(n: Any) -> Any:
    return n.node.expr if isinstance(n, torch.SymInt) else int(n)


def _storage_bytes(t: torch.Tensor) -> Any:
    return _symbolic(t.untyped_storage().nbytes())


def _keys(value: Any) -> set[StorageWeakRef]:
    return {StorageWeakRef(t.untyped_storage()) for t in tree_leaves(value) if isinstance(t, torch.Tensor)}


#: Where a decomposed op's body is dispatched to: its CPU kernel (the simulator's, `sim/dispatch.py`).
BODY_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class _Recorder(TorchDispatchMode):
    """Notes every storage an op's outputs hold that was not seen before (a fresh allocation). An op
    the runtime does not run as one kernel (`runtime/pool_model.one_kernel`: on the simulator a Python
    custom op) has its body run with the recorder on, as a capture records it; a body that does not
    run on fakes (a native kernel) counts the op as one."""

    def __init__(self, known: dict[StorageWeakRef, Any], one_kernel: Callable[[Any], bool]) -> None:
        super().__init__()
        self.known, self.fresh, self.one_kernel = known, [], one_kernel
        self.workspace = torch.ops.ascend.workspace.default  # given the artifact's slot at capture, not the pool's

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is self.workspace:  # `lowering/capture.py`: the slot, allocated outside every pool
            out = func(*args, **kwargs)
            self.known[StorageWeakRef(out.untyped_storage())] = 0
            return out
        if not self.one_kernel(func):
            try:
                with self:
                    return func.redispatch(BODY_KEYS, *args, **kwargs)
            except Exception:  # noqa: BLE001 - a native body: the op counts as one
                pass
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = StorageWeakRef(t.untyped_storage())
                if key not in self.known:
                    self.known[key] = _storage_bytes(t)
                    self.fresh.append(key)
        return out


@ledger.timed("memory_estimate")
def trace_allocations(gm: fx.GraphModule, one_kernel: Callable[[Any], bool] = lambda op: True
                      ) -> AllocationTrace | None:
    """`gm`'s allocation trace (see the module docstring), or None where its fake run fails;
    `one_kernel(op)`: whether the runtime records `op` as one kernel (else its body's ops)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    # an input without a fake value is a host list the runner passes (a kernel's lengths): any will do
    inputs = [[] if example_value(n) is None else example_value(n) for n in placeholders]
    fake_mode = _fake_mode(inputs)
    if fake_mode is None:
        log.info("ascend_compile: no graph memory estimate: the graph's inputs carry no fake values")
        return None
    try:
        return _trace(gm, placeholders, inputs, fake_mode, one_kernel)
    except Exception as err:  # noqa: BLE001 - any op failing on fakes: no estimate, said why
        log.warning("ascend_compile: no graph memory estimate: the graph does not run on fake tensors (%s: %s)",
                    type(err).__name__, err)
        return None


def _fake_mode(inputs: Sequence[Any]) -> Any:
    """The fake mode to run a graph on its example `inputs` in: their tensors', or, for a graph given
    sizes alone (a piece making a buffer of the token count's rows), a new one on their symbols' shape
    environment; None where no input is fake."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = detect_fake_mode([v for v in inputs if isinstance(v, torch.Tensor)])
    sizes = [v for v in inputs if isinstance(v, torch.SymInt)]
    if fake_mode is None and sizes:
        return FakeTensorMode(shape_env=sizes[0].node.shape_env)
    return fake_mode


def _trace(gm: fx.GraphModule, placeholders: Sequence[fx.Node], inputs: Sequence[Any], fake_mode: Any,
           one_kernel: Callable[[Any], bool]) -> AllocationTrace:
    known: dict[StorageWeakRef, Any] = {}
    for value in inputs:  # what the graph is given exists already: never the pool's
        if isinstance(value, torch.Tensor):
            known.setdefault(StorageWeakRef(value.untyped_storage()), _storage_bytes(value))
    last_use = {}
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            last_use[arg] = node
    ids: dict[StorageWeakRef, int] = {}
    users: dict[StorageWeakRef, int] = {}  # storage -> live nodes holding it
    holds: dict[fx.Node, set[StorageWeakRef]] = {}
    events: list[tuple[str, int, Any]] = []
    env: dict[fx.Node, Any] = dict(zip(placeholders, inputs))
    shape_env = fake_mode.shape_env  # the fake run adds no guard to what dynamo compiled
    recorder = _Recorder(known, one_kernel)
    with fake_mode, shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext(), recorder:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                break
            recorder.fresh = []
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            if node.op == "call_function":
                value = node.target(*args, **kwargs)
            elif node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            elif node.op == "call_module":
                value = gm.get_submodule(node.target)(*args, **kwargs)
            else:  # get_attr
                value = getattr(gm, node.target)
            env[node] = value
            for key in recorder.fresh:
                ids[key] = len(ids)
                events.append(("alloc", ids[key], known[key]))
            holds[node] = {k for k in _keys(value) if k in ids}
            for key in holds[node]:
                users[key] = users.get(key, 0) + 1
            for key in recorder.fresh:  # made and dropped inside the op
                if key not in holds[node]:
                    events.append(("free", ids[key], None))
            for arg in node.all_input_nodes:
                if last_use.get(arg) is node:
                    _drop(arg, holds, users, ids, events, env)
            if not node.users:
                _drop(node, holds, users, ids, events, env)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    outputs = tuple(tuple(sorted(ids[k] for k in holds.get(n, ()) if k in ids)) if isinstance(n, fx.Node) else ()
                    for n in returned)
    return AllocationTrace(tuple(events), outputs)


def _drop(node: fx.Node, holds: dict, users: dict, ids: dict, events: list, env: dict) -> None:
    """`node`'s value is dead: free each storage no live node holds any more."""
    for key in holds.pop(node, ()):
        users[key] -= 1
        if users[key] == 0:
            events.append(("free", ids[key], None))
    env.pop(node, None)
