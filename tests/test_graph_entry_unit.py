"""`lowering/graph_entry.py` at the level of one `GraphEntry`, on a stand-in staging and the recording
runtime of tests/test_capture_table.py: a capture with all-padding host lists (or the step's KV length),
the target's refusal of its capture step, the plain-op writes of the capture's run put back (also when
it raises), what the entry keeps (aliased outputs, the captured inputs' addresses, the clashes of its
writes), its outputs narrowed per step shape, a replay (copy in, launch, updates, after-replay; a replay
that raises drops the graph) and a run op by op. Fast: no model is compiled."""
from __future__ import annotations

import time

import pytest
import sympy
import torch
from torch import fx

from ascend_compile.lowering import graph_entry as ge
from ascend_compile.lowering.capture import UpdateSchedule, UpdateTable, WorkspaceLifetime
from ascend_compile.lowering.graph_entry import GraphEntry, MovedInputs, specialization_of
from ascend_compile.lowering.inputs import Geometry, Step, StepPlan
from ascend_compile.lowering.phase_seconds import PhaseSeconds
from ascend_compile.passes.kernel_call import HOST_META_KEY, Conversion, HostSource
from ascend_compile.passes.roles import GraphSignature, InputSpec, Role, SymbolKind
from ascend_compile.passes.workspaces import GraphKey
from tests.test_capture_table import LOG, PA, Plain, Tasks, _entry, _pa_graph, fake_pa

SEQ_LENS = HostSource("seq_lens", Conversion.LIST)
QSL = HostSource("query_start_loc", Conversion.ENDS)
S0 = sympy.Symbol("s0")


class Staging:
    """A stand-in staging: the graph's arguments are the step's, but input 0 goes through a static buffer."""

    def __init__(self, signature: GraphSignature, geometry: Geometry = Geometry(4, 4), clashes=()) -> None:
        self.signature = signature
        self.geometry = geometry
        self.clashes = list(clashes)
        self.static = torch.zeros(4)
        self.located = []

    def fill_padding(self) -> None:
        LOG.append(("fill_padding",))
        self.static.fill_(-1.0)

    def graph_args(self, args):
        return [self.static, *args[1:]]

    def locate_writes(self, graph_args):
        self.located.append(graph_args)
        return self.clashes

    def copy_in(self, step) -> None:
        LOG.append(("copy_in", step))
        self.static.copy_(step.args[0])

    def nbytes(self) -> int:
        return 123


def _signature(outputs=((S0,), None, None), specialized: dict | None = None) -> GraphSignature:
    roles = [Role.BATCH, Role.STATIC, Role.SCALAR, Role.KV_CACHE]
    inputs = tuple(InputSpec(i, f"in{i}", role, None) for i, role in enumerate(roles))
    kinds = {sym: SymbolKind.SPECIALIZED for sym in (specialized or {})}
    return GraphSignature(inputs, S0, S0, {}, kinds, outputs)


def _gm(fail: list | None = None) -> fx.GraphModule:
    """out = x * 2; counter += 1 (a plain op's write); returns (out, the seq_lens host list, the scalar)."""
    graph = fx.Graph()
    x, counter, scalar, cache = (graph.placeholder(n) for n in ("x", "counter", "scalar", "cache"))
    lens = graph.placeholder("seq_lens_host")
    lens.meta[HOST_META_KEY] = SEQ_LENS
    graph.call_method("add_", (counter, 1))
    if fail is not None:
        graph.call_function(_maybe_fail, (fail,))
    out = graph.call_function(torch.mul, (x, 2))
    graph.output((out, lens, scalar))
    return fx.GraphModule(torch.nn.Module(), graph)


def _maybe_fail(flag: list) -> None:
    if flag:
        raise RuntimeError("the capture failed half-way")


def _entry_of(gm=None, signature=None, specialization=(), **staging) -> GraphEntry:
    signature = signature or _signature()
    return GraphEntry(GraphKey(4, True), specialization, gm or _gm(), Staging(signature, **staging))


def _args():
    return [torch.arange(4.0), torch.tensor([5.0]), torch.tensor(3), torch.zeros(2, 2)]


