"""Hoist attention metadata the graph computes from its inputs into a per-step host prologue.

Serving runtimes keep metadata in their own form (transformers' continuous batching passes
cumulative lengths and cache read indices, not a block table) and the model derives the attention
arguments from it. The runner must hold those arguments before the step runs: it reads lengths on
the host, picks the bucket and pads by role. So each computed block table, `seq_lens`,
`query_start_loc` and slot mapping becomes a graph input of its own, and a small FX graph, the
prologue, computes them from the step's inputs on every call (host planning apart from the
captured work, as FlashInfer splits `plan()` from `run()`). Identical computations of several
layers are hoisted once.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
from torch import fx

from ..ops import library  # noqa: F401  (registers torch.ops.ascend)
from .fx_utils import ancestors, example_value, extract_graph, is_op, node_arg, placeholders, written_args
from .providers import Provider

#: The metadata arguments that may be computed, by op: (argument position, name).
HOISTED_ARGS = {
    torch.ops.ascend.attention: ((3, "block_table"), (4, "seq_lens"), (5, "query_start_loc")),
    torch.ops.ascend.reshape_and_cache: ((4, "slot_mapping"),),
    torch.ops.ascend.mla_attention: ((4, "block_table"), (5, "seq_lens"), (6, "query_start_loc")),
    torch.ops.ascend.mla_cache_write: ((4, "slot_mapping"),),
}


@dataclasses.dataclass(frozen=True)
class Prologue:
    """Computes a step's extra graph inputs from its arguments: first what a provider supplies
    (`passes/providers.py`), then the hoisted metadata (None: nothing was hoisted)."""

    graph: fx.GraphModule | None
    names: tuple[str, ...] = ()
    provider: Provider | None = None

    def extend(self, args: Sequence[Any]) -> Sequence[Any]:
        """The step's inputs followed by the provided inputs and the hoisted metadata (`args`
        itself where there are none: read during the step, never written)."""
        if self.provider is not None:
            args = (*args, *self.provider.read(args))
        if self.graph is None:
            return args
        return (*args, *self.graph(*args))

    def host_copies(self, args: Sequence[Any]) -> Mapping[str, list[int]]:
        """The provider's host copies of length inputs for this step (`Provider.host`), by input name."""
        if self.provider is None or self.provider.host is None:
            return {}
        return self.provider.host(args)


def _closure(value: fx.Node, what: str) -> list[fx.Node]:
    """The nodes computing `value` from graph inputs, in graph order; a clear error when one is not
    a pure op (it writes a tensor, or is itself an attention or cache-write node)."""
    nodes = [n for n in ancestors([value]) if n.op != "placeholder"]
    for node in nodes:
        if node.op not in ("call_function", "call_method") or written_args(node) or any(
            is_op(node, op) for op in HOISTED_ARGS
        ):
            raise ValueError(
                f"{what}: computed by {node.format_node()}, which is not a pure function of the graph inputs; "
                f"the runner reads attention metadata on the host before the step, so it must be an input or "
                f"computed from inputs alone"
            )
    return nodes


def _key(node: fx.Node, memo: dict[fx.Node, Any]) -> Any:
    """A structural key: nodes computing the same thing from the same inputs get the same key."""
    if node not in memo:
        if node.op == "placeholder":
            memo[node] = ("placeholder", node.name)
        else:
            args = fx.node.map_arg((node.args, tuple(sorted(node.kwargs.items()))), lambda n: _key(n, memo))
            memo[node] = (node.op, node.target, repr(args))
    return memo[node]


def hoist_metadata(gm: fx.GraphModule, provider: Provider | None = None) -> Prologue:
    """Turn every computed metadata argument of `gm`'s attention and cache-write nodes into a new
    graph input (after the existing ones, `provider`'s included), and return the prologue computing
    them (and reading `provider`'s)."""
    sites = [(node, position, name) for node in gm.graph.nodes for op, args in HOISTED_ARGS.items()
             if is_op(node, op) for position, name in args]
    memo: dict[fx.Node, Any] = {}
    hoisted: dict[Any, tuple[fx.Node, list[tuple[fx.Node, int]]]] = {}
    computing: set[fx.Node] = set()  # the nodes of the values the prologue computes
    dead: set[fx.Node] = set()  # every node computing a hoisted argument: erased where nothing else uses it
    for node, position, name in sites:
        value = node_arg(node, position, name)
        if not isinstance(value, fx.Node) or value.op == "placeholder":
            continue
        closure = _closure(value, f"{node.name}.{name}")
        dead.update(closure)
        key = _key(value, memo)
        if key not in hoisted:
            hoisted[key] = (value, [])
            computing.update(closure)
        hoisted[key][1].append((node, position))
    if not hoisted:
        return Prologue(None, (), provider)
    values = [value for value, _ in hoisted.values()]
    prologue = extract_graph(gm, computing, lambda graph, remap: remap(tuple(values)))
    graph = gm.graph
    cursor = placeholders(gm)[-1]
    names = []
    for index, (value, uses) in enumerate(hoisted.values()):
        with graph.inserting_after(cursor):
            cursor = graph.placeholder(f"ascend_hoisted_{index}")
        cursor.meta["example_value"] = example_value(value)
        cursor.meta["ascend_hoisted_from"] = value.name
        for node, position in uses:
            node.update_arg(position, cursor)
        names.append(cursor.name)
    for node in reversed(list(graph.nodes)):
        if node in dead and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return Prologue(prologue, tuple(names), provider)
