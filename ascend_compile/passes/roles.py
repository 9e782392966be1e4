"""Placeholder roles: what each graph input is, so the runner pads it by one table of rules.

A role comes from the argument an input feeds (`seq_lens`, `block_table`, `query_start_loc` of an
attention node, `slot_mapping` and the caches of a cache write: `reshape_and_cache`, MLA's
`mla_cache_write`), else from what it is:
inputs with a symbolic (batch-dependent) size, and in static graphs any tensor that is not a
parameter or buffer (dynamo marks those), are batch data; 0-d tensors are scalars copied each
step; weights and buffers are static and used in place.

The signature also says how every size symbol of the graph is padded for a bucket and read back
from a step's real inputs, which is all the runner needs to pad inputs and unpad outputs.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.utils._sympy.functions as torch_sympy
from torch import fx

from .find_attention import attention_args
from .mutations import MutationFacts, analyse_mutations, output_aliases, target_nodes, view_closure, written_view_value
from .fx_utils import example_value, is_op, placeholders, shape_exprs, size_expr
from .size_symbols import SymbolKind, SymbolSource, evaluate


class Role(str, enum.Enum):
    SEQ_LENS = "seq_lens"
    BLOCK_TABLE = "block_table"
    QUERY_START_LOC = "query_start_loc"
    SLOT_MAPPING = "slot_mapping"
    KV_CACHE = "kv_cache"
    BATCH = "batch"
    SCALAR = "scalar"
    STATIC = "static"
    SYMINT = "symint"
    UNUSED = "unused"  # read only by the hoisted metadata prologue (or not at all): passed through as is


#: The value padding rows / columns get, per role.
PAD_VALUE = {
    Role.SEQ_LENS: 0,
    Role.BLOCK_TABLE: 0,
    Role.SLOT_MAPPING: -1,
    Role.BATCH: 0,
}


#: Roles whose inputs the runner copies into static buffers each step (padded by role).
COPIED_ROLES = (Role.SEQ_LENS, Role.BLOCK_TABLE, Role.QUERY_START_LOC, Role.SLOT_MAPPING, Role.BATCH)
#: Roles whose inputs the graph uses in place, at the address they had at capture.
IN_PLACE_ROLES = (Role.KV_CACHE, Role.STATIC)
#: Distinct step sizes whose symbol values a signature keeps (`GraphSignature.step_sizes`)
MAX_SIZES_SEEN = 4096


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One graph input: its position, role and (symbolic) shape, strides and storage offset."""

    index: int
    name: str
    role: Role
    shape: tuple[Any, ...] | None
    expr: Any = None  # the size expression of a SymInt input
    mutated: bool = False  # the graph writes into it
    strides: tuple[Any, ...] | None = None
    offset: Any = 0
    parameter: bool = False  # an nn.Parameter of the model (its address is fixed under `frozen_parameters`)

    @property
    def dynamic(self) -> bool:
        return self.shape is not None and any(not isinstance(d, int) for d in self.shape)

    @property
    def copied(self) -> bool:
        return self.role in COPIED_ROLES


