"""Where a piecewise graph is split: the nodes that run eagerly, on the step's real tensors, between
captured pieces (`lowering/piecewise.py`), and the pieces themselves.

A piece is captured once per token count and replayed for any step up to it, so it may hold only
what depends on nothing but the padded token count. A node runs eagerly, and says why, when:
- it is a kernel or attention call: its lengths are the step's (the kernels' host lists, or the
  attention op's metadata), which a piece could only freeze; an attention op is left in a graph where the
  device refused its layer's form and the user asked it served eagerly (`refused_layers="eager"`);
- it writes a graph input (a caller's buffer) or a value a piece made: eagerly it writes exactly the
  real step's rows, into the caller's tensors, and no padding row lands anywhere; the views it writes
  through are computed eagerly too. A KV-cache write that writes nothing for padding rows (slot -1,
  `mutations.PADDING_SAFE_WRITES`) into a cache used in place stays in its piece, as in a full graph
  and as vLLM's piecewise graphs keep `unified_kv_cache_update`: the pieces' slot-mapping buffers get
  -1 in their padding rows every step;
- a tensor it reads or makes has a size other than the token count (or a specialised size): the
  sequence count, block-table widths; a piece captured per token count cannot hold them;
- its op cannot be captured: the artifact found it so (`errors.UncapturableOp`, raised by the
  simulator's or the device's own capture refusal) in a full graph or in a piece;
- it unpacks a value made eagerly (`getitem` of an eager node's tuple).
Every other node is in a piece: maximal runs of consecutive such nodes, in graph order.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Collection, Iterable

import sympy
import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from .fx_utils import example_value, is_op, nodes_in, placeholders, shape_exprs, written_args
from .kernel_call import is_kernel
from .roles import CACHE_WRITES, IN_PLACE_ROLES, GraphSignature, Role

_WORKSPACE = torch.ops.ascend.workspace
#: The attention ops a layer keeps where no kernel serves it (`select_kernels(..., eager=...)`).
_ATTENTION = (torch.ops.ascend.attention, torch.ops.ascend.mla_attention)


@dataclasses.dataclass
class Piece:
    """Consecutive nodes captured as one graph: what it reads from outside, what later nodes read."""

    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]


class Why(str):
    """Why a node runs eagerly (the text plan.json and the logs show), and whether it writes a caller's
    tensor other than a KV cache (`writes_caller`): graph input storage, or a view of it that such a node
    writes through. A capture run on the step's values must not run such a node a second time
    (`lowering/piecewise_live.py`)."""

    writes_caller: bool

    def __new__(cls, text: str, writes_caller: bool = False) -> Why:
        why = super().__new__(cls, text)
        why.writes_caller = writes_caller
        return why


@dataclasses.dataclass
class EagerNode:
    """One node run eagerly between pieces, why, and whether it writes a caller's tensor (`Why`)."""

    node: fx.Node
    why: str

    @property
    def writes_caller(self) -> bool:
        """Whether the node writes a caller's tensor other than a KV cache (what its `Why` says)."""
        return _writes_caller(self.why)


Segment = Piece | EagerNode


def _storage(value: Any) -> StorageWeakRef | None:
    if isinstance(value, torch.Tensor):
        try:
            return StorageWeakRef(value.untyped_storage())
        except (NotImplementedError, RuntimeError):
            return None
    return None


