"""The checks a route runs on every call, in place of dynamo's guards.

Each check is a Python expression over the call's positional arguments `a`, keyword arguments `k`
and the graph's arguments `A` gathered from them, with the objects it compares against in the
route's namespace; a route joins them into one generated function (`gathering.py`), so a call pays
for the checks and not for calling them. What each stands for among dynamo's guards (the README's
"Calling the graph directly" goes through every guard kind):

- the module-assignment count (`epoch.py`): the ID matches along the module tree, and the identity
  of the parameters and buffers gathered once;
- the type of every module under the roots, one `map(type, ...)` compared with the types at arming:
  the TYPE matches along the module tree (`module.__class__ = Other` runs no hook);
- dynamo's own `GlobalStateGuard` (C++): GLOBAL_STATE (grad mode, autocast, deterministic
  algorithms, default dtype, torch function enabled, ...); the torch function mode stack, each mode
  the same object as at arming (TORCH_FUNCTION_STATE); the default device (DEFAULT_DEVICE); the
  functorch interpreter stack empty and no forward-AD level (FUNCTORCH_STACK_MATCH, DUAL_LEVEL);
  `torch.compiler.set_stance` as at arming (dynamo's frame callback reads it on every call);
- hooks: the count of hook registrations (every module hook, global or not, is registered through
  torch's `RemovableHandle`, which numbers them), and the length of each hook dict that was not
  empty at arming (a removed hook), where dynamo traced them in (EMPTY_NN_MODULE_HOOKS_DICT with
  `skip_nnmodule_hook_guards` off, `compile_once.py`); routes are not armed where the module the
  step stands for has call hooks (they run around the frame) or global hooks exist (`arming_refusal`);
- the modules the sources walk, the same objects in the same `training` mode;
- arguments the graph does not read: constants by value, other objects by identity (EQUALS, ID and
  TYPE matches), tensors as dynamo wrapped them (below) or by type;
- the caller's tensors the same objects where the traced call passed one object twice and distinct
  objects, none a parameter or buffer, where it passed distinct ones (DUPLICATE_INPUT,
  NO_TENSOR_ALIASING); the arguments read through (an object, a list) of the same type and length;
- dynamo's own `TensorGuards` (C++) over the tensors gathered per call and the tensors dynamo
  wrapped without passing them (an argument read for its `.dtype`): TENSOR_MATCH (type, dtype,
  device, requires_grad, dispatch keys, every static size and stride);
- dynamo's shape guards over the symbolic sizes (sizes that must agree, their ranges), those of the
  unread tensors included (SHAPE_ENV);
- each attribute dynamo stores a constant into after the graph still holds it: the replay a direct
  call skips is a no-op.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch
import torch.autograd.forward_ad as forward_ad
from torch._C._dynamo.guards import GlobalStateGuard, TensorGuards
from torch._dynamo import eval_frame
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from . import epoch
from .codegen import MISSING, Check, evaluate
from .frame import LOCAL, Frame
from .gathering import Gathering
from .graph_inputs import GraphInputs

#: What a module's `__call__` runs around `forward` when any is registered.
CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
#: Arguments compared by value.
CONSTANT_TYPES = (type(None), bool, int, float, str)
_ARG = re.compile(r"A\[(\d+)\]")
_SIZE_AT_LEAST_0 = re.compile(r"0 <= [^<>=]*\.size\(\)\[\d+\]")


class Unarmable(Exception):
    """Nothing a route could check would stand in for what dynamo does for this call."""


def arming_refusal() -> str | None:
    """Why no route may be armed from a call made now, whatever the step (None: one may): state of
    torch a direct call cannot serve, where dynamo's path compiles or runs something else."""
    if torch.is_grad_enabled():
        return "grad mode is on (direct calls serve inference: no autograd)"
    stance = eval_frame._stance
    if stance.stance not in ("default", "eager_on_recompile", "fail_on_recompile") or stance.backend is not None:
        return f"torch.compiler stance {stance.stance!r}{' (a forced backend)' if stance.backend is not None else ''}"
    if nn_module._has_any_global_hook():
        return "global module hooks are registered"
    if torch._C._functorch.peek_interpreter_stack() is not None or forward_ad._current_level != -1:
        return "a functorch transform or forward-AD level is active"
    return None


