"""Attention nodes of a graph, and the pass bringing other runtimes' attention ops onto the contract.

`ascend.attention` and `ascend.mla_attention` (latent attention, `ops/mla.py`) are found as they
are. Another runtime registers its own op with an adapter (`register_attention_op`);
`adapt_attention` (the pipeline's first pass) calls the adapter to rewrite each such node into an
`ascend.attention` node, so every later pass sees the built-in attention ops only, which
`attention_nodes` lists without changing anything. `attention_args` is the one view of either op's
arguments: both name their metadata alike (`block_table`, `seq_lens`, `query_start_loc`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import fx

from ..ops import tiling
from ..ops.features import PLAIN, AttentionFeatures
from .fx_utils import example_value, fill_fake_values, is_op

#: An adapter inserts, before `node`, the nodes that bring its arguments onto the contract of
#: `ascend.attention`, calls `ascend.attention` on them, makes the result take the place of the
#: node's output (its users, or the output buffer it writes), and returns the new attention node.
Adapter = Callable[[fx.Graph, fx.Node], fx.Node]

_ADAPTERS: dict[Any, Adapter] = {}


def register_attention_op(op: Any, adapter: Adapter) -> None:
    """Declare another runtime's attention op (an OpOverloadPacket or OpOverload) and its adapter."""
    if op in _ARGS or getattr(op, "overloadpacket", None) in _ARGS:
        raise ValueError(f"op: {op} is built in and needs no adapter")
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
        return _bind(cls, node)

    @property
    def caches(self) -> tuple[Any, ...]:
        return (self.key_cache, self.value_cache)

    def shape(self) -> tiling.AttentionShape:
        return tiling.AttentionShape.of(example_value(self.query), example_value(self.key_cache))

    @property
    def features(self) -> AttentionFeatures:
        """The layer's features (`ops/features.py`), static in the graph; a soft-cap may be a host float
        the graph takes as an input (`_traced_float`)."""
        if self.window is not None and not isinstance(self.window, int):
            raise ValueError(f"window: expected a constant of the layer, got {self.window} (a value computed in the "
                             f"graph)")
        soft_cap = self.soft_cap
        if soft_cap is not None and not isinstance(soft_cap, (int, float)):
            soft_cap = _traced_float("soft_cap", soft_cap)
        return AttentionFeatures(self.window, soft_cap, self.sinks is not None)


@dataclasses.dataclass(frozen=True)
class MlaArgs:
    """The FX arguments of one `ascend.mla_attention` node, by name; `query` and `key_cache` are
    its token-sized query (`q_nope`) and the cache giving the block size (`kv_c_cache`)."""

    q_nope: fx.Node
    q_pe: fx.Node
    kv_c_cache: fx.Node
    k_pe_cache: fx.Node
    block_table: fx.Node
    seq_lens: fx.Node
    query_start_loc: fx.Node
    scale: float

    @classmethod
    def of(cls, node: fx.Node) -> "MlaArgs":
        return _bind(cls, node)

    @property
    def query(self) -> fx.Node:
        return self.q_nope

    @property
    def key_cache(self) -> fx.Node:
        return self.kv_c_cache

    @property
    def caches(self) -> tuple[Any, ...]:
        return (self.kv_c_cache, self.k_pe_cache)

    def shape(self) -> tiling.AttentionShape:
        return tiling.AttentionShape.of_mla(example_value(self.q_nope), example_value(self.q_pe),
                                            example_value(self.kv_c_cache))

    @property
    def features(self) -> AttentionFeatures:
        return PLAIN


def _bind(cls: type, node: fx.Node) -> Any:
    """`cls` (fields named like the op's arguments) from a node's positional and keyword arguments."""
    names = [f.name for f in dataclasses.fields(cls)]
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return cls(**bound)


#: The built-in attention ops and the view of their arguments.
_ARGS = {torch.ops.ascend.attention: AttentionArgs, torch.ops.ascend.mla_attention: MlaArgs}


def attention_args(node: fx.Node) -> AttentionArgs | MlaArgs:
    """The arguments of a built-in attention node, by name."""
    for op, cls in _ARGS.items():
        if is_op(node, op):
            return cls.of(node)
    raise ValueError(f"{node.name}: not an attention node ({node.target})")


def by_name(args: AttentionArgs | MlaArgs) -> dict[str, Any]:
    """Every argument of an attention node, keyed by the op's argument names."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}


def layer_name(node: fx.Node) -> str:
    """An attention node as a refusal names it: its module where dynamo recorded it, and the node."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return node.name
    return f"layer {list(stack.values())[-1][0]} (node {node.name})"


def _is_attention(node: fx.Node) -> bool:
    return any(is_op(node, op) for op in _ARGS)


def _adapter_for(node: fx.Node) -> Adapter | None:
    if node.op != "call_function":
        return None
    for op, adapter in _ADAPTERS.items():
        if is_op(node, op):
            return adapter
    return None


def attention_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The `ascend.attention` and `ascend.mla_attention` nodes of `gm`, in graph order."""
    return [n for n in gm.graph.nodes if _is_attention(n)]


def has_attention(gm: fx.GraphModule) -> bool:
    """Whether `gm` calls attention: a built-in attention op or a registered foreign op."""
    return any(_is_attention(n) or _adapter_for(n) is not None for n in gm.graph.nodes)


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



def _traced_float(name: str, node: Any) -> float:
    """The value at trace of a float the graph reads from a host scalar input (dynamo wraps a module's
    float attribute so under `dynamic=True`): for the plan only. The kernel keeps the node, so each
    capture reads the input's value, and the runner checks host scalars every step, re-capturing on a
    change (`lowering/input_checks.py`). Anything else computed in the graph is refused."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    hint = getattr(getattr(value, "node", None), "hint", None) if isinstance(value, torch.SymFloat) else None
    if hint is None:
        raise ValueError(f"{name}: expected a constant of the layer or a host float input, got {node} (a value "
                         f"computed in the graph)")
    return float(hint)
