"""`lowering/workspace_group.py` at the level of its functions, on stand-in artifacts: a group's one slot
is sized for its largest member's need, grown (allocated before the old is released, every member's
captured graphs dropped, each member pointed at the new slot in its own dict) when a member needing more
joins; members share the group's lock; the group's record for the plan; the registry's groups and their
one runtime. Fast: no model is compiled (tests/test_workspace_group.py checks the same end to end)."""
from __future__ import annotations

import dataclasses
import gc
import logging
import types

import pytest
import torch

from ascend_compile.lowering import workspace_group as wg
from ascend_compile.lowering.workspace_group import WorkspaceGroup, group_for, model_name, point_at, slot_need
from ascend_compile.runtime.base import GraphRuntime, Runtime


class Eager(Runtime):
    """A runtime without graphs, recording allocations."""

    name = "eager"

    def __init__(self, device: str = "cpu") -> None:
        self._device = torch.device(device)
        self.events: list[tuple] = []

    @property
    def device(self) -> torch.device:
        return self._device

    def empty(self, shape, dtype):
        self.events.append(("empty", shape, dtype))
        return torch.zeros(shape, dtype=dtype)

    def synchronize(self) -> None:
        self.events.append(("synchronize",))


class Graphs(Eager, GraphRuntime):
    name = "graphs"

    def graph(self, label=""):
        raise AssertionError("no graph is captured here")


class Art:
    """A stand-in compiled artifact: its plan's slots (bytes each), its captured graphs and its plan dumps."""

    def __init__(self, needs: list[int], name: str | None = "m", graphs: int = 0, budget: int | None = None) -> None:
        slots = {f"ws{i}": types.SimpleNamespace(nbytes=n) for i, n in enumerate(needs)}
        self.rewritten = types.SimpleNamespace(plan=types.SimpleNamespace(slots=slots))
        self.config = types.SimpleNamespace(model_name=name)
        self.workspaces = {key: None for key in slots}
        self.graphs = {i: object() for i in range(graphs)}
        self.piecewise = {"p": object()} if graphs else {}
        self.writes = 0
        self.startup = types.SimpleNamespace(budget=types.SimpleNamespace(graphs=budget) if budget is not None else None)
        self.lock = None
        self.group = None

    def write_plan(self) -> None:
        self.writes += 1


def test_slot_need_is_the_largest_slot_of_the_artifacts_plan():
    assert slot_need(Art([10, 300, 20])) == 300
    assert slot_need(Art([])) == 0


def test_model_name_is_the_option_else_unnamed():
    assert model_name(Art([], name="drafter")) == "drafter"
    assert model_name(Art([], name=None)) == "unnamed" and model_name(Art([], name="")) == "unnamed"


def test_point_at_changes_every_slot_in_the_artifacts_own_dict():
    art = Art([1, 2])
    held = art.workspaces  # dynamo's wrapper holds this very dict
    slot = torch.zeros(4, dtype=torch.uint8)
    point_at(art, slot)
    assert art.workspaces is held and list(held) == ["ws0", "ws1"] and all(v is slot for v in held.values())


def test_the_first_member_sizes_the_slot_and_shares_the_lock(caplog):
    runtime = Eager()
    group = WorkspaceGroup("spec", runtime)
    art = Art([100, 40], name="target")
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        group.join(art)
    assert runtime.events == [("empty", (100,), torch.uint8)]
    assert group.slot.shape == (100,) and group.slot.dtype == torch.uint8
    assert all(v is group.slot for v in art.workspaces.values())
    assert art.lock is group.lock and art.group is group and group.live() == [art]
    assert group.regrown == [] and art.writes == 0
    assert [r.getMessage() for r in caplog.records] == [
        "ascend_compile: workspace group 'spec': target joined, slot 100 bytes"]


def test_a_member_needing_no_more_shares_the_slot_as_it_is():
    runtime = Eager()
    group = WorkspaceGroup("spec", runtime)
    first, second, third = Art([100], graphs=2), Art([60]), Art([100])
    group.join(first)
    slot = group.slot
    group.join(second)
    group.join(third)  # as much as the slot holds: no growth
    assert group.slot is slot and len(runtime.events) == 1 and first.graphs and first.writes == 0
    assert second.workspaces["ws0"] is slot and third.workspaces["ws0"] is slot
    assert group.live() == [first, second, third]