def _ambient(namespace: dict[str, Any]) -> list[Check]:
    namespace.update(EP=epoch.COUNT, GS=GlobalStateGuard(), TFN=torch._C._len_torch_function_stack,
                     TFA=torch._C._get_function_stack_at, UD=torch.utils._device, CD=torch.utils._device.CURRENT_DEVICE,
                     EF=eval_frame, RH=RemovableHandle, PIS=torch._C._functorch.peek_interpreter_stack, FAD=forward_ad)
    depth = torch._C._len_torch_function_stack()
    modes = " ".join(f"and TFA({i}) is TM{i}" for i in range(depth))
    namespace.update({f"TM{i}": torch._C._get_function_stack_at(i) for i in range(depth)})
    stance = eval_frame._stance.stance
    return [
        Check("parameters, buffers or submodules of a module were assigned", f"EP.value == {epoch.current()}", True),
        Check("torch's global state differs from the traced call's", "GS.check()", True, "GS.reason()"),
        Check("torch function modes differ from the traced call's", f"TFN() == {depth} {modes}", True),
        Check("the default device differs from the traced call's", "UD.CURRENT_DEVICE == CD", True),
        Check(f"the torch.compiler stance is no longer {stance!r}",
              f"EF._stance.stance == {stance!r} and EF._stance.backend is None", True),
        Check("a functorch transform or forward-AD level is active", "PIS() is None and FAD._current_level == -1", True),
        Check("a hook was registered on a module (or a tensor)", f"RH.next_id == {RemovableHandle.next_id}", True),
    ]


