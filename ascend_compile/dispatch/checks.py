"""The checks a route runs on every call, in place of dynamo's guards.

Each check is a Python expression over the call's positional arguments `a`, keyword arguments `k`
and the graph's arguments `A` gathered from them, with the objects it compares against in the
route's namespace; a route joins them into one generated function (`gathering.py`), so a call pays
for the checks and not for calling them. What each stands for among dynamo's guards:

- the module-assignment count (`epoch.py`): the ID and TYPE matches along the module tree, and the
  identity of the parameters and buffers gathered once;
- dynamo's own `GlobalStateGuard` (C++): GLOBAL_STATE (grad mode, autocast, deterministic
  algorithms, default dtype, ...); the torch function mode stack and the default device:
  TORCH_FUNCTION_MODE_STACK and DEFAULT_DEVICE;
- the modules the sources walk, the same objects in the same `training` mode; no call hooks on the
  module the step stands for, nor global ones: what its `__call__` would run around the frame;
- arguments the graph does not read, constants by value, other objects by identity, tensors by
  type: the EQUALS, ID and TYPE matches on them;
- dynamo's own `TensorGuards` (C++) over the tensors gathered per call: TENSOR_MATCH (type, dtype,
  device, requires_grad, dispatch keys, every static size);
- dynamo's shape guards over the symbolic sizes (sizes that must agree, their ranges);
- each attribute dynamo stores a constant into after the graph still holds it: the replay a direct
  call skips is a no-op.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch
from torch._C._dynamo.guards import GlobalStateGuard, TensorGuards
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
from torch.nn.modules import module as nn_module

from . import epoch
from .codegen import MISSING, Check, evaluate
from .frame import LOCAL, Frame
from .gathering import Gathering
from .graph_inputs import GraphInputs

#: What a module's `__call__` runs around `forward` when any is registered.
CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_CALL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                     "_global_backward_pre_hooks")
#: Arguments compared by value.
CONSTANT_TYPES = (type(None), bool, int, float, str)
_ARG = re.compile(r"A\[(\d+)\]")
_SIZE_AT_LEAST_0 = re.compile(r"0 <= [^<>=]*\.size\(\)\[\d+\]")




def _ambient(namespace: dict[str, Any]) -> list[Check]:
    namespace.update(EP=epoch.COUNT, GS=GlobalStateGuard(), TF=torch._C._len_torch_function_stack,
                     UD=torch.utils._device, CD=torch.utils._device.CURRENT_DEVICE)
    return [
        Check("parameters, buffers or submodules of a module were assigned", f"EP.value == {epoch.current()}", True),
        Check("torch's global state differs from the traced call's", "GS.check()", True, "GS.reason()"),
        Check("torch function modes differ from the traced call's", f"TF() == {namespace['TF']()}", True),
        Check("the default device differs from the traced call's", "UD.CURRENT_DEVICE == CD", True),
    ]


def _modules(frame: Frame, exprs: dict[str, str], roots: Sequence[str], namespace: dict[str, Any], a: tuple,
             k: dict) -> list[Check]:
    checks = []
    for j, name in enumerate(roots):
        module = namespace[f"R{j}"] = evaluate(exprs[name], namespace, a, k)
        if exprs[name] != "S":
            checks.append(Check(f"argument {name!r} is another module than in the traced call",
                                f"{exprs[name]} is R{j}"))
        checks.append(Check(f"module {name!r} was switched to {'eval' if module.training else 'training'} mode",
                            f"R{j}.training is {module.training}", True))
    if frame.module is not None:
        namespace["NM"] = nn_module
        hooks = [f"S.{h}" for h in CALL_HOOKS] + [f"NM.{h}" for h in GLOBAL_CALL_HOOKS]
        checks.append(Check("the module has call hooks", f"not ({' or '.join(hooks)})", True))
    return checks


def _unread(exprs: dict[str, str], read: set[str], namespace: dict[str, Any], a: tuple, k: dict) -> list[Check]:
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
            checks.append(Check(f"argument {name!r} is another type of tensor", f"type({expr}) is Y{j}"))
        else:
            checks.append(Check(f"argument {name!r} is another object than in the traced call", f"{expr} is C{j}"))
    return checks


def _tensors(inputs: GraphInputs, per_call: Sequence[int], namespace: dict[str, Any],
             graph_args: Sequence[Any]) -> list[Check]:
    tensors = [i for i in per_call if isinstance(graph_args[i], torch.Tensor)]
    if not tensors:
        return []
    namespace["TG"] = TensorGuards(*(graph_args[i] for i in tensors),
                                   dynamic_dims_sizes=[list(inputs.static_sizes[i]) for i in tensors],
                                   dynamic_dims_strides=[[None] * graph_args[i].dim() for i in tensors])
    namespace["TGN"] = [inputs.sources[i] for i in tensors]
    listed = ", ".join(f"A[{i}]" for i in tensors)
    return [Check("a tensor argument's type, dtype, device, requires_grad or static size differs",
                  f"TG.check({listed})", False, f"TG.check_verbose({listed}, tensor_check_names=TGN)")]


def _stores(inputs: GraphInputs, exprs: dict[str, str], namespace: dict[str, Any]) -> list[Check]:
    namespace["MISSING"] = MISSING
    checks = []
    for j, store in enumerate(inputs.stores):
        namespace[f"V{j}"] = store.value
        target = LOCAL.sub(lambda m: exprs[m.group(1)], store.target)
        checks.append(Check(f"{store.target}.{store.name} is no longer {store.value!r}, which the step stores",
                            f"getattr({target}, {store.name!r}, MISSING) == V{j}", True))
    return checks


def _shape_guards(inputs: GraphInputs, gathering: Gathering) -> list[Check]:
    """Dynamo's shape guards, over what the gathering reads per call; those true by construction (a
    size input gathered as the very size it is compared with, a size at least 0) are left out."""
    def over_call(match: re.Match) -> str:  # sources are primaries (subscripts, attributes, calls): no parentheses
        i = int(match.group(1))
        return gathering.expressions[i] if i in gathering.per_call else match.group(0)

    checks, seen = [], set()
    for guard in inputs.shape_guards:
        expr = _ARG.sub(over_call, guard)
        sides = [side.strip() for side in expr.split(" == ")]
        if expr in seen or len(sides) == 2 and sides[0] == sides[1] or _SIZE_AT_LEAST_0.fullmatch(expr):
            continue
        seen.add(expr)
        readable = _ARG.sub(lambda m: inputs.sources[int(m.group(1))], guard)
        checks.append(Check(f"dynamo's shape guard {readable} fails", expr))
    return checks


def build(frame: Frame, exprs: dict[str, str], gathering: Gathering, inputs: GraphInputs, namespace: dict[str, Any],
          a: tuple, k: dict, graph_args: Sequence[Any]) -> list[Check]:
    """The checks of a route for the call (`a`, `k`) it is armed from, whose graph arguments are
    `graph_args` gathered by `gathering`; what they compare against goes into `namespace`."""
    for name, value in SYMPY_INTERP.items():
        namespace.setdefault(name, value)
    read = {name for source in inputs.sources for name in LOCAL.findall(source)}
    checks = _ambient(namespace) + _modules(frame, exprs, gathering.roots, namespace, a, k)
    checks += _unread(exprs, read, namespace, a, k) + _tensors(inputs, gathering.per_call, namespace, graph_args)
    return checks + _stores(inputs, exprs, namespace) + _shape_guards(inputs, gathering)
