"""The static buffers of one captured graph and the copies into and out of them.

A captured graph reads its per-step inputs from fixed addresses, so each copied input (tokens,
positions, metadata) gets a static buffer sized for the graph's padded geometry; a step is copied
in and padded by role, and after the replay exactly what the eager step would write into the
caller's tensors is copied back (`passes/write_back.py`). Inputs used in place (weights, KV caches)
are passed through.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import fx

from ..passes.padding import dummy_limit
from ..passes.roles import PAD_VALUE, GraphSignature, Role
from ..passes.size_symbols import SymbolKind, evaluate
from ..passes.write_back import WriteBack, copy_written, overlapping_writes
from ..runtime.base import Runtime
from .inputs import Geometry, Step, gather, padded_copies, padded_shape, padded_start_loc


#: Step shapes whose copy plans (and narrowed outputs) a graph keeps: a serving loop sees one per
#: batch size and block-table width.
MAX_STEP_SHAPES = 4096

T = TypeVar("T")


def per_step_shape(cache: dict[tuple, T], key: tuple, make: Callable[[], T]) -> T:
    """`cache[key]`, made by `make()` the first time; a cache holding `MAX_STEP_SHAPES` shapes
    starts again empty."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= MAX_STEP_SHAPES:
            cache.clear()
        value = cache[key] = make()
    return value


@dataclasses.dataclass(frozen=True)
class _CopyPlan:
    """The copies staging one step shape: destinations (the inputs' regions, then the padding
    regions), the step's inputs they take, and the padding tensors."""

    dests: list[torch.Tensor]
    inputs: Callable[[Sequence[Any]], tuple]
    padding: list[torch.Tensor]


class Staging:
    """Static buffers for `gm`'s copied inputs at the padded sizes `padded`."""

    def __init__(self, signature: GraphSignature, write_back: WriteBack, runtime: Runtime, gm: fx.GraphModule,
                 padded: dict) -> None:
        self.signature = signature
        self.write_back = write_back
        self.padded = dict(padded)
        self.geometry = Geometry(evaluate(signature.tokens, self.padded), evaluate(signature.sequences, self.padded),
                                 dummy_limit(gm, self.padded))
        dtypes = [n.meta["example_value"].dtype if isinstance(n.meta.get("example_value"), torch.Tensor) else None
                  for n in gm.graph.find_nodes(op="placeholder")]
        self.copied = [spec for spec in signature.inputs if spec.copied]
        self.buffers: dict[int, torch.Tensor] = {
            spec.index: runtime.empty(padded_shape(spec, self.padded), dtypes[spec.index]) for spec in self.copied
        }
        for sym, kind in signature.symbol_kinds.items():
            if kind is SymbolKind.LAYOUT:
                source = signature.symbol_sources[sym]
                self.padded[sym] = source.read(self.buffers[source.index])
        self._symint = {spec.index: evaluate(spec.expr, self.padded) for spec in signature.by_role(Role.SYMINT)}
        self.written_views: list[torch.Tensor] = []
        self._copy_plans: dict[tuple, _CopyPlan] = {}

    def graph_args(self, step_args: Sequence[Any]) -> list[Any]:
        """Arguments of the graph: static buffers, padded sizes, and in-place inputs as given."""
        buffers, symint = self.buffers, self._symint
        return [buffers[i] if i in buffers else symint[i] if i in symint else arg for i, arg in enumerate(step_args)]

    def fill_padding(self) -> None:
        """Every buffer holding padding only (a capture must not depend on the values it sees)."""
        geometry = self.geometry
        for spec in self.copied:
            buf = self.buffers[spec.index]
            if spec.role is Role.QUERY_START_LOC:
                buf.copy_(torch.tensor(padded_start_loc([0], 0, geometry.tokens, geometry.seqs), dtype=buf.dtype))
            else:
                buf.fill_(PAD_VALUE.get(spec.role, 0))

    def copy_in(self, step: Step) -> None:
        """The step's inputs into the static buffers, padded by role: one batched copy, planned once
        per step shape."""
        plan = per_step_shape(self._copy_plans, tuple(step.symbols.values()), lambda: self._plan_copies(step))
        torch._foreach_copy_(plan.dests, [*plan.inputs(step.args), *plan.padding], non_blocking=True)

    def _plan_copies(self, step: Step) -> _CopyPlan:
        input_dests, indices, padding_dests, padding = [], [], [], []
        for spec in self.copied:
            for dest, source in padded_copies(spec, step.args[spec.index].shape, self.buffers[spec.index], step.tokens,
                                              self.geometry.tokens):
                if source is None:
                    input_dests.append(dest)
                    indices.append(spec.index)
                else:
                    padding_dests.append(dest)
                    padding.append(source)
        return _CopyPlan(input_dests + padding_dests, gather(indices), padding)

    def locate_writes(self, graph_args: Sequence[Any]) -> list[str]:
        """Find where the graph writes its copied inputs in the static buffers (fixed for the graph's
        life); returns the inputs written twice at overlapping places, which cannot be copied back."""
        self.written_views = self.write_back.views(graph_args)[0]
        return [self.signature.inputs[i].name for i in overlapping_writes(self.written_views, self.write_back.located)]

    def copy_back(self, step: Step) -> dict[int, torch.Tensor]:
        """Exactly what the graph wrote into copied inputs, into the caller's tensors; returns, by
        output position, the outputs that are views of copied inputs, as views of the caller's."""
        write_back = self.write_back
        if write_back.locate is None and not write_back.whole:  # nothing written, nothing aliased
            return {}
        written, aliased = write_back.views(step.args)
        for dest, src in zip(written, self.written_views):
            copy_written(dest, src)
        for index in write_back.whole:
            copy_written(step.args[index], self.buffers[index])
        return dict(zip(write_back.outputs, aliased))

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