def _capture(entry, args=None, runtime=None, seq_len=None, restore=(1,), checked=(1, 3), identified=(3,)):
    runtime = runtime or Plain(warms_up=True)
    args = args or _args()
    entry.capture(runtime, args, lambda n: None, seq_len, restore, UpdateSchedule(), WorkspaceLifetime(), checked,
                  identified)
    return runtime, args


@pytest.fixture(autouse=True)
def _log():
    LOG.clear()
    yield
    LOG.clear()


def test_a_new_entry_holds_no_graph():
    entry = _entry_of()
    assert entry.sources == [SEQ_LENS] and entry.graph is None and entry.outputs is None
    assert isinstance(entry.table, UpdateTable) and entry.table.entries == {}
    assert (entry.eager_reason, entry.verified, entry.replays, entry.captured_inputs, entry.step_guard) == (
        None, None, 0, None, None)
    assert entry.packed is False and entry.capture_seconds == 0.0 and entry.memory()["outputs_bytes"] == 0


def test_the_name_is_the_key_with_the_sizes_kept_as_seen():
    assert _entry_of().name == "b4.decode"
    assert _entry_of(specialization=(("s1", 3), ("s2", 8))).name == "b4.decode[s1=3][s2=8]"


def test_specialization_of_a_step_is_its_specialized_symbols_values():
    s1, s2 = sympy.Symbol("s1"), sympy.Symbol("s2")
    signature = _signature(specialized={s2: None, s1: None})
    assert specialization_of(signature, {S0: 4, s1: 3, s2: 8}) == (("s1", 3), ("s2", 8))
    assert specialization_of(_signature(), {S0: 4}) == ()


def test_a_capture_with_padding_lengths_keeps_the_graph_and_puts_back_the_plain_ops_writes():
    entry = _entry_of()
    runtime, args = _capture(entry)
    assert LOG[:2] == [("fill_padding",), ("warmup", "b4.decode")] and runtime.graphs[0].label == "b4.decode"
    assert entry.graph is runtime.graphs[0] and entry.eager_reason is None
    out, lens, scalar = entry.outputs
    assert out == ("alias", out[1]) and torch.equal(out[1], torch.full((4,), -2.0))  # from the padded static buffer
    assert lens == [1, 1, 1, 1] and scalar == ("alias", args[2]) and scalar[1] is args[2]  # padding lengths; a list as it is
    assert args[1].tolist() == [5.0]  # the counter, written twice (warm-up, capture), put back
    assert entry.staging.located == [[entry.staging.static, *args[1:]]]
    inputs = entry.captured_inputs
    assert set(inputs.addresses) == {1, 3} and inputs.scalars == {2: 3} and inputs.objects == {3: args[3]}
    assert 0 < entry.capture_seconds < 5


def test_a_capture_gives_its_kernels_the_kv_length_asked():
    entry = _entry_of()
    _capture(entry, seq_len=7)
    assert entry.outputs[1] == [7, 7, 7, 7]


def test_a_packed_graph_is_captured_with_its_padding_packed():
    packed, plain = _entry_of(geometry=Geometry(8, 2)), _entry_of(geometry=Geometry(8, 2))
    packed.packed = True
    _capture(packed)
    _capture(plain)
    assert packed.outputs[1] == [8] and plain.outputs[1] == [1, 7]


def test_a_capture_step_the_target_refuses_serves_no_step():
    entry = _entry_of()
    seen = []

    def guard(host, graph_args):
        seen.append((host, graph_args))
        return "lengths past the kernel's limit"
    entry.step_guard = guard
    runtime, args = _capture(entry)
    assert entry.eager_reason == "b4.decode: not captured, its capture step is refused (lengths past the kernel's limit)"
    assert entry.graph is None and runtime.graphs == [] and args[1].tolist() == [5.0]
    assert seen == [({SEQ_LENS: [1, 1, 1, 1]}, [entry.staging.static, *args[1:]])]
    entry = _entry_of()
    entry.step_guard = lambda host, graph_args: None
    _capture(entry)
    assert entry.graph is not None and entry.eager_reason is None
    entry.step_guard = lambda host, graph_args: ""  # no reason: no refusal
    _capture(entry)
    assert entry.eager_reason is None