@dataclasses.dataclass(frozen=True)
class GraphSignature:
    """Roles of all inputs and the size symbols of the graph."""

    inputs: tuple[InputSpec, ...]
    tokens: Any  # number of query tokens T: an int or a sympy expression
    sequences: Any  # number of sequences B: an int or a sympy expression
    symbol_sources: dict[sympy.Symbol, SymbolSource]
    symbol_kinds: dict[sympy.Symbol, SymbolKind]
    outputs: tuple[Any, ...]  # per output: shape exprs, or None for non-tensors
    pad_reason: str | None = None  # why steps are not padded (each size gets its own capture), or None

    @property
    def is_static(self) -> bool:
        return not self.symbol_sources

    @property
    def can_pad(self) -> bool:
        """Whether steps are padded up to a bucket (else every distinct size is captured as is)."""
        return self.pad_reason is None

    @functools.cached_property
    def specialized(self) -> tuple[sympy.Symbol, ...]:
        """The symbols whose every distinct value gets its own capture, in a fixed order."""
        return tuple(sorted((s for s, k in self.symbol_kinds.items() if k is SymbolKind.SPECIALIZED), key=str))

    @functools.cached_property
    def _by_role(self) -> dict[Role, tuple[InputSpec, ...]]:
        return {role: tuple(spec for spec in self.inputs if spec.role is role) for role in Role}

    def by_role(self, role: Role) -> tuple[InputSpec, ...]:
        """The inputs of one role, in order (computed once: the runner asks on every step)."""
        return self._by_role[role]

    def padded_symbols(self, bucket: int, max_blocks: int, actual: dict[sympy.Symbol, int] | None = None
                       ) -> dict[sympy.Symbol, int]:
        """Symbol values of the graph captured for `bucket` tokens (and as many sequences); the
        specialized symbols take their `actual` values, layout symbols are left to the buffers."""
        values = {SymbolKind.TOKENS: bucket, SymbolKind.BLOCKS: max_blocks, SymbolKind.QUERY_START_LOC: bucket + 1}
        out = {sym: values[kind] for sym, kind in self.symbol_kinds.items() if kind in values}
        for sym in self.specialized:
            out[sym] = (actual or {})[sym]
        return out

    @functools.cached_property
    def _readers(self) -> tuple[tuple[sympy.Symbol, int, Callable[[Any], int]], ...]:
        return tuple((sym, source.index, source.reader) for sym, source in self.symbol_sources.items())

    @functools.cached_property
    def _sizes_seen(self) -> dict[tuple[int, ...], tuple[dict[sympy.Symbol, int], int, int]]:
        return {}

    def step_sizes(self, args: Sequence[Any]) -> tuple[dict[sympy.Symbol, int], int, int]:
        """Symbol values of one step's real inputs, and its token and sequence counts. The sizes are
        read every step (C calls); the symbol dict (sympy keys hash in Python) and the size
        expressions' values are made once per distinct sizes (at most `MAX_SIZES_SEEN`): the dict
        is shared by the steps of those sizes, and read only."""
        values = tuple([read(args[index]) for _, index, read in self._readers])
        seen = self._sizes_seen.get(values)
        if seen is None:
            symbols = {sym: value for (sym, _, _), value in zip(self._readers, values)}
            seen = (symbols, evaluate(self.tokens, symbols), evaluate(self.sequences, symbols))
            if len(self._sizes_seen) >= MAX_SIZES_SEEN:
                self._sizes_seen.clear()
            self._sizes_seen[values] = seen
        return seen


#: The cache writes: `(rows, rows, cache, cache, slot_mapping)` each.
CACHE_WRITES = (torch.ops.ascend.reshape_and_cache, torch.ops.ascend.mla_cache_write)


def _role_of_uses(gm: fx.GraphModule, attention: Sequence[fx.Node]) -> dict[str, Role]:
    roles: dict[str, Role] = {}

    def assign(node: Any, role: Role, what: str) -> None:
        if not isinstance(node, fx.Node) or node.op != "placeholder":
            raise ValueError(
                f"{what}: expected a graph input (the runner pads it and reads it on the host), "
                f"got {getattr(node, 'format_node', lambda: node)()}"
            )
        previous = roles.get(node.name)
        if previous is not None and previous is not role:
            raise ValueError(f"{what}: input {node.name} is used both as {previous.value} and as {role.value}")
        roles[node.name] = role

    for node in attention:
        args = attention_args(node)
        assign(args.block_table, Role.BLOCK_TABLE, f"{node.name}.block_table")
        assign(args.seq_lens, Role.SEQ_LENS, f"{node.name}.seq_lens")
        assign(args.query_start_loc, Role.QUERY_START_LOC, f"{node.name}.query_start_loc")
        for cache in args.caches:
            if isinstance(cache, fx.Node) and cache.op == "placeholder":
                roles[cache.name] = Role.KV_CACHE
    for node in gm.graph.nodes:
        for op in CACHE_WRITES:
            if is_op(node, op):
                *_, first_cache, second_cache, slot_mapping = node.args
                assign(slot_mapping, Role.SLOT_MAPPING, f"{node.name}.slot_mapping")
                for cache in (first_cache, second_cache):
                    if isinstance(cache, fx.Node) and cache.op == "placeholder":
                        roles[cache.name] = Role.KV_CACHE
    return roles


