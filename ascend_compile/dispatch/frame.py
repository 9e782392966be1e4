"""The frame dynamo compiled for a step, and how one call's arguments become its locals.

Dynamo's sources name the traced frame's locals (`L['self']`, `L['input_ids']`). A direct call has
no frame: each local is an expression over the call's positional arguments `a`, keyword arguments
`k`, the bound `S` (a module's `self`) and the parameter defaults `D`, fixed per *layout* (how many
positional arguments, which keywords), so a route is compiled once per layout.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import types
from typing import Any

import torch

LayoutKey = tuple[int, tuple[str, ...]]
#: A frame local in a source expression (`L['input_ids']`).
LOCAL = re.compile(r"L\['(\w+)'\]")


@dataclasses.dataclass(frozen=True)
class Frame:
    """The function dynamo traces for a compiled step.

    Attributes:
        func: the function whose code dynamo compiled (a module's `forward`, unbound).
        bound: the object bound to its first parameter (the module, a method's `self`), or None.
        module: the module whose `__call__` the step stands for (its hooks would run around the
            frame), or None.
        names: the parameters after the bound one, in order.
        defaults: the defaults of those that have one.
        refusal: why calls of this step cannot be routed directly (None: they can).
    """

    func: Any
    bound: Any
    module: torch.nn.Module | None
    names: tuple[str, ...]
    defaults: dict[str, Any]
    refusal: str | None = None

    @property
    def self_name(self) -> str | None:
        """The name of the bound parameter (`self`), or None."""
        if self.bound is None:
            return None
        return next(iter(inspect.signature(self.func).parameters))


def frame_of(step: Any) -> Frame:
    """The frame of `step`: a module (its `forward`), a bound method or a plain function."""
    module = step if isinstance(step, torch.nn.Module) else None
    target = step.forward if module is not None else step
    bound = target.__self__ if isinstance(target, types.MethodType) else None
    func = target.__func__ if isinstance(target, types.MethodType) else target
    if not isinstance(func, types.FunctionType):
        return Frame(func, bound, module, (), {}, f"{type(func).__name__} is not a Python function dynamo traces")
    parameters = list(inspect.signature(func).parameters.values())[1 if bound is not None else 0:]
    varying = [p.name for p in parameters if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    refusal = f"{func.__qualname__} takes *{varying[0]}: its locals depend on the call" if varying else None
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
    return Frame(func, bound, module, tuple(p.name for p in parameters), defaults, refusal)


def layout_key(args: tuple, kwargs: dict) -> LayoutKey:
    """What fixes how a call binds: its positional count and keyword names."""
    return len(args), tuple(kwargs)


def local_expressions(frame: Frame, key: LayoutKey) -> dict[str, str] | str:
    """Each local of the frame as an expression over `a`, `k`, `S` and `D` for calls of layout
    `key`; or, where such calls do not bind, why."""
    count, keywords = key
    if count > len(frame.names):
        return f"{count} positional arguments; {frame.func.__qualname__} takes {len(frame.names)}"
    exprs = {name: f"a[{i}]" for i, name in enumerate(frame.names[:count])}
    for name in keywords:
        if name not in frame.names or name in exprs:
            return f"keyword {name!r} does not bind to one parameter of {frame.func.__qualname__}"
        exprs[name] = f"k[{name!r}]"
    for name in frame.names:
        if name not in exprs:
            if name not in frame.defaults:
                return f"{frame.func.__qualname__} needs {name!r}"
            exprs[name] = f"D[{name!r}]"
    if frame.self_name is not None:
        exprs[frame.self_name] = "S"
    return exprs
