"""Attention nodes of a graph, and the pass bringing other runtimes' attention ops onto the contract.

`ascend.attention` is found as is. Another runtime registers its own op with an adapter
(`register_attention_op`); `adapt_attention` (the pipeline's first pass) calls the adapter to rewrite
each such node into an `ascend.attention` node, so every later pass sees one kind of attention node,
which `attention_nodes` lists without changing anything.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import fx

from ..ops.features import AttentionFeatures
from .fx_utils import fill_fake_values, is_op

#: An adapter inserts, before `node`, the nodes that bring its arguments onto the contract of
#: `ascend.attention`, calls `ascend.attention` on them, makes the result take the place of the
#: node's output (its users, or the output buffer it writes), and returns the new attention node.
Adapter = Callable[[fx.Graph, fx.Node], fx.Node]

_ADAPTERS: dict[Any, Adapter] = {}


def register_attention_op(op: Any, adapter: Adapter) -> None:
    """Declare another runtime's attention op (an OpOverloadPacket or OpOverload) and its adapter."""
    if op is torch.ops.ascend.attention:
        raise ValueError("op: ascend.attention is built in and needs no adapter")
    _ADAPTERS[op] = adapter


def unregister_attention_op(op: Any) -> None:
    """Forget an op declared with `register_attention_op`."""
    _ADAPTERS.pop(op, None)


@dataclasses.dataclass(frozen=True)
class AttentionArgs:
    """The FX arguments of one `ascend.attention` node, by name."""

    query: fx.Node
    key_cache: fx.Node
    value_cache: fx.Node
    block_table: fx.Node
    seq_lens: fx.Node
    query_start_loc: fx.Node
    scale: float
    window: int | None = None
    soft_cap: float | None = None
    sinks: fx.Node | None = None

    @classmethod
    def of(cls, node: fx.Node) -> "AttentionArgs":
        names = [f.name for f in dataclasses.fields(cls)]
        bound = dict(zip(names, node.args))
        bound.update(node.kwargs)
        return cls(**bound)

    @property
    def features(self) -> AttentionFeatures:
        """The layer's features (`ops/features.py`), static in the graph."""
        for name, value in (("window", self.window), ("soft_cap", self.soft_cap)):
            if value is not None and not isinstance(value, (int, float)):
                raise ValueError(f"{name}: expected a constant of the layer, got {value} (a value computed in the graph)")
        return AttentionFeatures(self.window, self.soft_cap, self.sinks is not None)


def _adapter_for(node: fx.Node) -> Adapter | None:
    if node.op != "call_function":
        return None
    for op, adapter in _ADAPTERS.items():
        if is_op(node, op):
            return adapter
    return None


def attention_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The `ascend.attention` nodes of `gm`, in graph order."""
    return [n for n in gm.graph.nodes if is_op(n, torch.ops.ascend.attention)]


def has_attention(gm: fx.GraphModule) -> bool:
    """Whether `gm` calls attention: `ascend.attention` or a registered foreign op."""
    return any(is_op(n, torch.ops.ascend.attention) or _adapter_for(n) is not None for n in gm.graph.nodes)


def adapt_attention(gm: fx.GraphModule) -> list[fx.Node]:
    """Rewrite registered foreign attention ops of `gm` into `ascend.attention`; returns all attention nodes."""
    graph = gm.graph
    adapted = False
    for node in list(graph.nodes):
        adapter = _adapter_for(node)
        if adapter is None:
            continue
        adapted = True
        with graph.inserting_before(node):
            new = adapter(graph, node)
        if not is_op(new, torch.ops.ascend.attention):
            raise TypeError(f"adapter for {node.target}: expected it to return an ascend.attention node, got {new.target}")
        if node.users:
            raise ValueError(f"adapter for {node.target}: node {node.name} still has users {list(node.users)}")
        new.meta["ascend_adapted_from"] = f"{node.target} ({node.name})"
        graph.erase_node(node)
        fill_fake_values(graph)
    if adapted:
        graph.lint()
        gm.recompile()
    return attention_nodes(gm)