def _role_of_value(node: fx.Node, value: Any, shape: tuple | None) -> Role:
    """Role of an input no attention argument names: weights stay, per-step data is copied.

    Dynamo marks the model's own tensors static inputs (parameters, buffers, tensors modules hold:
    vLLM's LoRA weight stacks and punica buffers): they stay static even where a size of theirs is
    symbolic (a trace with every size symbolic), never batch data, so never padded as the token count
    (where one carries the token symbol, `_pad_reason` turns padding off)."""
    if isinstance(value, torch.SymInt):
        return Role.SYMINT
    if shape is None:
        return Role.STATIC
    model_state = "_dynamo_static_input_type" in node.meta.get("tensor_dict", {})
    if any(not isinstance(d, int) for d in shape):
        return Role.STATIC if model_state else Role.BATCH
    if len(shape) == 0:
        return Role.SCALAR
    if "tensor_dict" in node.meta and not model_state:
        return Role.BATCH  # anything dynamo did not mark is the caller's per-step data
    return Role.STATIC


def assign_roles(gm: fx.GraphModule, attention: Sequence[fx.Node], facts: MutationFacts | None = None) -> GraphSignature:
    """Give each placeholder a role (recorded as `meta["ascend_role"]`) and describe the graph's sizes.

    `facts` (from `analyse_mutations`) says which inputs the graph writes and how; writes that a
    padded step could not reproduce exactly turn padding off (`GraphSignature.pad_reason`)."""
    facts = facts or analyse_mutations(gm)
    roles = _role_of_uses(gm, attention)
    written = facts.written()
    inputs = []
    for index, node in enumerate(placeholders(gm)):
        value = example_value(node)
        shape = shape_exprs(value)
        expr = size_expr(value) if isinstance(value, torch.SymInt) else None
        role = roles.get(node.name)
        if role is None:
            role = _role_of_value(node, value, shape) if node.users else Role.UNUSED
        node.meta["ascend_role"] = role.value
        strides = tuple(size_expr(s) for s in value.stride()) if isinstance(value, torch.Tensor) else None
        offset = size_expr(value.storage_offset()) if isinstance(value, torch.Tensor) else 0
        inputs.append(InputSpec(index, node.name, role, shape, expr, index in written, strides, offset,
                                isinstance(value, torch.nn.Parameter)))

    first = attention_args(attention[0])
    tokens = shape_exprs(example_value(first.query))[0]
    sequences = shape_exprs(example_value(first.seq_lens))[0]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = tuple(shape_exprs(example_value(o)) if isinstance(o, fx.Node) else None for o in _flat(output_node.args[0]))
    padded_kinds, pad_reason = _padded_kinds(inputs, tokens, sequences)
    pad_reason = pad_reason or _pad_reason(gm, inputs, tokens, sequences, set(padded_kinds), facts)
    sources, kinds = _symbols(inputs, {} if pad_reason else padded_kinds)
    return GraphSignature(tuple(inputs), tokens, sequences, sources, kinds, outputs, pad_reason)


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


