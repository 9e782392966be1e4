"""What dynamo passes a compiled graph and where it finds each input, recorded when it is compiled.

Dynamo lifts the parameters and buffers the model reads into graph inputs, beside the caller's
tensors and the sizes it made symbolic; each placeholder's `GraphArg` names its *source*, a Python
expression over the frame's locals `L` and globals `G` (`L['self']._modules['embed']._parameters
['weight']`, `L['positions'].size()[0]`). Dynamo drops these records once the compile is over, so
the backend keeps them here, with what a direct call must check that dynamo's guards did: the
static sizes of each tensor input and the shape guards relating the symbolic ones
(`L['positions'].size()[0] == L['input_ids'].size()[0]`, written over the graph's arguments `A`),
and the side effects it must replay (`side_effects.py`).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import torch
from torch import fx

from .side_effects import ConstantStore
from .side_effects import record as record_side_effects

_ARG = re.compile(r"L\['t(\d+)'\]")


@dataclasses.dataclass(frozen=True)
class GraphInputs:
    """The placeholders of one dynamo graph, in order.

    Attributes:
        sources: each placeholder's source expression.
        static_sizes: per tensor placeholder, each dim's size where it is static (None where it is
            symbolic); None for a placeholder that is not a tensor.
        stores: the constant attribute stores dynamo replays after the graph.
        refusal: why a direct call cannot stand in for dynamo's code (None: it can).
    """

    sources: tuple[str, ...]
    static_sizes: tuple[tuple[int | None, ...] | None, ...]
    stores: tuple[ConstantStore, ...]
    refusal: str | None
    _fakes: tuple[Any, ...] = dataclasses.field(repr=False, default=())
    _shape_env: Any = dataclasses.field(repr=False, default=None)

    @functools.cached_property
    def shape_guards(self) -> tuple[str, ...]:
        """Dynamo's guards on the symbolic sizes, as expressions over the graph's arguments `A`
        (asked of the graph's shape environment when first needed: a direct call's arming)."""
        if self._shape_env is None:
            return ()
        sources = [torch._dynamo.source.LocalSource(f"t{i}") for i in range(len(self._fakes))]
        guards = self._shape_env.produce_guards(list(self._fakes), sources, ignore_static=True)
        return tuple(_ARG.sub(r"A[\1]", guard) for guard in guards)


def record(gm: fx.GraphModule) -> GraphInputs:
    """The inputs of the graph dynamo hands the backend (call while dynamo compiles it)."""
    sources, sizes, fakes, refusal = [], [], [], None
    for node in gm.graph.find_nodes(op="placeholder"):
        arg, value = node.meta.get("grapharg"), node.meta.get("example_value")
        source = getattr(getattr(arg, "source", None), "name", None)
        if arg is None or not isinstance(source, str):
            refusal = refusal or f"placeholder {node.name} has no source dynamo recorded"
            source = ""
        elif arg.pass_arg_as_tensor:
            refusal = refusal or f"dynamo passes {source} as a tensor it makes from a Python number on each call"
        elif "___" in source:
            refusal = refusal or f"the source of {node.name} ({source}) calls one of dynamo's own helpers"
        elif not isinstance(value, (torch.Tensor, torch.SymInt, int)):
            refusal = refusal or f"{source} is a {type(value).__name__}, neither a tensor nor a size"
        sources.append(source)
        fakes.append(value)
        sizes.append(tuple(d if isinstance(d, int) else None for d in value.shape)
                     if isinstance(value, torch.Tensor) else None)
    context = torch._guards.TracingContext.try_get()
    shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
    symbolic = any(isinstance(v, torch.SymInt) for v in fakes) or any(None in s for s in sizes if s is not None)
    if shape_env is None and symbolic:
        refusal = refusal or "the graph's shape environment is not reachable from the backend"
    stores, side_effect_refusal = record_side_effects()
    refusal = refusal or side_effect_refusal
    return GraphInputs(tuple(sources), tuple(sizes), stores, refusal, tuple(fakes), shape_env)
