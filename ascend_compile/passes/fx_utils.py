"""Small helpers over FX graphs shared by the passes."""
from __future__ import annotations

from typing import Any

import sympy
import torch
from torch import fx


def clone_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose graph can be rewritten without touching the original (meta is shared)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


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