def _pad_reason(gm: fx.GraphModule, inputs: Sequence[InputSpec], tokens: Any, sequences: Any,
                padded: set[sympy.Symbol], facts: MutationFacts) -> str | None:
    """Why a padded step would not compute exactly what the real step computes, or None.

    Padding is exact when every write into a graph input lands, for the real rows, where the real
    step writes it, and the runner can copy exactly those elements back: writes into views of the
    input that grow with the step, never read afterwards (several writes into one input must not
    overlap: the runner checks that on each captured graph's buffers)."""
    if not isinstance(tokens, int) and isinstance(sequences, int):
        return "dynamo traced a static sequence count while the token count varies"
    for spec in inputs:
        if spec.role in IN_PLACE_ROLES and spec.shape and any(
            not isinstance(d, int) and d.free_symbols & padded for d in spec.shape
        ):
            return f"{spec.name}: a {spec.role.value} input (used in place) has a token-sized dimension {spec.shape}"
    unsafe = facts.unsafe()
    for w in unsafe:
        spec = inputs[w.input]
        if not spec.copied:
            return f"{spec.name}: a {spec.role.value} input (used in place) is written by {w.node}"
        if w.target is None:
            return f"{spec.name}: written by {w.node} through an index that is not a view (e.g. a tensor index)"
        others = [o.node for o in unsafe if o.input == w.input and o is not w]
        if others and w.target.op == "placeholder" and w.index is None:
            return f"{spec.name}: written whole by {w.node} and again by {', '.join(others)}"
        if w.input in facts.read_after_write:
            return f"{spec.name}: read after {w.node} writes it"
        if view_closure(target_nodes(w), gm) is None:
            return f"{spec.name}: written by {w.node} through a view computed from tensor data"
        shape = shape_exprs(written_view_value(w))
        if shape is None or not all(_grows(d) for d in shape):
            return f"{spec.name}: {w.node} writes a region of size {shape} that does not grow with the step"
    copied = {spec.index for spec in inputs if spec.copied}
    for position, node in output_aliases(gm, facts, copied).items():
        if view_closure([node], gm) is None:
            return f"output {position} is a view of a copied input computed from tensor data"
    return None


#: sympy's Min and Max, and torch's own (torch.utils._sympy.functions, which shape expressions use)
_MIN_MAX = (sympy.Min, sympy.Max, torch_sympy.Min, torch_sympy.Max)


def _grows(expr: Any) -> bool:
    """Whether a size expression never shrinks as its symbols grow (a polynomial with non-negative
    coefficients, or a Min or Max of such): then a padded step's written region holds the real
    step's as a prefix."""
    if isinstance(expr, int) or getattr(expr, "is_Integer", False):
        return True
    if isinstance(expr, _MIN_MAX):
        # a slice end clamped to a buffer's length: dynamo leaves it a Min when it may not guard on
        # the order of the sizes (backed_size_oblivious); a Min or Max of growing sizes grows
        return all(_grows(arg) for arg in expr.args)
    try:
        return all(c >= 0 for c in sympy.Poly(expr, *sorted(expr.free_symbols, key=str)).coeffs())
    except sympy.PolynomialError:
        return False


#: The dims that attention arguments give meaning to, by role: padded like the token count, the
#: block-table width, or query_start_loc's B + 1.
ROLE_DIMS = {
    Role.SLOT_MAPPING: {0: SymbolKind.TOKENS},
    Role.SEQ_LENS: {0: SymbolKind.TOKENS},
    Role.BLOCK_TABLE: {0: SymbolKind.TOKENS, 1: SymbolKind.BLOCKS},
    Role.QUERY_START_LOC: {0: SymbolKind.QUERY_START_LOC},
}

_SOURCE_PRIORITY = {"size": 0, "stride": 1, "offset": 1, "value": 2}


#: A token or sequence count `s + offset` pads `s` as this kind (the count itself to the bucket).
_COUNT_OFFSET_KINDS = {0: SymbolKind.TOKENS, -1: SymbolKind.QUERY_START_LOC}


def _count_symbol(expr: Any) -> tuple[sympy.Symbol, int] | None:
    """(s, c) when a count is `s + c` for one symbol s and an integer c."""
    if isinstance(expr, sympy.Symbol):
        return expr, 0
    if isinstance(expr, sympy.Add) and len(expr.free_symbols) == 1:
        sym = next(iter(expr.free_symbols))
        rest = sympy.simplify(expr - sym)
        if rest.is_Integer:
            return sym, int(rest)
    return None