def test_a_member_needing_more_grows_the_slot_and_drops_every_members_graphs(caplog):
    runtime = Graphs()
    group = WorkspaceGroup("spec", runtime)
    first, second = Art([100], graphs=2), Art([50], graphs=1)
    group.join(first)
    group.join(second)
    old = group.slot
    bigger = Art([300], name="drafter")
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        group.join(bigger)
    assert runtime.events[1:] == [("synchronize",), ("empty", (300,), torch.uint8)]
    assert group.slot is not old and group.slot.numel() == 300
    assert group.regrown == [{"from_bytes": 100, "to_bytes": 300, "graphs_dropped": 3 + 2}]
    for art in (first, second, bigger):
        assert art.workspaces["ws0"] is group.slot and art.graphs == {} and art.piecewise == {}
    assert (first.writes, second.writes, bigger.writes) == (1, 1, 0)  # the members' dumps show the new slot
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["ascend_compile: workspace group 'spec': slot grown from 100 to 300 bytes, 5 graphs to capture "
                        "again", "ascend_compile: workspace group 'spec': drafter joined, slot 300 bytes"]


def test_a_runtime_without_graphs_is_not_synchronized_and_an_empty_group_neither():
    runtime = Eager()
    group = WorkspaceGroup("spec", runtime)
    group.join(Art([10]))
    group.join(Art([20]))
    assert [e[0] for e in runtime.events] == ["empty", "empty"]
    graphs = Graphs()
    WorkspaceGroup("g", graphs).join(Art([10]))
    assert graphs.events == [("empty", (10,), torch.uint8)]


def test_dead_members_leave_the_group():
    group = WorkspaceGroup("spec", Eager())
    kept, gone = Art([10], name="kept", graphs=1), Art([5], name="gone", graphs=3)
    group.join(kept)
    group.join(gone)
    del gone
    gc.collect()
    assert group.live() == [kept] and len(group.members) == 1
    group.join(Art([30]))  # grows: only the live members' graphs are dropped and their plans rewritten
    assert group.regrown[-1]["graphs_dropped"] == 1 + 1 and kept.writes == 1


def test_planned_graphs_sum_the_members_budgets():
    group = WorkspaceGroup("spec", Eager())
    members = [Art([1], budget=5), Art([1]), Art([1], budget=7)]
    for art in members:
        group.join(art)
    assert group.planned_graphs() == 12
    assert WorkspaceGroup("empty", Eager()).planned_graphs() == 0


def test_describe_compares_the_slot_with_one_slot_a_member():
    group = WorkspaceGroup("spec", Eager())
    assert group.describe() == {"name": "spec", "slot_bytes": 0, "members": [], "separate_slots_bytes": 0,
                                "saved_bytes": 0, "regrown": []}
    members = [Art([100], name="target"), Art([300], name="drafter")]
    for art in members:
        group.join(art)
    described = group.describe()
    assert described == {"name": "spec", "slot_bytes": 300,
                         "members": [{"model": "target", "needs_bytes": 100}, {"model": "drafter", "needs_bytes": 300}],
                         "separate_slots_bytes": 400, "saved_bytes": 100,
                         "regrown": [{"from_bytes": 100, "to_bytes": 300, "graphs_dropped": 0}]}
    described["regrown"].append("x")
    assert len(group.regrown) == 1  # a copy


def test_the_lock_is_reentrant():
    group = WorkspaceGroup("spec", Eager())
    with group.lock:
        group.join(Art([10]))  # a member joining from a step of another holds it again
    assert group.slot is not None


@dataclasses.dataclass(frozen=True)
class Target:
    runtime: Runtime
    other: str = "kept"


def test_the_first_member_makes_the_group_on_its_runtime_the_next_share_it():
    name = "test_workspace_group_slots"
    first = Target(Eager(), "a")
    target, group = group_for(name, first)
    assert target is first and group.runtime is first.runtime and group.name == name
    assert wg._groups[name] is group
    again = Target(Eager(), "b")  # another runtime object of the same kind and device
    target, same = group_for(name, again)
    assert same is group and target.runtime is first.runtime and target.other == "b"
    del group, same
    gc.collect()
    assert name not in wg._groups  # the group dies with its last holder


@pytest.mark.parametrize("other", [Graphs(), Eager("meta")], ids=["another kind", "another device"])
def test_a_member_on_another_runtime_is_refused(other):
    name = "test_workspace_group_slots_refused"
    _, group = group_for(name, Target(Eager()))
    with pytest.raises(ValueError) as raised:
        group_for(name, Target(other))
    assert str(raised.value) == (
        f"workspace_group: {name!r} shares runtime 'eager' on cpu; this graph's is {other.name!r} on "
        f"{other.device}: a group's members run on one device and runtime")
    assert group is wg._groups[name]