def test_a_capture_that_raises_half_way_puts_back_the_plain_ops_writes():
    fail = [True]
    entry = _entry_of(gm=_gm(fail))
    args = _args()
    with pytest.raises(RuntimeError, match="the capture failed half-way"):
        _capture(entry, args=args)
    assert args[1].tolist() == [5.0] and entry.graph is None


def test_only_the_inputs_asked_are_put_back():
    entry = _entry_of()
    _, args = _capture(entry, restore=(), runtime=Plain(warms_up=False))
    assert args[1].tolist() == [6.0]


def test_writes_that_clash_in_the_padded_graph_make_it_serve_eagerly():
    entry = _entry_of(clashes=[1, 3])
    _capture(entry)
    assert entry.eager_reason == "b4.decode: inputs [1, 3] are written twice at overlapping places in the padded graph"


def test_a_new_capture_forgets_the_views_of_the_old_outputs():
    entry = _entry_of()
    _capture(entry)
    first = entry.output_views({S0: 3}, ())
    _capture(entry)
    second = entry.output_views({S0: 3}, ())
    assert second[0] is not first[0]


def test_outputs_are_narrowed_to_the_steps_sizes_once_per_step_shape():
    entry = _entry_of()
    entry.outputs = [torch.arange(4.0), [1, 2], 7]
    views = entry.output_views({S0: 3}, ())
    assert views[0].tolist() == [0.0, 1.0, 2.0] and views[1:] == [[1, 2], 7]
    assert entry.output_views({S0: 3}, ()) is views
    assert entry.output_views({S0: 2}, ())[0].tolist() == [0.0, 1.0]
    assert entry.output_views({S0: 1}, (0,))[0].tolist() == [0.0, 1.0, 2.0, 3.0]  # skipped: left whole


def test_the_memory_of_its_static_inputs_and_outputs():
    entry = _entry_of()
    entry.outputs = [torch.zeros(3), [1], torch.zeros(2, dtype=torch.float64)]
    assert entry.memory() == {"static_inputs_bytes": 123, "outputs_bytes": 12 + 16}


class Updates(UpdateSchedule):
    def __init__(self) -> None:
        self.given = []

    def apply(self, table, runtime, host):
        self.given.append((table, runtime))
        LOG.append(("apply", dict(host)))
        return 5


class Failing(Plain):
    def __init__(self, fail_in: str) -> None:
        super().__init__()
        self.fail_in = fail_in

    def synchronize(self) -> None:
        LOG.append(("synchronize",))
        if self.fail_in == "after_replay":
            raise RuntimeError("the device failed")

    def replay_failed(self) -> None:
        LOG.append(("replay_failed",))


def _plan(entry) -> StepPlan:
    step = Step([torch.full((4,), 2.0)], {S0: 4}, 4, 4, True, {"seq_lens": [3, 4]}, {})
    return entry.plan(step)


def test_a_replay_copies_in_launches_updates_and_ends_with_the_runtimes_after_replay():
    entry = _entry_of()
    runtime = Plain()
    _capture(entry, runtime=runtime)
    entry.table.add(_entry("pa_0", (SEQ_LENS,), 1))
    plan = _plan(entry)
    assert plan.host == {SEQ_LENS: [3, 4, 1, 1]}
    LOG.clear()
    seconds = PhaseSeconds()
    updates = Updates()
    assert entry.replay(runtime, plan, updates, seconds) == 5
    assert len(updates.given) == 1 and updates.given[0][0] is entry.table and updates.given[0][1] is runtime
    assert LOG == [("copy_in", plan.step), ("replay", "b4.decode"), ("apply", {SEQ_LENS: [3, 4, 1, 1]}),
                   ("synchronize",)]
    assert set(seconds) == {"copy_in", "launch_and_updates", "synchronize"} and 0 < seconds.device < 5
    assert torch.equal(entry.staging.static, torch.full((4,), 2.0))


def test_a_replay_without_update_entries_issues_none():
    entry = _entry_of()
    runtime = Plain()
    _capture(entry, runtime=runtime)
    LOG.clear()
    assert entry.replay(runtime, _plan(entry), Updates(), PhaseSeconds()) == 0
    assert [e[0] for e in LOG] == ["copy_in", "replay", "synchronize"]


