"""Placeholder roles: what each graph input is, so the runner pads it by one table of rules.

A role comes from the argument an input feeds (`seq_lens`, `block_table`, `query_start_loc` of an
attention node, `slot_mapping` and the caches of `reshape_and_cache`), else from what it is:
inputs with a symbolic (batch-dependent) size, and in static graphs any tensor that is not a
parameter or buffer (dynamo marks those), are batch data; 0-d tensors are scalars copied each
step; weights and buffers are static and used in place.

The signature also says how every size symbol of the graph is padded for a bucket and read back
from a step's real inputs, which is all the runner needs to pad inputs and unpad outputs.
"""
from __future__ import annotations

import dataclasses
import enum
import operator
from typing import Any, Sequence

import sympy
import torch
from torch import fx

from .find_attention import AttentionArgs
from .fx_utils import example_value, is_op, placeholders, shape_exprs, size_expr


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


#: The value padding rows / columns get, per role.
PAD_VALUE = {
    Role.SEQ_LENS: 0,
    Role.BLOCK_TABLE: 0,
    Role.SLOT_MAPPING: -1,
    Role.BATCH: 0,
}


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One graph input: its position, role and (symbolic) shape."""

    index: int
    name: str
    role: Role
    shape: tuple[Any, ...] | None
    expr: Any = None  # the size expression of a SymInt input
    mutated: bool = False  # the graph writes into it (the runner copies it back after the step)

    @property
    def dynamic(self) -> bool:
        return self.shape is not None and any(not isinstance(d, int) for d in self.shape)


@dataclasses.dataclass(frozen=True)
class GraphSignature:
    """Roles of all inputs and the size symbols of the graph."""

    inputs: tuple[InputSpec, ...]
    tokens: Any  # number of query tokens T: an int or a sympy expression
    sequences: Any  # number of sequences B: an int or a sympy expression
    symbol_sources: dict[sympy.Symbol, tuple[int, int | None]]  # input index, dim (None: SymInt)
    symbol_kinds: dict[sympy.Symbol, str]  # "tokens", "blocks" or "query_start_loc"
    outputs: tuple[Any, ...]  # per output: shape exprs, or None for non-tensors

    @property
    def is_static(self) -> bool:
        return not self.symbol_sources

    @property
    def can_pad(self) -> bool:
        """Whether steps can be padded to a bucket: padded tokens need padded sequences to go to."""
        return isinstance(self.tokens, int) or not isinstance(self.sequences, int)

    def by_role(self, role: Role) -> list[InputSpec]:
        return [spec for spec in self.inputs if spec.role is role]

    def padded_symbols(self, bucket: int, max_blocks: int) -> dict[sympy.Symbol, int]:
        """Symbol values of the graph captured for `bucket` tokens (and as many sequences)."""
        values = {"tokens": bucket, "blocks": max_blocks, "query_start_loc": bucket + 1}
        return {sym: values[kind] for sym, kind in self.symbol_kinds.items()}

    def actual_symbols(self, args: Sequence[Any]) -> dict[sympy.Symbol, int]:
        """Symbol values of one step's real inputs."""
        out = {}
        for sym, (index, dim) in self.symbol_sources.items():
            value = args[index]
            out[sym] = int(value) if dim is None else int(value.shape[dim])
        return out


def evaluate(expr: Any, values: dict[sympy.Symbol, int]) -> int:
    """An int or a size expression at the given symbol values."""
    if isinstance(expr, int):
        return expr
    return int(expr.xreplace(values))


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
        args = AttentionArgs.of(node)
        assign(args.block_table, Role.BLOCK_TABLE, f"{node.name}.block_table")
        assign(args.seq_lens, Role.SEQ_LENS, f"{node.name}.seq_lens")
        assign(args.query_start_loc, Role.QUERY_START_LOC, f"{node.name}.query_start_loc")
        for cache in (args.key_cache, args.value_cache):
            if isinstance(cache, fx.Node) and cache.op == "placeholder":
                roles[cache.name] = Role.KV_CACHE
    for node in gm.graph.nodes:
        if is_op(node, torch.ops.ascend.reshape_and_cache):
            key, value, key_cache, value_cache, slot_mapping = node.args
            assign(slot_mapping, Role.SLOT_MAPPING, f"{node.name}.slot_mapping")
            for cache in (key_cache, value_cache):
                if isinstance(cache, fx.Node) and cache.op == "placeholder":
                    roles[cache.name] = Role.KV_CACHE
    return roles


