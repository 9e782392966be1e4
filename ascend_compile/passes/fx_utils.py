"""Small helpers over FX graphs shared by the passes."""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable

import sympy
import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule


def clone_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose graph can be rewritten without touching the original (meta is shared).

    Its Python code is generated when first needed (called, printed or dumped), as dynamo's own
    graph modules are: the passes rewrite the clones and read their graphs, and generating the
    code of a large graph at every clone and rewrite was a third of the compile time.
    """
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return _LazyGraphModule(gm, graph)


def example_value(node: fx.Node) -> Any:
    """The fake value dynamo (or `make_fx`) recorded for a node, or None."""
    return node.meta.get("example_value", node.meta.get("val"))


def size_expr(size: Any) -> sympy.Expr | int:
    """A dimension as an int or a sympy expression over the graph's size symbols."""
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_number else expr
    return int(size)


def shape_exprs(value: Any) -> tuple[sympy.Expr | int, ...] | None:
    """The shape of a tensor-valued example as ints / sympy expressions."""
    if isinstance(value, torch.Tensor):
        return tuple(size_expr(s) for s in value.shape)
    return None


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's placeholders in argument order."""
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def is_op(node: fx.Node, op: Any) -> bool:
    """Whether `node` calls `op`, given as a packet (`torch.ops.ns.name`) or an overload."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is op:
        return True
    packet = getattr(target, "overloadpacket", None)
    return packet is not None and packet is op


def fill_fake_values(graph: fx.Graph) -> None:
    """Give nodes a pass inserted (e.g. an adapter's views) the fake values later passes read.

    Runs each such node's target on its arguments' fake values, in the graph's fake mode.
    """
    values = [example_value(n) for n in graph.nodes]
    fake_mode = torch._guards.detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return
    with fake_mode:
        for node in graph.nodes:
            if node.op not in ("call_function", "call_method") or example_value(node) is not None:
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
            if node.op == "call_method":
                self_value, *rest = args
                result = getattr(self_value, node.target)(*rest, **kwargs)
            else:
                result = node.target(*args, **kwargs)
            node.meta["example_value"] = result


def nodes_in(value: Any) -> list[fx.Node]:
    """The FX nodes inside an argument structure (tuples, lists, slices, dicts)."""
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def ancestors(values: Iterable[fx.Node]) -> list[fx.Node]:
    """`values` and every node they are computed from (placeholders included), in graph order."""
    needed: set[fx.Node] = set()
    stack = list(values)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack += node.all_input_nodes
    graph = next(iter(needed)).graph if needed else None
    return [n for n in graph.nodes if n in needed] if graph is not None else []


def extract_graph(gm: fx.GraphModule, nodes: Iterable[fx.Node],
                  outputs: Callable[[fx.Graph, Callable[[Any], Any]], tuple]) -> fx.GraphModule:
    """A graph over all of `gm`'s inputs holding copies of `nodes` (in graph order), returning what
    `outputs(graph, remap)` builds (`remap` maps `gm`'s nodes inside an argument to their copies)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
    wanted = set(nodes)
    for node in gm.graph.nodes:
        if node in wanted and node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(outputs(graph, lambda value: fx.node.map_arg(value, lambda n: env[n])))
    return fx.GraphModule(gm, graph)


#: Tensor methods and operators that write their first argument despite not ending in "_".
_IN_PLACE_METHODS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                               "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__"})
_IN_PLACE_OPERATORS = frozenset({operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                 operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                                 operator.ixor})


def schema_of(target: Any) -> torch.FunctionSchema | None:
    """The schema of an op overload, or of an overload packet's default overload; None for others."""
    schema = getattr(target, "_schema", None)
    if schema is None and getattr(target, "overloads", None) is not None:
        schema = getattr(getattr(target, "default", None), "_schema", None)
    return schema


def node_arg(node: fx.Node, position: int, name: str) -> Any:
    """A call's argument given by position or by keyword (None when absent)."""
    return node.args[position] if position < len(node.args) else node.kwargs.get(name)


def written_args(node: fx.Node) -> list[Any]:
    """The arguments a call writes: an in-place method's or operator's self, an `out=` tensor, and
    arguments its schema annotates as written (`Tensor(a!)`: in-place ops, custom ops' `mutates_args`)."""
    written = []
    if node.op == "call_method":
        name = node.target
        if name.endswith("_") and not name.startswith("_") or name in _IN_PLACE_METHODS:
            written.append(node.args[0])
    elif node.op == "call_function":
        if node.target in _IN_PLACE_OPERATORS:
            written.append(node.args[0])
        schema = schema_of(node.target)
        for i, spec in enumerate(schema.arguments if schema is not None else ()):
            if spec.alias_info is not None and spec.alias_info.is_write:
                written.append(node_arg(node, i, spec.name))
    if "out" in node.kwargs:
        written.append(node.kwargs["out"])
    return [w for w in written if w is not None]