@pytest.mark.parametrize("fail_in", ["after_replay", "apply"])
def test_a_replay_that_raises_drops_the_graph(fail_in):
    entry = _entry_of()
    runtime = Failing(fail_in)
    _capture(entry, runtime=runtime)
    entry.table.add(_entry("pa_0", (SEQ_LENS,), 1))
    entry.verified = {"ok": True}

    class Raising(UpdateSchedule):
        def apply(self, table, runtime, host):
            raise RuntimeError("the update failed")
    updates = Raising() if fail_in == "apply" else Updates()
    seconds = PhaseSeconds()
    with pytest.raises(RuntimeError):
        entry.replay(runtime, _plan(entry), updates, seconds)
    assert entry.graph is None and entry.verified is None and LOG[-1] == ("replay_failed",)
    assert not seconds


def test_a_step_whose_shapes_the_copy_in_refuses_leaves_the_graph():
    entry = _entry_of()
    runtime = Failing("none")
    _capture(entry, runtime=runtime)

    def refuse(step):
        raise ValueError("shape")
    entry.staging.copy_in = refuse
    with pytest.raises(ValueError):
        entry.replay(runtime, _plan(entry), Updates(), PhaseSeconds())
    assert entry.graph is not None and ("replay_failed",) not in LOG


def test_a_run_op_by_op_copies_in_and_runs_the_graph_with_the_steps_host_lists():
    entry = _entry_of()
    plan = _plan(entry)
    args = [torch.zeros(4), torch.tensor([1.0]), torch.tensor(9), torch.zeros(1)]
    plan = StepPlan(Step(args, {}, 4, 4, True, {}, {}), plan.host)
    out, lens, scalar = entry.run_eager(plan, lambda n: None)
    assert lens == [3, 4, 1, 1] and int(scalar) == 9 and args[1].tolist() == [2.0]
    assert LOG == [("copy_in", plan.step)]


def test_a_run_op_by_op_gives_workspace_nodes_the_artifacts_slot():
    graph = fx.Graph()
    for n in ("x", "counter", "scalar", "cache"):
        graph.placeholder(n)
    ws = graph.call_function(torch.ops.ascend.workspace.default, (64, torch.device("cpu")))
    graph.output((ws,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    entry = _entry_of(gm=gm)
    slot = torch.ones(3)
    step = Step(_args(), {}, 4, 4, True, {}, {})
    (got,) = entry.run_eager(StepPlan(step, {}), lambda n: slot)
    assert got is slot


def test_moved_inputs_is_an_exception():
    assert issubclass(MovedInputs, Exception) and ge.time is time


def test_a_capture_uses_the_artifacts_workspaces_the_schedule_and_the_lifetime_given():
    gm = _pa_graph()
    next(n for n in gm.graph.nodes if n.name == "seq_lens_host").meta[HOST_META_KEY] = SEQ_LENS
    roles = [Role.BATCH, Role.KV_CACHE, Role.KV_CACHE, Role.STATIC]
    signature = GraphSignature(tuple(InputSpec(i, f"in{i}", r, None) for i, r in enumerate(roles)), S0, S0, {}, {},
                               ((S0,),))
    entry = GraphEntry(GraphKey(4, True), (), gm, Staging(signature))
    slot = torch.zeros(64, dtype=torch.uint8)
    given = []

    class Schedule(UpdateSchedule):
        def guard(self, runtime, name):
            given.append(("guard", name))
            return super().guard(runtime, name)

    class Lifetime(WorkspaceLifetime):
        def during_capture(self, runtime, slot_, allocate):
            given.append(("lifetime", slot_ is slot))
            return slot_

    def workspaces(node):
        given.append(("workspace", node.target))
        return slot
    runtime = Tasks({PA: fake_pa})
    entry.capture(runtime, [torch.zeros(4), torch.zeros(1), torch.zeros(1), torch.zeros(1)], workspaces, 5, (),
                  Schedule(), Lifetime(), (), ())
    assert given == [("workspace", torch.ops.ascend.workspace.default), ("workspace", torch.ops.ascend.workspace.default),
                     ("lifetime", True), ("guard", "pa_0")]  # the warm-up's environment, then the capture's
    assert entry.table.entries["pa_0"].frozen == {"context_lens": [5, 5, 5, 5]}