def _padded_kinds(inputs: Sequence[InputSpec], tokens: Any, sequences: Any) -> tuple[dict, str | None]:
    """The kinds of the symbols padding gives values to, from data flow (the attention query's
    token dim, the sequence count, the dims of attention arguments); a reason when one symbol
    would need two values."""
    kinds: dict[sympy.Symbol, SymbolKind] = {}
    for what, count in (("token", tokens), ("sequence", sequences)):
        if isinstance(count, int):
            continue
        found = _count_symbol(count)
        if found is None or found[1] not in _COUNT_OFFSET_KINDS:
            return {}, f"the {what} count is the expression {count}, not one size (plus 0 or -1)"
        kind = _COUNT_OFFSET_KINDS[found[1]]
        if kinds.setdefault(found[0], kind) is not kind:
            return {}, f"size {found[0]} would be padded both as {kinds[found[0]].value} and as {kind.value}"
    for spec in inputs:
        for dim, kind in ROLE_DIMS.get(spec.role, {}).items():
            size = spec.shape[dim] if spec.shape and dim < len(spec.shape) else None
            if not isinstance(size, sympy.Symbol):
                continue
            if kinds.setdefault(size, kind) is not kind:
                return {}, f"size {size} is both a {kinds[size].value} and a {kind.value} dimension ({spec.name})"
    return kinds, None


def _symbols(inputs: Sequence[InputSpec], padded_kinds: dict[sympy.Symbol, SymbolKind]
             ) -> tuple[dict[sympy.Symbol, SymbolSource], dict[sympy.Symbol, SymbolKind]]:
    """Where each symbol of the graph's inputs is read from, and its kind: `padded_kinds`, else
    layout (only in copied inputs' strides and offsets: the static buffer has its own), else
    specialized."""
    sources: dict[sympy.Symbol, SymbolSource] = {}

    def found(sym: sympy.Symbol, source: SymbolSource) -> None:
        old = sources.get(sym)
        if old is None or _SOURCE_PRIORITY[source.attr] < _SOURCE_PRIORITY[old.attr]:
            sources[sym] = source

    sized: set[sympy.Symbol] = set()
    layout_of: dict[sympy.Symbol, bool] = {}  # symbol -> seen only in copied inputs' layouts
    for spec in inputs:
        if spec.role is Role.UNUSED:
            continue
        if isinstance(spec.expr, sympy.Symbol):
            found(spec.expr, SymbolSource(spec.index, "value"))
        for dim, size in enumerate(spec.shape or ()):
            if isinstance(size, sympy.Symbol):
                found(size, SymbolSource(spec.index, "size", dim))
            sized |= getattr(size, "free_symbols", set())
        layout = [(d, "stride", e) for d, e in enumerate(spec.strides or ())] + [(None, "offset", spec.offset)]
        for dim, attr, expr in layout:
            if isinstance(expr, sympy.Symbol):
                found(expr, SymbolSource(spec.index, attr, dim))
            for sym in getattr(expr, "free_symbols", ()):
                layout_of[sym] = layout_of.get(sym, True) and spec.copied
    kinds = dict(padded_kinds)
    for sym in sources:
        if sym not in kinds:
            kinds[sym] = SymbolKind.LAYOUT if sym not in sized and layout_of.get(sym) else SymbolKind.SPECIALIZED
    unread = [sym for spec in inputs if spec.role is not Role.UNUSED for e in [spec.expr, *(spec.shape or ())]
              for sym in getattr(e, "free_symbols", ()) if sym not in sources]
    if unread:
        raise ValueError(f"size symbols {sorted(map(str, unread))}: no graph input carries them as a size, "
                         f"stride, storage offset or SymInt")
    return sources, kinds
