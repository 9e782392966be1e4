"""A route: one compiled graph called directly, for calls of one layout, with cheap checks in place
of dynamo's guards.

A route is armed from a call that went through dynamo (`arm`): the sources of the graph's inputs
become one generated function of the call's arguments; parameters and buffers (sources that walk
modules' `_modules` / `_parameters` / `_buffers`) are gathered then, once. What the function gathers
is checked against what dynamo passed the graph (the same objects, the same sizes), the step's
return value against the graph's outputs, and dynamo's own code for the frame is read
(`dynamo_code.py`). Each later call runs the function; it returns the graph's arguments, or None
where a check fails, and the call then goes through dynamo (`Fallback`).

The checks, each for guards of dynamo's (`checks.py` builds them): the module-assignment count; torch's
global state as dynamo guards it, the torch function mode stack, the default device; the modules
the sources walk (the same objects, the same training mode) and no call hooks on the module the
step stands for; arguments the graph does not read; the caller's tensors (dynamo's own tensor
check); dynamo's shape guards over the symbolic sizes.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from ..lowering.runner import MovedInputs
from ..lowering.served import Served
from . import checks as checks_mod
from . import dynamo_code
from .side_effects import ConstantStore
from .frame import LOCAL, Frame, LayoutKey, local_expressions

log = logging.getLogger("ascend_compile")

#: A source that walks only modules' submodules, parameters and buffers from a local.
_MODULE_STATE = re.compile(r"L\['(\w+)'\](?:\._(?:modules|parameters|buffers)\['[^'\\]*'\])+")


class Fallback(Exception):
    """A call must go through dynamo: what changed (`kind`) and how (`detail`)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}{': ' + detail if detail else ''}")
        self.kind = kind


class Refused(Exception):
    """No route can be armed from this call; `permanent`: not for this layout until rechecked."""

    def __init__(self, reason: str, permanent: bool = True) -> None:
        super().__init__(reason)
        self.permanent = permanent


class Route:
    """The graph of `artifact` called with the arguments `gather` makes of a call, the constant stores
    dynamo would replay after it (`replay`), and the step's return value rebuilt from its outputs."""

    def __init__(self, artifact: Any, gather: Callable, build: Callable, checks: Sequence[checks_mod.Check],
                 namespace: dict[str, Any], rebuild: Callable[[Sequence[Any]], Any],
                 replay: Callable | None) -> None:
        self.artifact = artifact
        self._replay = replay
        self._gather = gather
        self._build = build
        self._checks = checks
        self._namespace = namespace
        self._rebuild = rebuild

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        try:
            graph_args = self._gather(args, kwargs)
        except Exception as err:  # the call's objects have another structure: dynamo's path tells how
            raise Fallback("the graph's inputs could not be gathered", f"{type(err).__name__}: {err}") from None
        if graph_args is None:
            raise self.explain(args, kwargs)
        try:
            outputs = self.artifact.call_direct(graph_args)
        except MovedInputs as moved:
            raise Fallback("in-place inputs moved since their graph was captured", ", ".join(moved.args[0])) from None
        if self._replay is not None:
            self._replay(args, kwargs)
        return self._rebuild(outputs)

    def explain(self, args: tuple, kwargs: dict) -> Fallback:
        """The first check this call fails."""
        graph_args = self._build(args, kwargs)
        for check in self._checks:
            if not check.holds(self._namespace, args, kwargs, graph_args):
                return Fallback(check.description, check.detail(self._namespace, args, kwargs, graph_args))
        return Fallback("a check failed")


def _served(calls: Sequence[Served]) -> Served:
    graphs = [c for c in calls if getattr(c.artifact, "graph_inputs", None) is not None]
    if len(calls) != 1 or not graphs:
        what = f"{len(calls)} ascend_graph graphs ran" if calls else "no ascend_graph graph ran"
        raise Refused(f"{what} in the call (a graph break, or a graph without attention)")
    return graphs[0]


def _output_recipe(result: Any, outputs: Sequence[Any]) -> Callable[[Sequence[Any]], Any]:
    """How the step's return value is made of the graph's outputs (each returned tensor one of them,
    anything else None)."""
    position = {id(out): i for i, out in reversed(list(enumerate(outputs))) if isinstance(out, torch.Tensor)}
    if isinstance(result, torch.Tensor) and id(result) in position:
        index = position[id(result)]
        return lambda outs: outs[index]
    leaves, spec = pytree.tree_flatten(result)
    picks: list[int | None] = []
    for leaf in leaves:
        if leaf is not None and (not isinstance(leaf, torch.Tensor) or id(leaf) not in position):
            raise Refused(f"the step returns a {type(leaf).__name__} that is not one of its graph's outputs")
        picks.append(None if leaf is None else position[id(leaf)])
    if result is None:
        return lambda outs: None
    return lambda outs: pytree.tree_unflatten([None if i is None else outs[i] for i in picks], spec)


