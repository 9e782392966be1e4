"""A route: one compiled graph called directly, for calls of one layout, with cheap checks in place
of dynamo's guards.

A route is armed from a call that went through dynamo (`arm`): the sources of the graph's inputs
become one generated function of the call's arguments, parameters and buffers gathered once
(`gathering.py`), with the checks of `checks.py` in it. What the function gathers
is checked against what dynamo passed the graph (the same objects, the same sizes), the step's
return value against the graph's outputs, and dynamo's own code for the frame is read
(`dynamo_code.py`). Each later call runs the function; it returns the graph's arguments, or None
where a check fails, and the call then goes through dynamo (`Fallback`).

Constant stores dynamo replays after the graph (`side_effects.py`) are allowed where they change
nothing: a route is armed only once a call through dynamo found each stored attribute already at
its constant (read before the call), and each direct call checks that it still is. A step that
changes such an attribute on every call (`self.calls += 1`, which dynamo traces anew each time)
stays on dynamo's path.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from ..lowering.graph_entry import MovedInputs
from ..lowering.served import Served
from . import checks as checks_mod
from . import dynamo_code
from .codegen import MISSING, Check, evaluate
from .frame import LOCAL, Frame, LayoutKey, local_expressions
from .gathering import Gathering
from .side_effects import ConstantStore

log = logging.getLogger("ascend_compile")


class Fallback(Exception):
    """A call must go through dynamo: what changed (`kind`) and how (`detail`)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}{': ' + detail if detail else ''}")
        self.kind = kind
        self.detail = detail


class Refused(Exception):
    """No route can be armed from this call; `permanent`: not for this layout until rechecked;
    `stores`: the constant stores to read before the next call through dynamo."""

    def __init__(self, reason: str, permanent: bool = True, stores: Sequence[ConstantStore] = ()) -> None:
        super().__init__(reason)
        self.permanent = permanent
        self.stores = tuple(stores)


class Route:
    """The graph of `artifact` called with the arguments `gather` makes of a call, and the step's
    return value rebuilt from its outputs."""

    def __init__(self, artifact: Any, gather: Callable, build: Callable, checks: Sequence[Check],
                 namespace: dict[str, Any], rebuild: Callable[[Sequence[Any]], Any],
                 torch_function_disabled: bool = False, fixed: frozenset[int] = frozenset(),
                 fill: Callable | None = None, graph_args: Sequence[Any] = ()) -> None:
        self.artifact = artifact
        #: the positions gathered once, the same objects at every call: the artifact's token for them
        self.fixed = fixed
        #: dynamo runs this graph under `DisableTorchFunctionSubclass` (`dynamo_code.CacheEntry`): so does a direct call
        self.torch_function_disabled = torch_function_disabled
        self.used = False  # whether a call has gone straight to the graph
        self._gather = gather
        self._build = build
        self._checks = checks
        self._namespace = namespace
        self._rebuild = rebuild
        #: The graph's arguments of an earlier call, into which `fill` writes a call's per-call inputs
        #: (the positions gathered once hold the same objects at every call): no list of every input
        #: is built and freed per call. A call takes it only while no other holds it (`_filling`);
        #: another thread's call, or a call made inside a call, gathers a list of its own instead.
        self._fill = fill
        self._args = list(graph_args)
        self._filling = threading.Lock()

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if self._fill is not None and self._filling.acquire(False):
            try:
                return self._run(self._fill, args, kwargs, self._args)
            finally:
                self._filling.release()
        return self._run(self._gather, args, kwargs)

    def _run(self, gather: Callable, args: tuple, kwargs: dict, *into: list) -> Any:
        try:
            graph_args = gather(args, kwargs, *into)
        except Exception as err:  # the call's objects have another structure: dynamo's path tells how
            raise Fallback("the graph's inputs could not be gathered", f"{type(err).__name__}: {err}") from None
        if graph_args is None:
            raise self.explain(args, kwargs)
        try:
            if self.torch_function_disabled:
                with torch._C.DisableTorchFunctionSubclass():
                    outputs = self.artifact.call_direct(graph_args, self.fixed)
            else:
                outputs = self.artifact.call_direct(graph_args, self.fixed)
        except MovedInputs as moved:
            raise Fallback("in-place inputs moved since their graph was captured", ", ".join(moved.args[0])) \
                from None
        self.used = True
        return self._rebuild(outputs)

    def explain(self, args: tuple, kwargs: dict) -> Fallback:
        """The first check this call fails."""
        try:
            graph_args = self._build(args, kwargs)
        except Exception as err:  # a check before gathering failed, and gathering would too
            return Fallback("the graph's inputs could not be gathered", f"{type(err).__name__}: {err}")
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


