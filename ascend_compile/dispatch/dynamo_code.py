"""Dynamo's code for a frame, read to make sure that calling its graph directly skips nothing.

Once a frame is compiled, dynamo runs bytecode of its own in the frame's place: it gathers the
graph's inputs (the sources), calls the graph and builds the return value from its outputs, and
then replays what the frame did to Python objects (an attribute set, a list appended to, a global
written, grad mode switched) or calls the code after a graph break. A direct call does only the
first part (and skips constant stores that change nothing, `side_effects.py`), so it is allowed
only where dynamo's code does nothing else: its instructions load, subscript, call and build; the
globals it loads are the graph, dynamo's own utilities and the stores' objects; the attributes it
reads are those the sources and the stores name; it calls `object_setattr_ignore_descriptor` only
where dynamo recorded stores. Anything else refuses the direct call, naming the instruction.
"""
from __future__ import annotations

import dataclasses
import dis
import re
import types
from typing import Any, Sequence

import torch

from .side_effects import ConstantStore

#: Instructions that only move values: loads, subscripts, calls, building the result, returning it
#: (and, on torch 2.15, the forward branches around its profiler marks).
SAFE_OPCODES = frozenset({
    "RESUME", "NOP", "CACHE", "EXTENDED_ARG", "MAKE_CELL", "COPY_FREE_VARS",
    "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST", "LOAD_CONST", "LOAD_SMALL_INT",
    "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "BINARY_SUBSCR",
    "STORE_FAST", "DELETE_FAST", "COPY", "SWAP", "POP_TOP", "PUSH_NULL",
    "PRECALL", "CALL", "CALL_KW", "KW_NAMES",
    "BUILD_LIST", "BUILD_TUPLE", "LIST_EXTEND", "LIST_APPEND", "UNPACK_SEQUENCE",
    "RETURN_VALUE", "RETURN_CONST",
    # torch 2.15 gates its profiler marks on `_is_profiler_enabled()` (`PROFILER_GATE`): an `is None`
    # test and forward jumps, which choose between instructions that are themselves each checked here;
    # no backward jump (no loop) is allowed
    "IS_OP", "TO_BOOL", "JUMP_FORWARD", "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_FORWARD_IF_TRUE",
    "POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE", "POP_JUMP_IF_FALSE", "POP_JUMP_IF_TRUE",
    "POP_JUMP_IF_NONE", "POP_JUMP_IF_NOT_NONE",
})
#: The module dynamo's code loads its utilities from, and the utilities a plain graph call uses.
DYNAMO_UTILS = "__import_torch_dot__dynamo_dot_utils"
DYNAMO_UTIL_ATTRS = frozenset({
    "call_size", "call_stride", "call_storage_offset", "record_pregraph_bytecode_enter",
    "record_pregraph_bytecode_exit",
})
#: torch 2.15 records its pre-graph profiler marks (`record_pregraph_bytecode_enter/exit`) only where
#: `torch.autograd.profiler._is_profiler_enabled` is set: the module global and the flag it reads. A
#: direct call skips those marks, as it skips the unconditional ones of torch 2.10 to 2.14: they feed
#: the profiler's trace, not the step.
PROFILER_GATE = ("__import_torch_dot_autograd_dot_profiler", "_is_profiler_enabled")

#: What dynamo's code calls to replay a constant store.
STORE_UTIL = "object_setattr_ignore_descriptor"

_ATTRIBUTE = re.compile(r"\.(\w+)")
_GLOBAL = re.compile(r"G\['([^']+)'\]")


def _global_names(code: types.CodeType) -> list[str]:
    return [i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"]


#: The wrapper dynamo puts around a graph when tracing inlined a tensor subclass's
#: `__torch_function__` (vLLM's parameter classes): the graph runs with subclass dispatch disabled
#: (`OutputGraph.compile_and_call_fx_graph`, torch 2.13 and 2.14), and so must a direct call.
TF_DISABLED_WRAPPER = "_tf_disabled_wrapper"


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """Dynamo's cache entry whose graph is an artifact: the code that runs in the frame's place, its
    guards, and whether the graph runs under `torch._C.DisableTorchFunctionSubclass()`."""

    code: types.CodeType
    guard_manager: Any
    torch_function_disabled: bool


def _called(compiled: Any) -> tuple[Any, bool]:
    """What dynamo's compiled function calls, and whether it disables subclass dispatch around it."""
    called = getattr(compiled, "_torchdynamo_orig_callable", None)
    if getattr(called, "__name__", None) == TF_DISABLED_WRAPPER and called.__code__.co_freevars == ("real_compiled_fn",):
        return called.__closure__[0].cell_contents, True
    return called, False


def cache_entry(code: types.CodeType, globals_: dict[str, Any], artifact: Any) -> CacheEntry | None:
    """Dynamo's cache entry for `code` whose graph is `artifact`, or None (always, for no artifact)."""
    for entry in torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code):
        for name in _global_names(entry.code):
            if not name.startswith("__compiled_fn"):
                continue
            called, disabled = _called(globals_.get(name))
            if called is not None and called is artifact:
                return CacheEntry(entry.code, entry.guard_manager, disabled)
    return None


def hoisted_builds(classes: Sequence[type], modules: Sequence[Any]) -> tuple[set[str], set[str]]:
    """(globals, attributes) dynamo's code reads to build hoisted value-type opaque inputs of
    `classes` (`graph_inputs.hoisted_value`) from the modules' attributes: each class through its
    module's import global, and the plain data attributes (str, int, float, bool, None in a module's
    instance dict, no descriptor of that name on its class: reading one runs no code) of `modules`."""
    globals_ = {"__import_" + cls.__module__.replace(".", "_dot_") for cls in classes}
    attributes = {cls.__name__ for cls in classes}
    if classes:
        for module in modules:
            attributes.update(name for name, value in vars(module).items()
                              if isinstance(value, (str, int, float, bool, type(None))) and not hasattr(type(module), name))
    return globals_, attributes


def unsafe_instruction(code: types.CodeType, sources: Sequence[str], stores: Sequence[ConstantStore],
                       builds: tuple[set[str], set[str]] = (set(), set())) -> str | None:
    """The first instruction of dynamo's `code` that a direct call would skip (or None), where
    `sources` are the graph inputs' source expressions, `stores` the constant stores the direct
    call replays and `builds` what building hoisted inputs reads (`hoisted_builds`)."""
    named = [*sources, *(store.target for store in stores)]
    attributes = ({name for text in named for name in _ATTRIBUTE.findall(text)} | DYNAMO_UTIL_ATTRS | builds[1]
                  | {PROFILER_GATE[1]})
    globals_ = {DYNAMO_UTILS, PROFILER_GATE[0]} | {name for text in named for name in _GLOBAL.findall(text)} | builds[0]
    if stores:
        attributes.add(STORE_UTIL)
    replays = 0
    for instruction in dis.get_instructions(code):
        name, value = instruction.opname, instruction.argval
        if name not in SAFE_OPCODES:
            return f"{name} {value!r}"
        if name == "LOAD_GLOBAL" and not (value in globals_ or str(value).startswith("__compiled_fn")):
            return f"LOAD_GLOBAL {value!r}"
        if name in ("LOAD_ATTR", "LOAD_METHOD") and value not in attributes:
            return f"{name} {value!r}"
        replays += name in ("LOAD_ATTR", "LOAD_METHOD") and value == STORE_UTIL
    if bool(replays) != bool(stores):  # loaded once and kept in a local however many stores it makes
        return f"{STORE_UTIL} {'loaded' if replays else 'not loaded'} where dynamo recorded {len(stores)} stores"
    return None