def _same(gathered: Any, passed: Any) -> bool:
    if isinstance(passed, torch.Tensor):
        return gathered is passed
    return type(gathered) is type(passed) and gathered == passed


def arm(frame: Frame, key: LayoutKey, calls: Sequence[Served], args: tuple, kwargs: dict, result: Any) -> Route:
    """The route for calls of layout `key`, from one call that went through dynamo (`calls`: what
    the probe saw run, `result`: what the call returned)."""
    served = _served(calls)
    artifact, inputs = served.artifact, served.artifact.graph_inputs
    if inputs.refusal:
        raise Refused(inputs.refusal)
    exprs = local_expressions(frame, key)
    if isinstance(exprs, str):
        raise Refused(exprs)
    code = dynamo_code.entry_code(frame.func.__code__, frame.func.__globals__, artifact)
    if code is None:
        raise Refused(f"dynamo's code calling this graph is not cached for {frame.func.__qualname__}")
    unsafe = dynamo_code.unsafe_instruction(code, inputs.sources, inputs.stores)
    if unsafe:
        raise Refused(f"dynamo's code for {frame.func.__qualname__} does more than call the graph: {unsafe}")
    for source in [*inputs.sources, *(store.target for store in inputs.stores)]:
        for name in LOCAL.findall(source):
            if name not in exprs:
                raise Refused(f"the source {source} reads {name!r}, not an argument of {frame.func.__qualname__}")
    namespace = {"S": frame.bound, "D": frame.defaults, "G": frame.func.__globals__}
    gathered = [LOCAL.sub(lambda m: exprs[m.group(1)], s) for s in inputs.sources]
    state = [i for i, s in enumerate(inputs.sources) if _MODULE_STATE.fullmatch(s)
             and isinstance(checks_mod.evaluate(exprs[LOCAL.match(s).group(1)], namespace, args, kwargs), torch.nn.Module)]
    namespace["T"] = [checks_mod.evaluate(gathered[i], namespace, args, kwargs) if i in state else None
                      for i in range(len(gathered))]
    per_call = [i for i in range(len(gathered)) if i not in state]
    lines = [f"    A[{i}] = {gathered[i]}" for i in per_call]
    build = checks_mod.compile_function("build", ["    A = T.copy()", *lines, "    return A"], namespace)
    graph_args = build(args, kwargs)
    if len(graph_args) != len(served.args):
        raise Refused(f"dynamo passed {len(served.args)} inputs, the sources name {len(graph_args)}")
    for i, (mine, passed) in enumerate(zip(graph_args, served.args)):
        if not _same(mine, passed):
            raise Refused(f"{inputs.sources[i]} gathers {type(mine).__name__} where dynamo passed {type(passed).__name__}")
    rebuild = _output_recipe(result, served.result)
    roots = sorted({LOCAL.match(inputs.sources[i]).group(1) for i in state})
    checks = checks_mod.build(frame, exprs, roots, inputs, per_call, namespace, args, kwargs, graph_args)
    pre, post = [c for c in checks if c.before_gather], [c for c in checks if not c.before_gather]
    body = [f"    if not ({' and '.join(c.expr for c in pre)}):", "        return None"] if pre else []
    body += ["    A = T.copy()", *lines]
    body += [f"    if not ({' and '.join(c.expr for c in post)}):", "        return None"] if post else []
    gather = checks_mod.compile_function("gather", [*body, "    return A"], namespace)
    replay = _replay(inputs.stores, exprs, namespace)
    log.debug("ascend_compile: dispatch='direct': %s: %d inputs gathered once, %d per call, %d checks",
              frame.func.__qualname__, len(state), len(per_call), len(checks))
    return Route(artifact, gather, build, checks, namespace, rebuild, replay)


def _replay(stores: Sequence[ConstantStore], exprs: dict[str, str], namespace: dict[str, Any]) -> Callable | None:
    """The constant stores dynamo replays after the graph, as one generated function (None: none)."""
    if not stores:
        return None
    namespace["OSID"] = torch._dynamo.utils.object_setattr_ignore_descriptor
    lines = []
    for j, store in enumerate(stores):
        namespace[f"V{j}"] = store.value
        target = LOCAL.sub(lambda m: exprs[m.group(1)], store.target)
        lines.append(f"    OSID({target}, {store.name!r}, V{j})")
    return checks_mod.compile_function("replay", lines, namespace)
