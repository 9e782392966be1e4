"""Write-back: what the graph wrote into the caller's copied inputs reaches the caller's tensors.

Copied inputs (per-step data) live in the graph's static buffers, so the graph's writes land there.
After each step the runner copies exactly the written elements back. In a padded graph it replays
each write's location on the caller's tensor with the step's real sizes (a small FX graph of the
views alone, `locate`) and copies the real prefix of the same view of the buffer into it; graph
outputs that are views of copied inputs are rebuilt the same way, as views of the caller's
tensors, as eager returns them. Where steps are not padded the buffers have the caller's exact
shapes and a written input is copied back whole.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Sequence

import torch
from torch import fx

from .fx_utils import extract_graph, nodes_in
from .mutations import MutationFacts, output_aliases, view_closure
from .roles import GraphSignature


@dataclasses.dataclass(frozen=True)
class WriteBack:
    """How one graph's input writes and input-aliasing outputs reach the caller."""

    locate: fx.GraphModule | None  # graph inputs -> (written views..., aliased outputs...)
    located: tuple[int, ...]  # input index of each written view `locate` returns
    whole: tuple[int, ...]  # inputs copied back whole (unpadded steps)
    outputs: tuple[int, ...]  # flat output positions `locate` returns after the written views

    def describe(self) -> dict[str, Any]:
        return {"located_writes": list(self.located), "whole_inputs": list(self.whole),
                "outputs_from_inputs": list(self.outputs)}

    def views(self, args: Sequence[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(written views, aliased outputs) of the graph's inputs `args`."""
        if self.locate is None:
            return [], []
        found = list(self.locate(*args))
        return found[: len(self.located)], found[len(self.located):]


def build_write_back(gm: fx.GraphModule, signature: GraphSignature, facts: MutationFacts) -> WriteBack:
    """The write-back of `gm`, whose padding decision `signature` made from the same `facts`."""
    copied = {spec.index for spec in signature.inputs if spec.copied}
    writes = [w for w in facts.unsafe() if w.input in copied]
    located = writes if signature.can_pad else []
    whole = () if signature.can_pad else tuple(sorted({w.input for w in writes}))
    aliases = {i: n for i, n in output_aliases(gm, facts, copied).items() if view_closure([n], gm) is not None}
    targets: list[Any] = [(w.target, w.index) for w in located] + [(node, None) for node in aliases.values()]
    if not targets:
        return WriteBack(None, (), whole, ())
    return WriteBack(_locate_graph(gm, targets), tuple(w.input for w in located), whole, tuple(aliases))


def _locate_graph(gm: fx.GraphModule, targets: Sequence[tuple[fx.Node, Any]]) -> fx.GraphModule:
    """An FX graph over `gm`'s inputs returning each target view (`x[index]` where an index is given)."""
    nodes = [n for node, index in targets for n in [node, *nodes_in(index)]]
    closure = view_closure(nodes, gm)
    if closure is None:
        raise ValueError(f"write-back: {nodes} are not reached from the graph inputs by views alone")

    def views(graph: fx.Graph, remap: Any) -> tuple:
        return tuple(remap(node) if index is None else graph.call_function(operator.getitem, remap((node, index)))
                     for node, index in targets)

    return extract_graph(gm, closure, views)


def overlapping_writes(views: Sequence[torch.Tensor], inputs: Sequence[int]) -> list[int]:
    """Inputs with two written views sharing an element (views of a graph's static buffers): the
    later write would land where the earlier one's real rows are copied back from."""
    seen: dict[int, torch.Tensor] = {}
    clashes = []
    for view, index in zip(views, inputs):
        size = view.untyped_storage().nbytes() // view.element_size()
        elements = torch.zeros(size, dtype=torch.bool)
        positions = torch.arange(size).as_strided(view.shape, view.stride(), view.storage_offset())
        elements[positions.reshape(-1)] = True
        if index in seen and bool((seen[index] & elements).any()):
            clashes.append(index)
        seen[index] = seen[index] | elements if index in seen else elements
    return clashes


def copy_written(dest: torch.Tensor, src: torch.Tensor) -> None:
    """`dest` (the caller's view, real sizes) from the real prefix of `src` (the buffer's view)."""
    for dim, size in enumerate(dest.shape):
        if src.shape[dim] != size:
            src = src.narrow(dim, 0, size)
    dest.copy_(src)
