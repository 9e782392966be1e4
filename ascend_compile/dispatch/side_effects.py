"""What a traced frame does to Python objects besides its graph, as dynamo recorded it.

Dynamo replays a frame's side effects after calling its graph, from what it recorded while tracing
(`tx.output.side_effects`). A direct call allows one kind, where it changes nothing: constants
written into an object's instance dict (transformers' output capturing resets a context variable's
`compiling` and `global_var` after every forward), which dynamo replays with
`object_setattr_ignore_descriptor`; `route.py` arms a route only once such an attribute was found
at its constant before a call, and checks it still is on each. Anything else (a computed value
stored, a list or dict mutated, a tensor hook, a global written) refuses the direct call. Objects
created inside the frame are not side effects unless they escape, which dynamo's code would show
(`dynamo_code.py`); deletions of attributes the object did not have before the frame are no-ops,
which dynamo does not replay either.
"""
from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any


@dataclasses.dataclass(frozen=True)
class ConstantStore:
    """`object_setattr_ignore_descriptor(<target>, name, value)` after the graph."""

    target: str  # the object's source expression
    name: str
    value: Any


def root_tx() -> Any:
    """The instruction translator of the frame dynamo is compiling, or None."""
    from torch._dynamo import symbolic_convert

    tx = getattr(symbolic_convert.tls, "current_tx", None)
    return tx if isinstance(tx, symbolic_convert.InstructionTranslator) else None


def _had(obj: Any, name: str) -> bool:
    """Whether `obj` held attribute `name` before the frame ran: in its instance dict, or in a slot that
    is set (a slot's deletion is a side effect too; no descriptor but the slot's is run)."""
    if name in getattr(obj, "__dict__", {}):
        return True
    slot = inspect.getattr_static(type(obj), name, None)
    if not isinstance(slot, types.MemberDescriptorType):
        return False
    try:
        slot.__get__(obj, type(obj))
    except AttributeError:
        return False
    return True


def _stores_of(side_effects: Any, var: Any) -> list[ConstantStore]:
    from torch._dynamo import variables
    from torch._dynamo.side_effects import AttrMutationKind
    from torch._dynamo.variables.base import AttributeMutationExisting

    source = getattr(var, "source", None)
    mutations = side_effects.store_attr_mutations.get(var, {})
    if not (isinstance(var, variables.UserDefinedObjectVariable) and isinstance(var.mutation_type,
                                                                                  AttributeMutationExisting)
            and source is not None and mutations):
        raise ValueError(f"the step mutates {source.name if source is not None else type(var).__name__}")
    stores = []
    for name, value in mutations.items():
        if isinstance(value, variables.DeletedVariable) and not _had(var.value, name):
            continue  # added and deleted inside the frame: dynamo replays nothing
        if side_effects.get_attr_mutation_kind(var, name) is not AttrMutationKind.INSTANCE_DICT or not (
            isinstance(value, variables.ConstantVariable)
        ):
            raise ValueError(f"the step sets {source.name}.{name} to {type(value).__name__}")
        stores.append(ConstantStore(source.name, name, value.as_python_constant()))
    return stores


def record() -> tuple[tuple[ConstantStore, ...], str | None]:
    """The constant stores of the frame dynamo is compiling (call from the backend), or why a direct
    call cannot replay its side effects."""
    from torch._dynamo.variables.base import AttributeMutationNew, ValueMutationNew

    try:
        tx = root_tx()
        if tx is None:
            return (), "the graph was not compiled from a frame dynamo traced"
        if tx.current_instruction.opname not in ("RETURN_VALUE", "RETURN_CONST"):
            return (), f"the graph was compiled at a graph break ({tx.current_instruction.opname})"
        side_effects = tx.output.side_effects
        if side_effects.tensor_hooks or side_effects.save_for_backward:
            return (), "the step registers tensor hooks or saves tensors for backward"
        stores: list[ConstantStore] = []
        for var in list(side_effects.id_to_variable.values()):
            if not side_effects.is_modified(var) or isinstance(var.mutation_type, (AttributeMutationNew,
                                                                                    ValueMutationNew)):
                continue
            stores += _stores_of(side_effects, var)
        return tuple(stores), None
    except ValueError as why:
        return (), str(why)
    except (AttributeError, ImportError) as err:  # another dynamo: nothing to rely on
        return (), f"dynamo's record of the step's side effects is not readable ({err})"
