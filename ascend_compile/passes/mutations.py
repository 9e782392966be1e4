"""Which graph inputs a graph writes, and where: facts taken from torch, not from op names.

The dynamo graph is run once more on its own fake example values, in its own fake mode (as
AOTAutograd re-traces), under a dispatch mode that sees every ATen op: an argument the op's schema
annotates as written (`Tensor(a!)`: in-place ops, `out=` ops, custom ops' `mutates_args`) writes
the input whose fake storage it shares. So a write through any chain of views is found, and so are
inputs that alias each other (dynamo gives them one fake storage).

For each written input the pass also finds the FX node of the written view (the in-place op's
self, the `out=` tensor, the custom op's mutated argument, or `x[index]` of an item assignment) and
whether it is reached from the input by views alone: then the runner can replay the write's
location on the caller's tensor with the step's real sizes and copy exactly the written elements
back (see `WriteBack`).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Iterable

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..ops import library  # noqa: F401  (registers torch.ops.ascend)
from .fx_utils import ancestors, example_value, is_op, nodes_in, placeholders, written_args

#: Ops whose writes into graph inputs are safe under padding: the cache write skips padding
#: rows (slot -1), so a padded step writes exactly what the real step writes.
PADDING_SAFE_WRITES = (torch.ops.ascend.reshape_and_cache, torch.ops.ascend.mla_cache_write)


@dataclasses.dataclass(frozen=True)
class InputWrite:
    """One FX node writing one graph input."""

    input: int  # placeholder index
    node: str  # name of the writing FX node
    padding_safe: bool  # the op is known to write nothing for padding rows
    target: fx.Node | None  # the written view as an FX node (None: not expressible, e.g. advanced indexing)
    index: Any = None  # for an item assignment `x[index] = v`: the index (target is then x)


@dataclasses.dataclass(frozen=True)
class MutationFacts:
    """What the graph writes into its inputs, what it reads after, and which inputs alias."""

    writes: tuple[InputWrite, ...]
    read_after_write: frozenset[int]  # inputs read by a later node after a (padding-unsafe) write
    alias_groups: tuple[frozenset[int], ...]  # inputs sharing one storage (groups of two or more)

    def written(self) -> set[int]:
        return {w.input for w in self.writes}

    def unsafe(self) -> list[InputWrite]:
        return [w for w in self.writes if not w.padding_safe]


_METADATA_OPS = ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride")


def _is_metadata_op(func: torch._ops.OpOverload) -> bool:
    """Ops that look at a tensor's sizes, device or layout (`prim::device`), not its data."""
    return func.namespace == "prim" or func.__name__.split(".")[0] in _METADATA_OPS


_OVERWRITING_OPS = ("copy_", "fill_", "zero_")


def _overwrites(func: torch._ops.OpOverload, arg: torch._C.Argument) -> bool:
    """Whether a written argument is only written (an `out=` tensor, or `copy_`/`fill_`/`zero_`'s
    self); other in-place ops read what they write (`add_`)."""
    return arg.kwarg_only or func.__name__.split(".")[0] in _OVERWRITING_OPS


class _RecordAccesses(TorchDispatchMode):
    """Records, per FX node, the input storages each ATen op writes and reads."""

    def __init__(self, storages: dict[StorageWeakRef, list[int]]) -> None:
        super().__init__()
        self.storages = storages
        self.node: str | None = None
        self.writes: list[tuple[str, int]] = []
        self.reads: list[tuple[str, int]] = []

    def _inputs_of(self, value: Any) -> list[int]:
        found = []
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                found += self.storages.get(StorageWeakRef(leaf.untyped_storage()), [])
        return found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        bound = dict(zip((a.name for a in schema.arguments), args))
        bound.update(kwargs)
        for arg in schema.arguments:
            if arg.name not in bound:
                continue
            written = arg.alias_info is not None and arg.alias_info.is_write
            if written:
                self.writes += [(self.node, i) for i in self._inputs_of(bound[arg.name])]
            if written and not _overwrites(func, arg) or not written and not func.is_view and not _is_metadata_op(func):
                self.reads += [(self.node, i) for i in self._inputs_of(bound[arg.name])]
        return func(*args, **kwargs)


class _NodeTracker(fx.Interpreter):
    """Runs the nodes that may touch an input's storage; the others keep dynamo's fake value.

    A node none of whose tensor arguments shares storage with an input can neither read nor write
    an input through its arguments, and its own value (a fresh tensor, or a view of one) is not an
    input's storage either: running it would record nothing. Most of a model's nodes are such (the
    activations), so skipping them keeps the analysis a fraction of a trace.
    """

    def __init__(self, gm: fx.GraphModule, recorder: _RecordAccesses) -> None:
        super().__init__(gm)
        self.recorder = recorder

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("call_function", "call_method", "call_module") and not self._touches_input(n):
            value = example_value(n)
            if value is not None:
                return value
        self.recorder.node = n.name
        return super().run_node(n)

    def _touches_input(self, n: fx.Node) -> bool:
        storages = self.recorder.storages
        for arg in n.all_input_nodes:
            for leaf in tree_flatten(self.env.get(arg))[0]:
                if isinstance(leaf, torch.Tensor) and StorageWeakRef(leaf.untyped_storage()) in storages:
                    return True
        return False