def _symbols(value: Any) -> set[sympy.Symbol]:
    """The size symbols of a tensor's shape, or of a SymInt, SymFloat or SymBool."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(value.node.expr.free_symbols)
    shape = shape_exprs(value)
    return {s for d in shape or () if not isinstance(d, int) for s in d.free_symbols}


def _written(node: fx.Node) -> list[fx.Node]:
    """The nodes `node` writes: each written argument's, a list argument's (`Tensor(a!)[]`) included."""
    return nodes_in(written_args(node))


def _values(node: fx.Node) -> list[Any]:
    value = example_value(node)
    return list(value) if isinstance(value, (tuple, list)) else [value]


def padding_safe_writes(gm: fx.GraphModule, signature: GraphSignature, names: Collection[str]) -> set[fx.Node]:
    """The padding-safe cache writes of `gm` (by name) whose every slot mapping they read is a graph
    input of role slot_mapping (padded with -1) and whose every written input is used in place."""
    by_name = {n.name: n for n in gm.graph.nodes}
    inputs = {n: i for i, n in enumerate(placeholders(gm))}
    roles = {spec.index: spec.role for spec in signature.inputs}
    found = set()
    for name in names:
        node = by_name.get(name)
        if node is None:
            continue
        written = _written(node)
        mapping = node.args[-1] if node.args else None
        if (written and all(roles.get(inputs.get(w)) in IN_PLACE_ROLES for w in written)
                and isinstance(mapping, fx.Node) and roles.get(inputs.get(mapping)) is Role.SLOT_MAPPING):
            found.add(node)
    return found


def eager_nodes(gm: fx.GraphModule, piece_symbols: Collection[sympy.Symbol],
                uncapturable: Collection[Any] = (), padding_safe: Collection[fx.Node] = ()) -> dict[fx.Node, str]:
    """The nodes of `gm` (a piecewise variant: kernels selected, workspaces inserted) that run eagerly,
    each with why; `piece_symbols` are the sizes a piece may hold (the token count, specialised sizes),
    `uncapturable` the ops found uncapturable so far, `padding_safe` the cache writes that may stay in
    pieces (padding-safe, into caches used in place)."""
    inputs = placeholders(gm)
    input_storages = {_storage(example_value(n)) for n in inputs} - {None}
    allowed = set(piece_symbols)
    eager: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        why = None if node in padding_safe else _why_eager(node, eager, input_storages, allowed, uncapturable)
        if why:
            eager[node] = why
    for node, why in list(eager.items()):  # a write through a view of an input: the view too
        if why.startswith("writes"):
            for written in _written(node):
                for view in _view_chain(written, input_storages):
                    eager.setdefault(view, Why(f"a view {node.name} writes through", _writes_caller(why)))
    return eager


def _why_eager(node: fx.Node, eager: dict[fx.Node, str], input_storages: set, allowed: set[sympy.Symbol],
               uncapturable: Collection[Any]) -> str | None:
    if is_kernel(node):
        return "attention kernel: takes the step's lengths"
    if any(is_op(node, op) for op in _ATTENTION):
        return "attention op (its layer served eagerly): takes the step's lengths"
    if is_op(node, _WORKSPACE):
        return "workspace: the artifact's slot"
    if any(is_op(node, op) for op in CACHE_WRITES):
        return "writes the KV cache at the step's slots"
    if node.op in ("call_function", "call_method") and node.target in uncapturable:
        return f"{node.target} cannot be captured"
    if node.target is operator.getitem and node.args and node.args[0] in eager:
        return "unpacks an eager node's result"
    for written in _written(node):
        if _storage(example_value(written)) in input_storages:
            return Why(f"writes graph input storage ({written.name})", writes_caller=True)
    for value in [*_values(node), *(example_value(a) for a in node.all_input_nodes)]:
        extra = _symbols(value) - allowed
        if extra:
            return f"holds the size{'s' if len(extra) > 1 else ''} {', '.join(sorted(map(str, extra)))} (not the token count)"
    return None


def _writes_caller(why: str) -> bool:
    return isinstance(why, Why) and why.writes_caller


def _view_chain(value: fx.Node, input_storages: set) -> Iterable[fx.Node]:
    """The nodes computing `value` that are views of graph inputs, back to the placeholder."""
    stack = [value]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen or node.op == "placeholder":
            continue
        seen.add(node)
        if _storage(example_value(node)) in input_storages:
            yield node
            stack += node.all_input_nodes


def split(gm: fx.GraphModule, eager: dict[fx.Node, str], extra_reads: dict[fx.Node, list[fx.Node]] | None = None,
          padding_safe: Collection[fx.Node] = ()) -> list[Segment]:
    """`gm`'s nodes as pieces and eager nodes (a workspace node is neither: the artifact's slot stands for
    it): the eager nodes in graph order, each piece the nodes
    placed between two of them. A node that writes nothing, whose value no piece's node writes, is placed in
    the earliest piece after what it reads (its inputs, and what an earlier eager node writes of the
    storage it reads), so a view or allocation between a cache write and its attention (the kernel's
    `out`) does not end a piece; every other node stays between the eager nodes it was between. A
    node writing a value another piece made (an in-place op on a piece's input) runs eagerly: a
    piece's inputs are copies or other pieces' outputs, and the write must land where every later
    reader looks. `extra_reads`: nodes an eager node may read beyond its arguments (a kernel's
    attention fallback), kept as pieces' outputs; `padding_safe`: the cache writes kept in pieces."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and not is_op(n, _WORKSPACE)]
    position = {n: i for i, n in enumerate(nodes)}
    while True:
        slot = _slots(nodes, eager)
        moved = [n for n in nodes if n not in eager and n not in padding_safe and _written(n)
                 and _writes_elsewhere(n, slot, eager, nodes[:position[n]])]
        if not moved:
            break
        for n in moved:
            eager[n] = f"writes {', '.join(w.name for w in _written(n))}, which another piece made"
            for user in n.users:
                if user.target is operator.getitem:
                    eager.setdefault(user, "unpacks an eager node's result")
    segments: list[Segment] = []
    where: dict[fx.Node, int] = {}  # each segment node's segment: every reader of a piece's node is one
    by_slot: dict[int, list[fx.Node]] = {}
    for n in nodes:
        if n not in eager:
            by_slot.setdefault(slot[n], []).append(n)
    ranked = [n for n in nodes if n in eager]
    for rank in range(len(ranked) + 1):
        members = by_slot.get(rank)
        if members:
            for n in members:
                where[n] = len(segments)
            segments.append(Piece(members, [], []))
        if rank < len(ranked):
            where[ranked[rank]] = len(segments)
            segments.append(EagerNode(ranked[rank], eager[ranked[rank]]))
    _wire(gm, segments, where, extra_reads or {})
    return segments


def _storages(values: Iterable[Any]) -> set:
    return {s for s in map(_storage, values) if s is not None}


def _slots(nodes: list[fx.Node], eager: dict[fx.Node, str]) -> dict[fx.Node, int]:
    """The piece each node goes to: piece i runs before the i-th eager node (after the last one, i = their
    count); an eager node's slot is its rank, a piece's node's the earliest its reads allow, or, where it
    writes or a piece's node writes its value, the piece it was in (a value only eager nodes write, as a
    kernel's `out`, is made before them either way)."""
    written = _storages(example_value(w) for n in nodes if n not in eager  # in a piece: keep order with them
                        for w in _written(n))
    slot: dict[fx.Node, int] = {}
    rank = 0
    writes_so_far: list[tuple[set, int]] = []  # (storages an eager or in-place node wrote, the slot after it)
    for n in nodes:
        writes = _storages(example_value(w) for w in _written(n))
        if n in eager:
            slot[n] = rank
            rank += 1
            writes_so_far.append((writes, rank))
            continue
        if writes or _storages(_values(n)) & written:
            slot[n] = rank  # stays where it was: its order with every write is kept
            if writes:
                writes_so_far.append((writes, rank))
            continue
        reads = _storages(example_value(a) for a in n.all_input_nodes)
        earliest = 0
        for a in n.all_input_nodes:
            if a in slot:
                earliest = max(earliest, slot[a] + (1 if a in eager else 0))
        for storages, after in writes_so_far:
            if storages & reads:
                earliest = max(earliest, after)
        slot[n] = earliest
    return slot


def _writes_elsewhere(n: fx.Node, slot: dict[fx.Node, int], eager: dict[fx.Node, str], earlier: list[fx.Node]
                      ) -> bool:
    """Whether piece node `n` writes a storage that no node of its own piece made first (a graph
    input's, an eager node's, another piece's); `earlier`: the nodes before it, in graph order."""
    for w in _written(n):
        storage = _storage(example_value(w))
        owner = next((m for m in [*earlier, n] if storage in _storages(_values(m))), None)
        if owner is None or owner in eager or slot[owner] != slot[n]:
            return True
    return False


def _wire(gm: fx.GraphModule, segments: list[Segment], where: dict[fx.Node, int],
          extra_reads: dict[fx.Node, list[fx.Node]]) -> None:
    """Each piece's inputs (nodes of other segments and placeholders) and outputs (its nodes read by a
    later segment or by the graph's output)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    read_by: dict[fx.Node, set[fx.Node]] = {}
    for reader, nodes in extra_reads.items():
        for node in nodes:
            read_by.setdefault(node, set()).add(reader)
    for index, segment in enumerate(segments):
        if not isinstance(segment, Piece):
            continue
        members = set(segment.nodes)
        segment.inputs = list(dict.fromkeys(a for n in segment.nodes for a in n.all_input_nodes if a not in members))
        segment.outputs = [n for n in segment.nodes
                           if any(u is output or where[u] != index for u in [*n.users, *read_by.get(n, ())])]


def piece_module(gm: fx.GraphModule, piece: Piece) -> fx.GraphModule:
    """`piece` as a graph module of its own: its inputs as placeholders, its outputs as a tuple."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in piece.inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in piece.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in piece.outputs))
    return fx.GraphModule(gm, graph)
