"""What dynamo passes a compiled graph and where it finds each input, recorded when it is compiled.

Dynamo lifts the parameters and buffers the model reads into graph inputs, beside the caller's
tensors and the sizes it made symbolic; each placeholder's `GraphArg` names its *source*, a Python
expression over the frame's locals `L` and globals `G` (`L['self']._modules['embed']._parameters
['weight']`, `L['positions'].size()[0]`). Dynamo drops these records once the compile is over, so
the backend keeps them here, with what a direct call must check that dynamo's guards did: the
static sizes and strides of each tensor input and the shape guards relating the symbolic ones
(`L['positions'].size()[0] == L['input_ids'].size()[0]`, written over the graph's arguments `A`),
and the side effects it must replay (`side_effects.py`). Tensors dynamo wrapped without passing them
to the graph (an argument read only for its `.dtype` or `.shape`, or a second name for a tensor
already passed) are kept too: dynamo guards their metadata (TENSOR_MATCH) and sizes like the others'.
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
from .side_effects import root_tx

_ARG = re.compile(r"L\['t(\d+)'\]")


@dataclasses.dataclass(frozen=True)
class GraphInputs:
    """The placeholders of one dynamo graph, in order.

    Attributes:
        sources: each placeholder's source expression.
        static_sizes: per tensor placeholder, each dim's size where it is static (None where it is
            symbolic); None for a placeholder that is not a tensor.
        static_strides: the same, of each dim's stride.
        unread: the sources of the tensors dynamo wrapped (`tracked_fakes`) that are no placeholder's,
            with their static sizes and strides; in the shape guards they follow the placeholders
            (`A[len(sources) + j]`).
        stores: the constant attribute stores dynamo replays after the graph.
        refusal: why a direct call cannot stand in for dynamo's code (None: it can).
        hoisted: the placeholders that are hoisted value-type opaque objects (`hoisted_value`); their
            source is `H[<index>]`, the object dynamo passed when the route was armed.
    """

    sources: tuple[str, ...]
    static_sizes: tuple[tuple[int | None, ...] | None, ...]
    static_strides: tuple[tuple[int | None, ...] | None, ...]
    unread: tuple[tuple[str, tuple[int | None, ...], tuple[int | None, ...]], ...]
    stores: tuple[ConstantStore, ...]
    refusal: str | None
    _fakes: tuple[Any, ...] = dataclasses.field(repr=False, default=())
    _shape_env: Any = dataclasses.field(repr=False, default=None)
    hoisted: tuple[int, ...] = ()

    @functools.cached_property
    def shape_guards(self) -> tuple[str, ...]:
        """Dynamo's guards on the symbolic sizes, as expressions over the graph's arguments `A` and
        the unread tensors after them (asked of the graph's shape environment when first needed: a
        direct call's arming)."""
        if self._shape_env is None:
            return ()
        sources = [torch._dynamo.source.LocalSource(f"t{i}") for i in range(len(self._fakes))]
        # a hoisted opaque input has no sizes: an int in its place keeps the positions, and the
        # guard produced on that int is dropped
        fakes = [0 if i in self.hoisted else fake for i, fake in enumerate(self._fakes)]
        guards = self._shape_env.produce_guards(fakes, sources, ignore_static=True)
        return tuple(_ARG.sub(r"A[\1]", guard) for guard in guards
                     if not any(int(i) in self.hoisted for i in _ARG.findall(guard)))


def hoisted_value(arg: Any) -> type | None:
    """The class of a graph input that is a hoisted value-type opaque object (vLLM's `LayerName`,
    `register_opaque_type(..., typ="value", hoist=True)`), which dynamo's code builds before each
    call from values it guards (a layer's name) and passes to the graph; None for any other input.
    A value type compares by value, so a direct call passes the object dynamo passed when the route
    was armed: the value is a traced constant, like any module attribute the graph read."""
    source = getattr(arg, "source", None)
    if type(source).__name__ != "SyntheticLocalSource":
        return None
    try:
        from torch._library import opaque_object
        example = arg.example
    except Exception:  # noqa: BLE001 - no opaque types in this torch, or the example is gone
        return None
    cls = type(example)
    if opaque_object.is_opaque_value_type(cls) and opaque_object.should_hoist(cls):
        return cls
    return None


def _static(values: Any) -> tuple[int | None, ...]:
    return tuple(d if isinstance(d, int) else None for d in values)


def _unread(sources: list[str]) -> tuple[list[tuple[str, tuple, tuple]], list[Any], str | None]:
    """The tensors dynamo wrapped for the frame that are not among `sources`: (source, static sizes,
    static strides) each, their fakes, or why they cannot be named."""
    tx = root_tx()
    tracked = getattr(getattr(tx, "output", None), "tracked_fakes", None)
    if tracked is None:
        return [], [], "dynamo's record of the tensors it wrapped is not readable"
    unread, fakes, seen = [], [], set(sources)
    for tracked_fake in tracked:
        name, fake = getattr(tracked_fake.source, "name", None), tracked_fake.fake
        if not isinstance(fake, torch.Tensor) or name in seen:
            continue
        if not isinstance(name, str) or "___" in name:
            return [], [], f"dynamo wrapped a tensor from {name} (one of its own helpers)"
        seen.add(name)
        unread.append((name, _static(fake.shape), _static(fake.stride())))
        fakes.append(fake)
    return unread, fakes, None


def record(gm: fx.GraphModule) -> GraphInputs:
    """The inputs of the graph dynamo hands the backend (call while dynamo compiles it)."""
    sources, sizes, strides, fakes, refusal, hoisted = [], [], [], [], None, []
    for index, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        arg, value = node.meta.get("grapharg"), node.meta.get("example_value")
        source = getattr(getattr(arg, "source", None), "name", None)
        if arg is not None and isinstance(source, str) and hoisted_value(arg) is not None:
            hoisted.append(index)
            source = f"H[{index}]"  # the object dynamo passed when a route is armed (`route.arm`)
        elif arg is None or not isinstance(source, str):
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
        sizes.append(_static(value.shape) if isinstance(value, torch.Tensor) else None)
        strides.append(_static(value.stride()) if isinstance(value, torch.Tensor) else None)
    unread, unread_fakes, unread_refusal = _unread(sources)
    refusal = refusal or unread_refusal
    fakes += unread_fakes
    context = torch._guards.TracingContext.try_get()
    shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
    symbolic = any(isinstance(v, torch.SymInt) for v in fakes) or any(None in s for s in sizes if s is not None)
    if shape_env is None and symbolic:
        refusal = refusal or "the graph's shape environment is not reachable from the backend"
    stores, side_effect_refusal = record_side_effects()
    refusal = refusal or side_effect_refusal
    return GraphInputs(tuple(sources), tuple(sizes), tuple(strides), tuple(unread), stores, refusal, tuple(fakes),
                       shape_env, tuple(hoisted))