def read_stores(frame: Frame, key: LayoutKey, stores: Sequence[ConstantStore], args: tuple,
                kwargs: dict) -> dict[tuple[str, str], Any]:
    """The attributes `stores` write, as they are for this call (before it runs)."""
    exprs = local_expressions(frame, key)
    if isinstance(exprs, str):
        return {}
    namespace = {"S": frame.bound, "D": frame.defaults, "G": frame.func.__globals__}
    values = {}
    for store in stores:
        try:
            target = evaluate(LOCAL.sub(lambda m: exprs[m.group(1)], store.target), namespace, args, kwargs)
            values[store.target, store.name] = getattr(target, store.name, MISSING)
        except Exception:  # another structure: the next arming refuses, naming it
            values[store.target, store.name] = MISSING
    return values


def _check_stores(stores: Sequence[ConstantStore], before: dict[tuple[str, str], Any] | None) -> None:
    if not stores:
        return
    if before is None or any((s.target, s.name) not in before for s in stores):
        raise Refused("its constant stores are read before the next call through dynamo", permanent=False,
                      stores=stores)
    for store in stores:
        if before[store.target, store.name] != store.value:
            raise Refused(f"the step changes {store.target}.{store.name} on every call")


#: What a caller may ask of the guards of dynamo's cache entry before a route stands in for them:
#: why they cannot be stood in for, or None (`integrations/vllm/fast_path.py`).
GuardPolicy = Callable[[Any], "str | None"]


def _check_code(frame: Frame, artifact: Any, inputs: Any, exprs: dict[str, str],
                guard_policy: GuardPolicy | None = None, hoisted: Sequence[type] = ()) -> bool:
    """Refuse a route where dynamo's code does more than call the graph (or the policy refuses its
    guards); whether the graph runs with tensor-subclass dispatch disabled."""
    entry = dynamo_code.cache_entry(frame.func.__code__, frame.func.__globals__, artifact)
    if entry is None:
        raise Refused(f"dynamo's code calling this graph is not cached for {frame.func.__qualname__}")
    if guard_policy is not None:
        refusal = guard_policy(entry.guard_manager)
        if refusal:
            raise Refused(refusal)
    modules = list(frame.bound.modules()) if hoisted and isinstance(frame.bound, torch.nn.Module) else []
    unsafe = dynamo_code.unsafe_instruction(entry.code, inputs.sources, inputs.stores,
                                            dynamo_code.hoisted_builds(hoisted, modules))
    if unsafe:
        raise Refused(f"dynamo's code for {frame.func.__qualname__} does more than call the graph: {unsafe}")
    for source in [*inputs.sources, *(store.target for store in inputs.stores)]:
        for name in LOCAL.findall(source):
            if name not in exprs:
                raise Refused(f"the source {source} reads {name!r}, not an argument of {frame.func.__qualname__}")
    return entry.torch_function_disabled


def arm(frame: Frame, key: LayoutKey, calls: Sequence[Served], args: tuple, kwargs: dict, result: Any,
        stores_before: dict[tuple[str, str], Any] | None = None, guard_policy: GuardPolicy | None = None) -> Route:
    """The route for calls of layout `key`, from one call that went through dynamo (`calls`: what
    the probe saw run, `result`: what the call returned, `stores_before`: what `read_stores` read
    before it, for the stores of an earlier refusal; `guard_policy`: asked of the entry's guards)."""
    served = _served(calls)
    artifact, inputs = served.artifact, served.artifact.graph_inputs
    if inputs.refusal:
        raise Refused(inputs.refusal)
    exprs = local_expressions(frame, key)
    if isinstance(exprs, str):
        raise Refused(exprs)
    hoisted = {i: served.args[i] for i in inputs.hoisted}  # as dynamo passed them (`graph_inputs.hoisted_value`)
    torch_function_disabled = _check_code(frame, artifact, inputs, exprs, guard_policy,
                                          [type(value) for value in hoisted.values()])
    _check_stores(inputs.stores, stores_before)
    namespace = {"S": frame.bound, "D": frame.defaults, "G": frame.func.__globals__, "H": hoisted}
    gathering = Gathering.of(inputs.sources, exprs, namespace, args, kwargs)
    build = gathering.build(namespace)
    graph_args = build(args, kwargs)
    if len(graph_args) != len(served.args):
        raise Refused(f"dynamo passed {len(served.args)} inputs, the sources name {len(graph_args)}")
    for source, mine, passed in zip(inputs.sources, graph_args, served.args):
        if not _same(mine, passed):
            raise Refused(f"{source} gathers a {type(mine).__name__} where dynamo passed a {type(passed).__name__}")
    rebuild = _output_recipe(result, served.result)
    try:
        checks = checks_mod.build(frame, exprs, gathering, inputs, namespace, args, kwargs, graph_args)
    except checks_mod.Unarmable as why:
        raise Refused(str(why)) from None
    log.debug("ascend_compile: dispatch='direct': %s: %d inputs gathered once, %d per call, %d checks",
              frame.func.__qualname__, len(gathering.state), len(gathering.per_call), len(checks))
    return Route(artifact, gathering.gather(checks, namespace), build, checks, namespace, rebuild,
                 torch_function_disabled, frozenset(gathering.state), gathering.fill(checks, namespace), graph_args)