def _storage(value: Any) -> StorageWeakRef | None:
    if isinstance(value, torch.Tensor):
        return StorageWeakRef(value.untyped_storage())
    return None


def analyse_mutations(gm: fx.GraphModule) -> MutationFacts:
    """Run `gm` on its fake example values and record every input write, read and alias."""
    nodes = placeholders(gm)
    values = [example_value(n) for n in nodes]
    storages: dict[StorageWeakRef, list[int]] = {}
    for index, value in enumerate(values):
        ref = _storage(value)
        if ref is not None:
            storages.setdefault(ref, []).append(index)
    fake_mode = next((v.fake_mode for v in values if isinstance(v, torch._subclasses.FakeTensor)), None)
    recorder = _RecordAccesses(storages)
    if fake_mode is not None:
        with fake_mode, recorder, torch.no_grad():
            _NodeTracker(gm, recorder).run(*values)
    by_name = {n.name: n for n in gm.graph.nodes}
    writes: list[InputWrite] = []
    seen = set()
    for node_name, index in recorder.writes:
        if (node_name, index) in seen:
            continue
        seen.add((node_name, index))
        node = by_name[node_name]
        target, item_index = _written_target(node, storages_of=lambda v: storages.get(_storage(v), []), index=index)
        safe = any(is_op(node, op) for op in PADDING_SAFE_WRITES)
        writes.append(InputWrite(index, node_name, safe, target, item_index))
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    first_unsafe_write: dict[int, int] = {}
    for w in writes:
        if not w.padding_safe:
            first_unsafe_write[w.input] = min(first_unsafe_write.get(w.input, len(order)), order[w.node])
    read_after = {
        index for node_name, index in recorder.reads
        if index in first_unsafe_write and order[node_name] > first_unsafe_write[index]
    }
    groups = tuple(frozenset(g) for g in storages.values() if len(g) > 1)
    return MutationFacts(tuple(writes), frozenset(read_after), groups)


def _written_target(node: fx.Node, storages_of, index: int) -> tuple[fx.Node | None, Any]:
    """The FX node of the view `node` writes into input `index`, or (x, index) of `x[index] = v`."""
    if node.op == "call_function" and node.target is operator.setitem:
        base, item, _ = node.args
        if index in storages_of(example_value(base)) and _is_basic_index(item):
            return base, item
        return None, None
    for candidate in written_args(node):
        if isinstance(candidate, fx.Node) and index in storages_of(example_value(candidate)):
            return candidate, None
    return None, None


def _is_basic_index(item: Any) -> bool:
    """An index of ints, slices, None and Ellipsis only: `x[item]` is a view, not a gather."""
    items = item if isinstance(item, tuple) else (item,)
    return all(
        i is None or i is Ellipsis or isinstance(i, (int, slice, torch.SymInt))
        or (isinstance(i, fx.Node) and not isinstance(example_value(i), torch.Tensor))
        for i in items
    )


def output_aliases(gm: fx.GraphModule, facts: MutationFacts, inputs: set[int]) -> dict[int, fx.Node]:
    """Flat output positions whose value is a view of one of `inputs`, and the node that is that
    view (an in-place op's result stands for the tensor it wrote)."""
    storages = {_storage(example_value(n)): i for i, n in enumerate(placeholders(gm))}
    wrote = {w.node: w.target for w in facts.writes if w.target is not None and w.index is None}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    found = {}
    for position, node in enumerate(tree_flatten(output.args[0])[0]):
        if isinstance(node, fx.Node) and isinstance(example_value(node), torch.Tensor) \
                and storages.get(_storage(example_value(node))) in inputs:
            found[position] = wrote.get(node.name, node)
    return found


def written_view_value(write: InputWrite) -> Any:
    """The fake value of the view `write` writes (for `x[index] = v`, of `x[index]`)."""
    value = example_value(write.target)
    if write.index is None:
        return value
    index = fx.node.map_arg(write.index, example_value)
    with value.fake_mode:
        return value[index]


def target_nodes(write: InputWrite) -> list[fx.Node]:
    """The FX nodes that locate a write: the view, and the nodes of an item assignment's index."""
    return [write.target, *nodes_in(write.index)]


def view_closure(targets: Iterable[fx.Node], gm: fx.GraphModule) -> list[fx.Node] | None:
    """The nodes that compute `targets` from the graph inputs, if they are all views of inputs and
    size arithmetic (no tensor computation), in graph order; None otherwise."""
    input_storages = {_storage(example_value(n)) for n in placeholders(gm)} - {None}
    nodes = ancestors(targets)
    for node in nodes:
        if node.op == "placeholder":
            continue
        if node.op not in ("call_function", "call_method"):
            return None
        value = example_value(node)
        if isinstance(value, torch.Tensor) and _storage(value) not in input_storages:
            return None  # a computed tensor: its value is the padded graph's, not the step's
    return nodes
