"""What a captured graph holds of its inputs, checked every step before it replays.

A captured graph reads its in-place inputs (weights, KV caches) at the addresses they had at
capture, and took its host scalars (0-d CPU tensors, e.g. the floats dynamo wraps) as values frozen
into its tasks. A step whose inputs moved, or whose scalars changed, must not replay it. Both checks
are one `map` over the gathered inputs (about 0.1 us an input). Under `frozen_parameters` the
parameters' addresses are not read; each parameter must still be the very object the graph was
captured with (one `map(operator.is_, ...)`, a few ns a parameter): another model of the same class
served by the same graph (dynamo's guards do not tell instances apart), or parameters assigned
anew (`load_state_dict(assign=True)`, a swapped submodule), are then captured again. Under plain
`torch.compile(dynamic=True)` every norm's epsilon is such a scalar, under `ascend_compile.compile`
(floats specialised) none is.

A direct route (`dispatch/route.py`) fills the positions it gathered once (modules' parameters and
buffers, `dispatch/gathering.py`) with the same objects on every call, from tuples made when it was
built; it passes those positions as `fixed`, one frozenset per route, whose identity stands for them.
Once every identified object is found at such a position and the identity check passed for a route,
that route's later calls skip it: the objects there cannot change while the route lives (a new route
makes a new `fixed`, a new capture a new `CapturedInputs`). Addresses and scalars are checked always;
where every address-checked input sits at such a position, that route's calls read the addresses of
the tensors kept from its first verified call (the very objects its positions hold) without picking
them out of the arguments.
"""
from __future__ import annotations

import collections
import logging
import operator
from typing import Any, Iterable, Sequence

import torch

from ..passes.roles import GraphSignature, InputSpec, Role
from .inputs import gather

log = logging.getLogger("ascend_compile")


class CapturedInputs:
    """The addresses of the in-place inputs `checked`, the values of the host scalars `scalars` and
    the objects at `identified` (parameters under `frozen_parameters`, held here) in the arguments a
    graph was captured with."""

    def __init__(self, args: Sequence[Any], checked: Sequence[int], scalars: Sequence[int],
                 identified: Sequence[int] = ()) -> None:
        self.addresses = {i: args[i].data_ptr() for i in checked if isinstance(args[i], torch.Tensor)}
        self.scalars = {i: args[i].item() for i in scalars}
        self.objects = {i: args[i] for i in identified}
        self._pointers = (gather(list(self.addresses)), list(self.addresses.values()))
        self._values = (gather(list(self.scalars)), list(self.scalars.values()))
        self._objects = (gather(list(self.objects)), tuple(self.objects.values()))
        self._identified = frozenset(self.objects)
        self._verified: frozenset[int] | None = None  # the `fixed` of the route whose objects were found identical
        self._held: tuple[torch.Tensor, ...] | None = None  # its address-checked tensors, where all are at `fixed`

    def changed(self, args: Sequence[Any], fixed: frozenset[int] | None = None) -> list[int]:
        """Positions of the in-place inputs at another address, of the scalars of another value and
        of the other objects than at capture (`fixed`: a direct route's, see the module docstring)."""
        (pick, pointers), (pick_scalars, values), (pick_objects, objects) = self._pointers, self._values, self._objects
        verified = fixed is not None and fixed is self._verified
        moved = []
        if list(map(torch.Tensor.data_ptr, self._held if verified and self._held is not None else pick(args))) \
                != pointers:
            moved = [i for i, ptr in self.addresses.items() if args[i].data_ptr() != ptr]
        if values and list(map(torch.Tensor.item, pick_scalars(args))) != values:
            moved += [i for i, v in self.scalars.items() if args[i].item() != v]
        if verified:
            return moved
        if not all(map(operator.is_, pick_objects(args), objects)):
            moved += [i for i, obj in self.objects.items() if args[i] is not obj]
        elif fixed is not None and self._identified <= fixed:
            self._verified = fixed
            self._held = tuple(pick(args)) if not moved and self.addresses.keys() <= fixed else None
        return moved

    def event(self, args: Sequence[Any], changed: Sequence[int]) -> tuple:
        """What the inputs `changed` (positions) are now: their addresses, or a scalar's value.
        Graphs that find the same change (a new KV cache, seen by each bucket's graph in turn)
        find the same event."""
        return tuple((i, args[i].item() if i in self.scalars else args[i].data_ptr()) for i in changed)


class ChangeLog:
    """One short WARNING per change of a graph's in-place inputs (a new KV cache): how many inputs of
    which kind, the graph re-captured, how many others will be; the rest at DEBUG (issue 24)."""

    def __init__(self, signature: GraphSignature, names: dict[int, str]) -> None:
        self.signature, self.names = signature, names
        self._last: tuple | None = None  # the last change logged: graphs finding the same one log it once

    def log(self, graph: Any, moved: list[int], args: Sequence[Any], graphs: Iterable[Any]) -> None:
        """`graph` (a `GraphEntry` or `PiecewiseGraph`) found the inputs `moved` changed; `graphs`: every
        graph of the artifact."""
        log.debug("ascend_compile: %s: inputs changed since its capture: %s", graph.name,
                  [self.names[i] for i in moved])
        event = graph.captured_inputs.event(args, moved)
        if event == self._last:
            log.debug("ascend_compile: re-capturing %s for the same change", graph.name)
            return
        self._last = event
        others = sum(1 for g in graphs
                     if g is not graph and g.captured_inputs is not None and g.captured_inputs.changed(args))
        later = f"; {others} more captured graph{'s' * (others > 1)} will re-capture on next use" if others else ""
        log.warning("ascend_compile: %s since %s was captured: re-capturing it%s",  # the key: sizes at DEBUG
                    change_summary([self.signature.inputs[i] for i in moved]), graph.key, later)


def change_summary(specs: Sequence[InputSpec]) -> str:
    """The changed inputs in a few words, by kind: "8 KV cache inputs moved", "1 parameter moved,
    1 host scalar changed" (the names, long dynamo paths, are for the debug log)."""
    kinds = collections.Counter(_kind(spec) for spec in specs)
    return ", ".join(f"{n} {kind}{'s' if n > 1 else ''} {'changed' if kind == 'host scalar' else 'moved'}"
                     for kind, n in kinds.items())


def _kind(spec: InputSpec) -> str:
    if spec.role is Role.SCALAR:
        return "host scalar"
    if spec.role is Role.KV_CACHE:
        return "KV cache input"
    return "parameter" if spec.parameter else "buffer"
