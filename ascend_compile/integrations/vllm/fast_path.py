"""Inside vLLM, calls of the compiled model go straight to its graph: no frame hook, no guards.

vLLM's mode-1 compile (`GPUModelRunner.load_model`, vLLM-Ascend through our plug-in) is
`model.compile(fullgraph=True, backend=...)`: every step then goes through dynamo's frame hook and
evaluates every guard of the model's frame (its guard tree prints 876 lines on vLLM 0.23's
two-layer Llama; about 960 us of a step's host time at 64 layers, `benchmarks/host_dispatch.py
--vllm`). At the first compiled step the backend finds that module (`compiled_module`)
and puts the direct dispatcher (`ascend_compile.dispatch`) in front of its compiled call
(`install`): each step is then the dispatcher's checks and the artifact. Off with
`{"dispatch": "dynamo"}` in `ASCEND_COMPILE_OPTIONS`.

Why that is sound, guard by guard. Every guard dynamo keeps for the frame is read from its cache
entry before a route is armed (`guard_refusal`), and each must be one of these:

| dynamo's guards on vLLM's frame | what stands in for them |
|---|---|
| GLOBAL_STATE, TORCH_FUNCTION_MODE_STACK, DEFAULT_DEVICE (the root) | the dispatcher's own checks (`dispatch/checks.py`) |
| LAMBDA_GUARD on the root: the shape guards over the step sizes; identities between globals and modules (`G[...].F is G[...].torch.nn.functional`, `norm is norm._forward_method.__self__`) | the shape guards: dynamo's, as its shape environment produced them when it compiled, compiled into the route's check; the identities: fixed once vLLM has built the model (below) |
| TENSOR_MATCH, NO_TENSOR_ALIASING, DIMENSION_DYNAMIC_MARKING_GUARD, NONE_MATCH on `input_ids`, `positions`, `inputs_embeds`, `intermediate_tensors` | `TensorGuards` over the caller's tensors, aliasing and argument checks (`dispatch/checks.py`); a guard *inside* an argument (an `IntermediateTensors`' dict) refuses the route |
| TENSOR_MATCH and the module tree (TYPE_MATCH, ID_MATCH, LENGTH_CHECK on `L['self']._modules` ...) | parameters and buffers gathered once, the module-assignment count and module types; the runner's address checks of every in-place input (KV caches always; parameters as `frozen_parameters` says) |
| value guards on module attributes (EQUALS_MATCH, TRUE/FALSE/NONE_MATCH, DICT_CONTAINS, OBJECT_ALIASING under `L['self']`) | none needed: vLLM sets them while building and loading the model, before the first compile, and changes none between steps (its own compile modes drop every guard for this reason: `TorchCompileWithNoGuardsWrapper`, vllm/compilation/wrapper.py) |
| guards on globals (`G[...]`: vLLM's module flags such as `_USE_LAYERNAME`, its parallel groups `_PP` / `_TP`, functions' code, builtins) | none needed, for the same reason: set at import or at start-up (`init_distributed_environment`) |
| any guard whose source names the forward context | **refused**: that is the state vLLM changes every step (`set_forward_context`); our binder reads it per step, a guard on it would be a traced value |
| any other guard kind, or a source rooted elsewhere | **refused**: the route is not armed, the step stays on dynamo's path (logged once, naming the guard) |

What the runner checks on both paths (bucket, shapes by role, KV-cache addresses, host lengths) and
what `DeferredCompile` checks per step (`unserved_step`, `max_model_len`) run on every direct step
too: the dispatcher calls the `DeferredCompile` dynamo calls, not the artifact behind it.
"""
from __future__ import annotations

import logging
import re
import sys
from typing import Any

import torch

from ...dispatch import DirectDispatcher
from ...dispatch import dynamo_code
from ...torch_support import fast_path_refusal

log = logging.getLogger("ascend_compile")

#: Guards on the frame's root that the dispatcher's own checks stand in for.
ROOT_KINDS = frozenset({"GLOBAL_STATE", "TORCH_FUNCTION_MODE_STACK", "DEFAULT_DEVICE", "LAMBDA_GUARD",
                        "NO_TENSOR_ALIASING"})
#: Guards on one of the step's arguments itself (not inside it) that the argument checks stand in for.
ARGUMENT_KINDS = frozenset({"TENSOR_MATCH", "NO_TENSOR_ALIASING", "DIMENSION_DYNAMIC_MARKING_GUARD", "NONE_MATCH",
                            "TYPE_MATCH", "ID_MATCH"})