def _role_of_value(node: fx.Node, value: Any, shape: tuple | None) -> Role:
    """Role of an input no attention argument names: weights stay, per-step data is copied."""
    if isinstance(value, torch.SymInt):
        return Role.SYMINT
    if shape is None:
        return Role.STATIC
    if any(not isinstance(d, int) for d in shape):
        return Role.BATCH
    if len(shape) == 0:
        return Role.SCALAR
    if "tensor_dict" in node.meta and "_dynamo_static_input_type" not in node.meta["tensor_dict"]:
        return Role.BATCH  # dynamo marks parameters and buffers; anything else is the caller's per-step data
    return Role.STATIC


def _mutated_placeholders(gm: fx.GraphModule) -> set[str]:
    """Names of the inputs the graph writes into: in-place methods, item assignment, mutating ops, out=."""
    written: set[str] = set()

    def mark(value: Any) -> None:
        if isinstance(value, fx.Node) and value.op == "placeholder":
            written.add(value.name)

    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_"):
            mark(node.args[0])
        elif node.op == "call_function":
            if node.target is operator.setitem:
                mark(node.args[0])
            schema = getattr(node.target, "_schema", None) or getattr(getattr(node.target, "default", None), "_schema", None)
            if schema is not None:
                for i, arg in enumerate(schema.arguments):
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        mark(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
        mark(node.kwargs.get("out"))
    return written


def assign_roles(gm: fx.GraphModule, attention: Sequence[fx.Node]) -> GraphSignature:
    """Give each placeholder a role (recorded as `meta["ascend_role"]`) and describe the graph's sizes."""
    roles = _role_of_uses(gm, attention)
    mutated = _mutated_placeholders(gm)
    inputs = []
    for index, node in enumerate(placeholders(gm)):
        value = example_value(node)
        shape = shape_exprs(value)
        expr = size_expr(value) if isinstance(value, torch.SymInt) else None
        role = roles.get(node.name)
        if role is None:
            role = _role_of_value(node, value, shape)
        node.meta["ascend_role"] = role.value
        inputs.append(InputSpec(index, node.name, role, shape, expr, mutated=node.name in mutated))

    sources, kinds = _symbols(inputs)
    first = AttentionArgs.of(attention[0])
    tokens = shape_exprs(example_value(first.query))[0]
    sequences = shape_exprs(example_value(first.seq_lens))[0]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = tuple(shape_exprs(example_value(o)) if isinstance(o, fx.Node) else None for o in _flat(output_node.args[0]))
    signature = GraphSignature(tuple(inputs), tokens, sequences, sources, kinds, outputs)
    for spec in inputs:
        if spec.role in (Role.KV_CACHE, Role.STATIC) and spec.dynamic:
            raise ValueError(f"{spec.name}: a {spec.role.value} input must have a static shape, got {spec.shape}")
    return signature


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


def _symbols(inputs: Sequence[InputSpec]) -> tuple[dict, dict]:
    sources: dict[sympy.Symbol, tuple[int, int | None]] = {}
    kinds: dict[sympy.Symbol, str] = {}
    for spec in inputs:
        if spec.role is Role.SYMINT and isinstance(spec.expr, sympy.Symbol):
            sources.setdefault(spec.expr, (spec.index, None))
        for dim, size in enumerate(spec.shape or ()):
            if not isinstance(size, sympy.Symbol):
                continue
            sources.setdefault(size, (spec.index, dim))
            if spec.role is Role.BLOCK_TABLE and dim == 1:
                kinds[size] = "blocks"
            elif spec.role is Role.QUERY_START_LOC and dim == 0:
                kinds[size] = "query_start_loc"
            elif dim == 0:
                kinds.setdefault(size, "tokens")
    for spec in inputs:
        exprs = [spec.expr] if spec.expr is not None else list(spec.shape or ())
        for size in exprs:
            if isinstance(size, int):
                continue
            unknown = [s for s in size.free_symbols if s not in kinds]
            if unknown:
                raise ValueError(
                    f"{spec.name}: cannot tell how to pad size {size} (symbols {unknown} are not a token, "
                    f"sequence or block-table dimension)"
                )
    return sources, kinds