def _tree(modules: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every module under `modules`, once each."""
    seen: dict[int, torch.nn.Module] = {}
    for root in modules:
        for module in root.modules():
            seen.setdefault(id(module), module)
    return list(seen.values())


def _hooks(frame: Frame, tree: Sequence[torch.nn.Module], namespace: dict[str, Any]) -> list[Check]:
    """The hook dicts that are not empty stay as long (hooks added move `RemovableHandle.next_id`)."""
    if frame.module is not None and any(getattr(frame.module, h) for h in CALL_HOOKS):
        raise Unarmable(f"{type(frame.module).__name__} has call hooks, which run around its forward")
    dicts = [d for module in tree for d in (getattr(module, h, None) for h in CALL_HOOKS) if d]
    namespace["HD"] = tuple(dicts)
    if not dicts:
        return []
    lengths = tuple(map(len, dicts))
    return [Check("a hook traced into the graph was removed", f"tuple(map(len, HD)) == {lengths}", True)]


def _modules(frame: Frame, exprs: dict[str, str], roots: Sequence[str], namespace: dict[str, Any], a: tuple,
             k: dict) -> list[Check]:
    checks, modules = [], []
    for j, name in enumerate(roots):
        module = namespace[f"R{j}"] = evaluate(exprs[name], namespace, a, k)
        modules.append(module)
        if exprs[name] != "S":
            checks.append(Check(f"argument {name!r} is another module than in the traced call",
                                f"{exprs[name]} is R{j}"))
        checks.append(Check(f"module {name!r} was switched to {'eval' if module.training else 'training'} mode",
                            f"R{j}.training is {module.training}", True))
    if frame.module is not None and frame.module not in modules:
        modules.append(frame.module)
    tree = _tree(modules)
    namespace["MT"], namespace["MC"] = tuple(tree), list(map(type, tree))
    # types compare by identity first: the lists are equal exactly when every module kept its class (a list:
    # `list(map(...))` grows its storage geometrically, `tuple(map(...))` by small steps, 1.7 us more at 517 modules)
    checks.append(Check("a module's class was changed (module.__class__ = ...)", "list(map(type, MT)) == MC", True))
    return checks + _hooks(frame, tree, namespace)


def _unread(exprs: dict[str, str], read: set[str], tracked: set[str], namespace: dict[str, Any], a: tuple,
            k: dict) -> list[Check]:
    checks = []
    for j, (name, expr) in enumerate(exprs.items()):
        if name in read or expr == "S":
            continue
        value = evaluate(expr, namespace, a, k)
        namespace[f"Y{j}"] = type(value)
        if not isinstance(value, torch.Tensor):
            namespace[f"C{j}"] = value
        if isinstance(value, CONSTANT_TYPES):
            checks.append(Check(f"argument {name!r} differs from the traced call's",
                                f"type({expr}) is Y{j} and {expr} == C{j}"))
        elif isinstance(value, torch.Tensor):
            if f"L[{name!r}]" not in tracked:  # else TENSOR_MATCH (`_tensors`)
                checks.append(Check(f"argument {name!r} is another type of tensor", f"type({expr}) is Y{j}"))
        else:
            checks.append(Check(f"argument {name!r} is another object than in the traced call", f"{expr} is C{j}"))
    return checks


def _per_call_tensors(inputs: GraphInputs, exprs: dict[str, str], gathering: Gathering, graph_args: Sequence[Any],
                      namespace: dict[str, Any], a: tuple, k: dict) -> list[tuple[str, Any]]:
    """(expression, value) of every tensor a call brings, once per expression: those gathered per call
    (as `A[i]`), those dynamo wrapped without passing them, and the tensor arguments."""
    found = {gathering.expressions[i]: (f"A[{i}]", graph_args[i]) for i in gathering.per_call}
    for expr in [*(LOCAL.sub(lambda m: exprs[m.group(1)], s) for s, _, _ in inputs.unread), *exprs.values()]:
        if expr != "S" and expr not in found:
            found[expr] = (expr, evaluate(expr, namespace, a, k))
    return [(name, value) for name, value in found.values() if isinstance(value, torch.Tensor)]


def _aliasing(tensors: Sequence[tuple[str, Any]], state: Sequence[Any], namespace: dict[str, Any]) -> list[Check]:
    """The same objects where the traced call passed one tensor under several names, distinct ones
    elsewhere, none of them a parameter or buffer gathered once (`state`)."""
    groups: dict[int, list[str]] = {}
    for expr, value in tensors:
        if expr not in groups.setdefault(id(value), []):
            groups[id(value)].append(expr)
    same = [f"{expr} is {group[0]}" for group in groups.values() for expr in group[1:]]
    firsts = ", ".join(group[0] for group in groups.values())
    namespace["ST"] = frozenset(id(t) for t in state if isinstance(t, torch.Tensor))
    if namespace["ST"].intersection(groups):
        raise Unarmable("the call passes a parameter or buffer of the model as an argument")
    checks = [Check("tensor arguments that were one object are not", " and ".join(same))] if same else []
    if groups:
        checks.append(Check("tensor arguments that were distinct objects are one, or a parameter or buffer",
                            f"ST.isdisjoint(IDS := set(map(id, ({firsts},)))) and len(IDS) == {len(groups)}"))
    return checks


def _read_objects(exprs: dict[str, str], read: set[str], namespace: dict[str, Any], a: tuple, k: dict) -> list[Check]:
    """The arguments the sources read through that are neither tensors nor modules (an object whose
    tensor attribute the graph takes, a list of tensors): the same type, and for a list, tuple or
    dict the same length and keys (dynamo's TYPE_MATCH, SEQUENCE_LENGTH and DICT_KEYS_MATCH on them)."""
    checks = []
    for j, name in enumerate(sorted(read)):
        expr = exprs[name]
        value = evaluate(expr, namespace, a, k)
        if expr == "S" or isinstance(value, (torch.Tensor, torch.nn.Module)):
            continue
        namespace[f"RT{j}"] = type(value)
        expr_check = f"type({expr}) is RT{j}"
        if isinstance(value, (list, tuple)):
            expr_check += f" and len({expr}) == {len(value)}"
        elif isinstance(value, dict):
            namespace[f"RK{j}"] = list(value)
            expr_check += f" and list({expr}) == RK{j}"
        checks.append(Check(f"argument {name!r} is of another type or length than in the traced call", expr_check))
    return checks


def _plain(values: Sequence[Any], sources: Sequence[str], state: Sequence[int] = ()) -> None:
    """Tensor subclasses carry metadata dynamo guards besides TENSOR_MATCH (DTensor's spec, a
    subclass's flattened attributes): not checked here, so not armed. Excepted: a parameter of a
    `Parameter` subclass that wraps no other tensor (vLLM's `ModelWeightParameter`: a Parameter with
    loader methods and a `__torch_function__`), gathered once (`state`): the same object while the
    module-assignment count stands, so of the same class; dynamo runs such a graph with subclass
    dispatch off, and so does a direct call (`dynamo_code.CacheEntry`)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for i, (value, source) in enumerate(zip(values, sources)):
        if not isinstance(value, torch.Tensor) or type(value) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
            continue
        if i in state and isinstance(value, torch.nn.Parameter) and not is_traceable_wrapper_subclass(value):
            continue
        raise Unarmable(f"{source} is a {type(value).__name__}, a tensor subclass")


def _tensors(inputs: GraphInputs, exprs: dict[str, str], per_call: Sequence[int], namespace: dict[str, Any],
             graph_args: Sequence[Any], a: tuple, k: dict) -> list[Check]:
    tensors = [i for i in per_call if isinstance(graph_args[i], torch.Tensor)]
    listed = [f"A[{i}]" for i in tensors]
    values = [graph_args[i] for i in tensors]
    sizes = [list(inputs.static_sizes[i]) for i in tensors]
    strides = [list(inputs.static_strides[i]) for i in tensors]
    names = [inputs.sources[i] for i in tensors]
    for source, static_sizes, static_strides in inputs.unread:
        listed.append(LOCAL.sub(lambda m: exprs[m.group(1)], source))
        values.append(evaluate(listed[-1], namespace, a, k))
        sizes.append(list(static_sizes))
        strides.append(list(static_strides))
        names.append(source)
    if not values:
        return []
    namespace["TG"] = TensorGuards(*values, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
    namespace["TGN"] = names
    joined = ", ".join(listed)
    return [Check("a tensor argument's type, dtype, device, requires_grad, static size or stride differs",
                  f"TG.check({joined})", False, f"TG.check_verbose({joined}, tensor_check_names=TGN)")]


def _stores(inputs: GraphInputs, exprs: dict[str, str], namespace: dict[str, Any]) -> list[Check]:
    namespace["MISSING"] = MISSING
    checks = []
    for j, store in enumerate(inputs.stores):
        namespace[f"V{j}"] = store.value
        target = LOCAL.sub(lambda m: exprs[m.group(1)], store.target)
        checks.append(Check(f"{store.target}.{store.name} is no longer {store.value!r}, which the step stores",
                            f"getattr({target}, {store.name!r}, MISSING) == V{j}", True))
    return checks


def _shape_guards(inputs: GraphInputs, exprs: dict[str, str], gathering: Gathering) -> list[Check]:
    """Dynamo's shape guards, over what the gathering reads per call and the unread tensors; those
    true by construction (a size input gathered as the very size it is compared with, a size at
    least 0) are left out."""
    count = len(inputs.sources)
    unread = [LOCAL.sub(lambda m: exprs[m.group(1)], source) for source, _, _ in inputs.unread]
    names = [*inputs.sources, *(source for source, _, _ in inputs.unread)]

    def over_call(match: re.Match) -> str:  # sources are primaries (subscripts, attributes, calls): no parentheses
        i = int(match.group(1))
        if i >= count:
            return unread[i - count]
        return gathering.expressions[i] if i in gathering.per_call else match.group(0)

    checks, seen = [], set()
    for guard in inputs.shape_guards:
        expr = _ARG.sub(over_call, guard)
        sides = [side.strip() for side in expr.split(" == ")]
        if expr in seen or len(sides) == 2 and sides[0] == sides[1] or _SIZE_AT_LEAST_0.fullmatch(expr):
            continue
        seen.add(expr)
        readable = _ARG.sub(lambda m: names[int(m.group(1))], guard)
        checks.append(Check(f"dynamo's shape guard {readable} fails", expr))
    return checks


def build(frame: Frame, exprs: dict[str, str], gathering: Gathering, inputs: GraphInputs, namespace: dict[str, Any],
          a: tuple, k: dict, graph_args: Sequence[Any]) -> list[Check]:
    """The checks of a route for the call (`a`, `k`) it is armed from, whose graph arguments are
    `graph_args` gathered by `gathering`; what they compare against goes into `namespace`. Raises
    `Unarmable` where no check can stand in for dynamo's."""
    for name, value in SYMPY_INTERP.items():
        namespace.setdefault(name, value)
    read = {name for source in inputs.sources for name in LOCAL.findall(source)}
    tracked = {source for source, _, _ in inputs.unread}
    checks = _ambient(namespace) + _modules(frame, exprs, gathering.roots, namespace, a, k)
    _plain(graph_args, inputs.sources, gathering.state)
    checks += _unread(exprs, read, tracked, namespace, a, k) + _read_objects(exprs, read, namespace, a, k)
    tensors = _per_call_tensors(inputs, exprs, gathering, graph_args, namespace, a, k)
    _plain([value for _, value in tensors], [expr for expr, _ in tensors])
    checks += _aliasing(tensors, [graph_args[i] for i in gathering.state], namespace)
    checks += _tensors(inputs, exprs, gathering.per_call, namespace, graph_args, a, k)
    return checks + _stores(inputs, exprs, namespace) + _shape_guards(inputs, exprs, gathering)