#: Guards on the module tree and on globals: stood in for (tensors, the tree's structure) or fixed
#: once vLLM has built and loaded the model (attribute values, globals): see the module docstring.
FIXED_KINDS = frozenset({"TENSOR_MATCH", "DIMENSION_DYNAMIC_MARKING_GUARD", "TYPE_MATCH", "ID_MATCH",
                         "LENGTH_CHECK", "DICT_CONTAINS", "EQUALS_MATCH", "TRUE_MATCH", "FALSE_MATCH", "NONE_MATCH",
                         "OBJECT_ALIASING", "NO_TENSOR_ALIASING"})
#: State vLLM changes every step: a guard whose source names it refuses the route.
PER_STEP = re.compile(r"forward_context")
_ROOT = re.compile(r"([LG])\['(\w+)'\]")


def guards_of(manager: Any) -> list[tuple[str, str, str]]:
    """(kind, source, code) of every leaf guard under dynamo's guard `manager` (its tree, depth
    first); `source` is the manager's ("" on the root, whose guards name their own objects in `code`)."""
    found, stack = [], [manager]
    while stack:
        node = stack.pop()
        source = node.get_source() if hasattr(node, "get_source") else ""
        found.extend((type(guard).__name__, source, " ".join(guard.verbose_code_parts()))
                     for guard in node.get_leaf_guards())
        stack.extend(node.get_child_managers())
    return found


def guard_refusal(guard_manager: Any) -> str | None:
    """Why the guards of dynamo's cache entry cannot be stood in for on vLLM's model (None: they
    can), the first guard that is none of the module docstring's kinds named."""
    root = getattr(guard_manager, "root", guard_manager)
    for kind, source, code in guards_of(root):
        if PER_STEP.search(source) or PER_STEP.search(code):
            return f"dynamo guards {source or code} ({kind}), state vLLM changes every step"
        match = _ROOT.search(source)
        if match is None:
            allowed = ROOT_KINDS
        elif match.group(1) == "G" or match.group(2) == "self":
            allowed = FIXED_KINDS
        elif source != match.group(0):
            return f"dynamo guards {source} ({kind}), inside an argument of the step"
        else:
            allowed = ARGUMENT_KINDS
        if kind not in allowed:
            return f"dynamo guards {source or 'the frame'} with {kind}, which no check of the direct path stands in for"
    return None


class DirectCall:
    """What `module._compiled_call_impl` becomes: the direct dispatcher in front of vLLM's compiled call."""

    def __init__(self, module: torch.nn.Module, compiled_call: Any) -> None:
        self.compiled_call = compiled_call  # torch.compile(module._call_impl): dynamo's path
        self.dispatcher = DirectDispatcher(module, guard_policy=guard_refusal)
        self.dynamo_calls = 0  # the calls that went through dynamo's frame hook and guards

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.dispatcher(args, kwargs, self._through_dynamo)

    def _through_dynamo(self, args: tuple, kwargs: dict) -> Any:
        self.dynamo_calls += 1
        return self.compiled_call(*args, **kwargs)

    def recheck(self) -> None:
        """Send the next call through dynamo's guards (after changing what they check: see the docstring)."""
        self.dispatcher.recheck()


def compiled_module(deferred: Any) -> torch.nn.Module | str:
    """The module compiled with `module.compile(...)` whose frame calls `deferred` (found on this
    thread's stack: `Module._wrapped_call_impl` calling its `_compiled_call_impl`, the module's
    `forward` cached by dynamo with `deferred` as its graph), or why there is none."""
    wrapped = torch.nn.Module._wrapped_call_impl.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is wrapped:
            module = frame.f_locals.get("self")
            if not isinstance(module, torch.nn.Module) or module._compiled_call_impl is None:
                return "the model was not compiled with Module.compile (vLLM's mode-1 call)"
            forward = type(module).forward
            if dynamo_code.cache_entry(forward.__code__, forward.__globals__, deferred) is None:
                return f"{type(module).__qualname__}.forward's compiled code does not call this graph"
            return module
        frame = frame.f_back
    return "no Module.compile'd model on the stack (the model was compiled with torch.compile(model) or a function)"


def install(deferred: Any) -> DirectCall | None:
    """Put the direct dispatcher in front of the compiled model calling `deferred` (the first
    compiled step), or log why not; the `DirectCall`, or None."""
    refusal = fast_path_refusal("vllm_fast_path")
    module = compiled_module(deferred) if refusal is None else refusal
    if isinstance(module, str):
        log.info("ascend_compile: vLLM model calls go through dynamo's guards: %s", module)
        return None
    if isinstance(module._compiled_call_impl, DirectCall):
        return module._compiled_call_impl
    direct = DirectCall(module, module._compiled_call_impl)
    module._compiled_call_impl = direct
    log.info("ascend_compile: %s: steps after this one go straight to the compiled graph (dispatch='direct'; "
             "ASCEND_COMPILE_OPTIONS {\"dispatch\": \"dynamo\"} turns it off)", type(module).__qualname__)
    return direct
