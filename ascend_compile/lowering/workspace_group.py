"""Workspace groups: one attention-workspace slot, and one runtime, for compiled artifacts whose
graphs never run at once (option `workspace_group`; e.g. a speculative decoder's target and drafter).

Each artifact alone owns one slot sized for every graph it captures (`passes/workspaces.py`). The
artifacts of one group share instead: one runtime (one device: its graph pool, its streams), one
slot sized for the largest need of all of them, and one lock, which every member's step holds.

Why sharing is sound: a workspace is scratch a kernel writes before it reads, within one call, so
two graphs may use the same bytes as long as no two of them run at the same time. Members' steps
are serialized on the host by the group's lock (a call of one member from another thread waits for
the other's step to end), and each step's replay goes to the runtime's stream the caller has current;
on "npu" a step ends with a synchronize (`after_replay`), on the simulator the device runs its queue
in order. What a user must not do: replay members on two device streams that may overlap (e.g. the
drafter under another `torch.cuda.stream` than the target, without a synchronize between them): the
lock orders the host calls, not the device's streams.

The slot is never freed or moved while a captured graph reads it (DESIGN.md §7, case 3, across
models): the group holds it strongly for its whole life. When a member joins needing more than the
slot holds, the group allocates a larger one and drops every member's captured graphs (full and
piecewise), which are captured again on their next step, before the old slot is released: no graph
that reads the old slot outlives it. The group lives as long as a member does.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any

import torch

from ..runtime.base import GraphRuntime, Runtime

log = logging.getLogger("ascend_compile")

#: The live groups by name (a group dies with its last member, its slot with it).
_groups: "weakref.WeakValueDictionary[str, WorkspaceGroup]" = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


def slot_need(art: Any) -> int:
    """The bytes the largest workspace slot of artifact `art`'s own plan needs."""
    return max((slot.nbytes for slot in art.rewritten.plan.slots.values()), default=0)


def model_name(art: Any) -> str:
    """What plans and logs call artifact `art`: its `model_name` option, else "unnamed"."""
    return art.config.model_name or "unnamed"


def point_at(art: Any, slot: torch.Tensor) -> None:
    """Make every workspace slot of artifact `art` be `slot`, in its one dict: dynamo's wrapper of the
    artifact holds a copy of its attributes (`functools.wraps`), so a new dict would keep the old slots alive."""
    art.workspaces.update(dict.fromkeys(art.workspaces, slot))


class WorkspaceGroup:
    """The slot, runtime and lock the artifacts of one `workspace_group` share."""

    def __init__(self, name: str, runtime: Runtime) -> None:
        self.name = name
        self.runtime = runtime
        self.lock = threading.RLock()  # every member's step holds it (`CompiledArtifact.lock`)
        self.slot: torch.Tensor | None = None  # held strongly for the group's life
        self.members: list[weakref.ref] = []
        self.regrown: list[dict[str, int]] = []  # each re-allocation: old and new bytes, graphs dropped

    def live(self) -> list[Any]:
        """The members still alive, in the order they joined."""
        self.members = [ref for ref in self.members if ref() is not None]
        return [ref() for ref in self.members]

    def join(self, art: Any) -> None:
        """Make artifact `art` (not yet called) a member: its slots become the group's slot, grown
        first where `art` needs more; its steps hold the group's lock."""
        need = slot_need(art)
        with self.lock:
            if self.slot is None or need > self.slot.numel():
                self._grow(need)
            self.members.append(weakref.ref(art))
            point_at(art, self.slot)
            art.lock, art.group = self.lock, self
        log.info("ascend_compile: workspace group %r: %s joined, slot %d bytes", self.name, model_name(art),
                 self.slot.numel())

    def _grow(self, nbytes: int) -> None:
        """A slot of `nbytes`: allocated before the old one is released, every member's captured graph
        dropped in between (each is captured again on its next step, on the new slot)."""
        members = self.live()
        if members and isinstance(self.runtime, GraphRuntime):
            self.runtime.synchronize()  # no replay reading the old slot is still running
        old = self.slot
        self.slot = self.runtime.empty((nbytes,), torch.uint8)
        if old is not None:
            dropped = sum(len(art.graphs) + len(art.piecewise) for art in members)
            self.regrown.append({"from_bytes": old.numel(), "to_bytes": nbytes, "graphs_dropped": dropped})
            log.info("ascend_compile: workspace group %r: slot grown from %d to %d bytes, %d graphs to capture again",
                     self.name, old.numel(), nbytes, dropped)
        for art in members:
            art.graphs.clear()
            art.piecewise.clear()
            point_at(art, self.slot)
            art.write_plan()  # its dump shows the grown slot and no graph captured on the old one

    def planned_graphs(self) -> int:
        """The graphs the members plan to capture (`budget.py`): on one runtime, they share its budget."""
        return sum(art.startup.budget.graphs for art in self.live() if art.startup.budget is not None)

    def describe(self) -> dict[str, Any]:
        """What plan.json and `inspect` say of the group: the slot's bytes against one slot a member."""
        needs = [{"model": model_name(art), "needs_bytes": slot_need(art)} for art in self.live()]
        separate = sum(n["needs_bytes"] for n in needs)
        slot = self.slot.numel() if self.slot is not None else 0
        return {"name": self.name, "slot_bytes": slot, "members": needs, "separate_slots_bytes": separate,
                "saved_bytes": separate - slot, "regrown": list(self.regrown)}


def group_for(name: str, target: Any) -> tuple[Any, WorkspaceGroup]:
    """The group `name` (made on `target`'s runtime if new) and `target` on the group's runtime; a
    ValueError where `target`'s runtime is of another kind or device than the group's."""
    with _registry_lock:
        group = _groups.get(name)
        if group is None:
            group = _groups[name] = WorkspaceGroup(name, target.runtime)
            return target, group
    runtime, own = group.runtime, target.runtime
    if (runtime.name, runtime.device) != (own.name, own.device):
        raise ValueError(f"workspace_group: {name!r} shares runtime {runtime.name!r} on {runtime.device}; this "
                         f"graph's is {own.name!r} on {own.device}: a group's members run on one device and runtime")
    return dataclasses.replace(target, runtime=runtime), group
