"""`lowering/capture.py` at the level of its classes, on a recording stand-in runtime: how a kernel with
host lengths is captured (event wait and reset, a task group, an update entry holding the frozen host
lengths), how the update table re-issues the entries with a step's lengths (only the changed ones where
task updates persist, every event recorded), which errors inside a capture mean an op that cannot be
captured, and the inner-compiled path. Fast: no model is compiled (tests/test_design_cases.py and
tests/test_sim.py check the same end to end on the simulator)."""
from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import fx

import ascend_compile.ops  # noqa: F401  (registers torch.ops.ascend)
from ascend_compile.errors import CaptureError, HostSync, UncapturableOp
from ascend_compile.lowering import capture as cap
from ascend_compile.lowering.capture import (CaptureInterpreter, UpdateEntry, UpdateSchedule, UpdateTable,
                                             WarmupInterpreter, WorkspaceLifetime, capture_graph, run_bound,
                                             workspace_env)
from ascend_compile.ops import tiling
from ascend_compile.passes.inner_compile import INNER_KEY
from ascend_compile.passes.kernel_call import META_KEY, Conversion, HostArg, HostSource, KernelMeta
from ascend_compile.runtime.base import DeviceGraph, ExternalEvent, GraphRuntime, TaskHandle, TaskUpdateRuntime

PA = torch.ops.ascend.paged_attention.default
PA_DEV = torch.ops.ascend.paged_attention_dev.default
SEQ_LENS = HostSource("seq_lens", Conversion.LIST)
QSL = HostSource("query_start_loc", Conversion.ENDS)
LOG: list[tuple] = []


class Event(ExternalEvent):
    def __init__(self, name: str) -> None:
        self.name = name

    def wait(self) -> None:
        LOG.append(("wait", self.name))

    def reset(self) -> None:
        LOG.append(("reset", self.name))

    def record(self) -> None:
        LOG.append(("record", self.name))


class Graph(DeviceGraph):
    def __init__(self, label: str, warms_up: bool) -> None:
        self.label = label
        self.warms_up = warms_up
        self.capturing = False

    @contextlib.contextmanager
    def capture(self):
        LOG.append(("capture", self.label))
        self.capturing = True
        yield
        self.capturing = False
        LOG.append(("captured", self.label))

    def replay(self) -> None:
        LOG.append(("replay", self.label))

    def warmup(self, run) -> None:
        LOG.append(("warmup", self.label))
        if self.warms_up:
            run()


class Plain(GraphRuntime):
    """A graph runtime without task updates (CUDA's kind); `bound`: op -> its binding."""

    name = "plain"

    def __init__(self, bound: dict | None = None, warms_up: bool = False) -> None:
        self.bound = bound or {}
        self.warms_up = warms_up
        self.graphs: list[Graph] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        LOG.append(("synchronize",))

    def kernel(self, op: Any):
        return self.bound.get(op, op)

    def weak_alias(self, tensor):
        return ("alias", tensor)

    def graph(self, label: str = "") -> Graph:
        self.graphs.append(Graph(label, self.warms_up))
        return self.graphs[-1]


class Tasks(Plain, TaskUpdateRuntime):
    """A task-update runtime recording its calls in `LOG`."""

    name = "tasks"

    def __init__(self, bound: dict | None = None, warms_up: bool = False, persist: bool = True) -> None:
        super().__init__(bound, warms_up)
        self.task_updates_persist = persist
        self.handles = 0

    def event(self, name: str) -> Event:
        LOG.append(("event", name))
        return Event(name)

    def task_group_begin(self) -> None:
        LOG.append(("group",))

    def task_group_end(self) -> TaskHandle:
        self.handles += 1
        handle = TaskHandle()
        handle.n = self.handles
        LOG.append(("end", self.handles))
        return handle

    def task_update_begin(self, handle) -> None:
        LOG.append(("update", handle.n))

    def task_update_end(self) -> None:
        LOG.append(("updated",))


@pytest.fixture(autouse=True)
def _log():
    LOG.clear()
    yield
    LOG.clear()


def fake_pa(*args):
    """What the stand-in runtime runs for PA: records its host lengths, returns the query plus one."""
    LOG.append(("pa", list(args[4])))
    return args[0] + 1


def _pa_graph(kernels: int = 1, host: bool = True, workspace: bool = True) -> fx.GraphModule:
    """A graph of `kernels` PA calls (host lengths from a host-list placeholder, else device lengths)
    chained on the query, with a workspace node each."""
    graph = fx.Graph()
    q, k, v, bt = (graph.placeholder(n) for n in ("q", "k", "v", "bt"))
    lens = graph.placeholder("seq_lens_host")
    x = q
    for i in range(kernels):
        ws = graph.call_function(torch.ops.ascend.workspace.default, (64, torch.device("cpu"))) if workspace else None
        op = PA if host else PA_DEV
        args = (x, k, v, bt, lens, 1.0, ws, None) + (() if host else (1,))
        x = graph.call_function(op, args)
        x.name = f"pa_{i}"
        host_args = (HostArg("context_lens", SEQ_LENS),) if host else ()
        x.meta[META_KEY] = KernelMeta(tiling.PA, f"attn_{i}", None, host_args, "host" if host else "device")
    graph.output((x,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _args() -> list[Any]:
    return [torch.zeros(2), torch.zeros(1), torch.zeros(1), torch.zeros(1), [3, 5]]


SLOT = torch.zeros(64, dtype=torch.uint8)


def workspaces(node: fx.Node) -> torch.Tensor:
    return SLOT


# --- capture --------------------------------------------------------------------------------------

def test_a_host_length_kernel_is_captured_in_a_task_group_behind_an_event_with_its_update_entry():
    runtime = Tasks({PA: fake_pa})
    gm = _pa_graph(kernels=2)
    graph, outputs, table = capture_graph(gm, runtime, _args(), workspaces, UpdateSchedule(), WorkspaceLifetime(), "b4")
    assert graph is runtime.graphs[0] and graph.label == "b4"
    assert torch.equal(outputs[0], torch.full((2,), 2.0))
    assert LOG == [("warmup", "b4"), ("capture", "b4"),
                   ("event", "pa_0"), ("wait", "pa_0"), ("reset", "pa_0"), ("group",), ("pa", [3, 5]), ("end", 1),
                   ("event", "pa_1"), ("wait", "pa_1"), ("reset", "pa_1"), ("group",), ("pa", [3, 5]), ("end", 2),
                   ("captured", "b4")]
    assert list(table.entries) == ["pa_0", "pa_1"] and table.sources == {SEQ_LENS}
    entry = table.entries["pa_0"]
    assert (entry.node, entry.kernel, entry.handle.n, entry.event.name, entry.op, entry.impl) == (
        "pa_0", tiling.PA, 1, "pa_0", PA, fake_pa)
    assert entry.frozen == {"context_lens": [3, 5]} and entry.host_args == (HostArg("context_lens", SEQ_LENS),)
    assert entry.args[0][0] == "alias" and entry.args[1][0] == "alias"  # tensors held as aliases
    assert entry.args[4] == [3, 5] and entry.args[5] == 1.0 and entry.args[6][1] is SLOT
    assert entry.positions == [(4, SEQ_LENS)] and entry.sources == frozenset({SEQ_LENS})


def test_the_warm_up_runs_the_graph_with_the_runtimes_bindings_and_the_artifacts_slots():
    seen = []

    def pa(*args):
        seen.append(args[6])
        return fake_pa(*args)
    runtime = Tasks({PA: pa}, warms_up=True)
    capture_graph(_pa_graph(), runtime, _args(), workspaces, UpdateSchedule(), WorkspaceLifetime(), "b4")
    assert LOG[:3] == [("warmup", "b4"), ("pa", [3, 5]), ("capture", "b4")]
    assert seen[0] is SLOT and seen[1] is SLOT  # warm-up and capture alike


def test_a_kernel_without_host_lengths_is_captured_as_its_binding_alone():
    calls = []
    runtime = Tasks({PA_DEV: lambda *a: calls.append(a) or a[0] + 2})
    _, outputs, table = capture_graph(_pa_graph(host=False), runtime, _args(), workspaces, UpdateSchedule(),
                                      WorkspaceLifetime())
    assert torch.equal(outputs[0], torch.full((2,), 2.0)) and len(calls) == 1 and table.entries == {}
    assert ("group",) not in LOG and not any(e[0] == "event" for e in LOG)


def test_a_host_length_kernel_is_refused_on_a_runtime_without_task_updates():
    with pytest.raises(CaptureError) as raised:
        capture_graph(_pa_graph(), Plain({PA: fake_pa}), _args(), workspaces, UpdateSchedule(), WorkspaceLifetime())
    assert str(raised.value).splitlines()[0] == (
        "pa_0: ascend.paged_attention.default takes host-side lengths, which a graph on runtime 'plain' (no task "
        "updates) would freeze at their capture values; rewrite the graph with passes.device_lengths.use_device_lengths "
        "so the kernel reads them on the device")


def test_kernel_nodes_take_positional_arguments_only():
    gm = _pa_graph()
    node = next(n for n in gm.graph.nodes if n.name == "pa_0")
    node.kwargs = {"out": None}
    node.args = node.args[:-1]
    with pytest.raises(ValueError, match="^pa_0: kernel nodes take positional arguments only"):
        capture_graph(gm, Tasks({PA: fake_pa}), _args(), workspaces, UpdateSchedule(), WorkspaceLifetime())


def test_a_schedule_without_events_gives_entries_no_event():
    class NoEvents(UpdateSchedule):
        def guard(self, runtime, name):
            return None
    _, _, table = capture_graph(_pa_graph(), Tasks({PA: fake_pa}), _args(), workspaces, NoEvents(), WorkspaceLifetime())
    assert table.entries["pa_0"].event is None and table.describe()[0]["event"] is False


def test_a_workspace_is_what_the_lifetime_gives_during_the_capture():
    given = torch.ones(64, dtype=torch.uint8)
    seen = []

    class Fresh(WorkspaceLifetime):
        def during_capture(self, runtime, slot, allocate):
            seen.append((runtime, slot, allocate()))
            return given

    def pa(*args):
        LOG.append(("ws", args[6] is given))
        return args[0]
    runtime = Tasks({PA: pa})
    capture_graph(_pa_graph(), runtime, _args(), workspaces, UpdateSchedule(), Fresh())
    assert ("ws", True) in LOG and seen[0][0] is runtime and seen[0][1] is SLOT
    assert seen[0][2].shape == (64,) and seen[0][2].dtype == torch.uint8  # the node's own allocation
    assert WorkspaceLifetime().during_capture(runtime, SLOT, lambda: pytest.fail("allocated")) is SLOT


def test_workspace_env_gives_each_workspace_node_its_slot():
    gm = _pa_graph(kernels=2)
    env = workspace_env(gm, lambda n: n.name)
    names = [n.name for n in gm.graph.nodes if n.target is torch.ops.ascend.workspace.default]
    assert len(names) == 2 and sorted(env.values()) == names and all(n.name == v for n, v in env.items())
    assert workspace_env(_pa_graph(workspace=False), workspaces) == {}


def test_run_bound_runs_the_runtimes_binding_or_the_node():
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    z = graph.call_method("neg", (y,))
    graph.output(z)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    bound = Plain({torch.ops.aten.relu.default: lambda t: t + 10})
    assert WarmupInterpreter(gm, bound).run(torch.tensor([-1.0])).tolist() == [-9.0]
    assert WarmupInterpreter(gm, Plain()).run(torch.tensor([-1.0])).tolist() == [-0.0]
    interp = fx.Interpreter(gm)
    interp.env[x] = torch.tensor([2.0])
    assert run_bound(interp, bound, y).tolist() == [12.0]
    interp.env[y] = torch.tensor([3.0])
    assert run_bound(interp, Plain({"neg": lambda t: t}), z).tolist() == [-3.0]  # a method: the node itself


# --- which errors inside a capture mean an op that cannot be captured ------------------------------

def _op_graph(target, method: bool = False) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_method(target, (x,)) if method else graph.call_function(target, (x,))
    y.name = "the_op"
    graph.output(y)
    return fx.GraphModule(torch.nn.Module(), graph)


def raiser(err):
    def op(*args):
        raise err
    return op


def _capture(gm, runtime, warmed_up: bool = False):
    table = UpdateTable()
    return CaptureInterpreter(gm, runtime, table, workspaces, UpdateSchedule(), WorkspaceLifetime(), warmed_up).run(
        torch.zeros(2))


def test_a_host_read_refused_in_an_unbound_op_is_an_uncapturable_op():
    err = HostSync("read on the host")
    with pytest.raises(UncapturableOp) as raised:
        _capture(_op_graph(raiser(err)), Tasks())
    assert raised.value.node == "the_op" and raised.value.cause is err and raised.value.__cause__ is err


def test_after_a_warm_up_any_device_error_of_an_unbound_op_is_an_uncapturable_op():
    err = RuntimeError("NPU function error: x, error code is 507000")
    with pytest.raises(UncapturableOp):
        _capture(_op_graph(raiser(err)), Tasks(), warmed_up=True)
    with pytest.raises(RuntimeError) as raised:  # without a warm-up: the error as it is
        _capture(_op_graph(raiser(err)), Tasks())
    assert raised.value is err


def test_errors_that_are_not_the_ops_doing_pass_through():
    # one of ours, after a warm-up
    ours = CaptureError("ours")
    with pytest.raises(CaptureError) as raised:
        _capture(_op_graph(raiser(ours)), Tasks(), warmed_up=True)
    assert raised.value is ours
    # the device out of memory or streams
    for text in ("NPU out of memory", "NPU function error: x, error code is 207008"):
        err = RuntimeError(text)
        with pytest.raises(RuntimeError) as raised:
            _capture(_op_graph(raiser(err)), Tasks(), warmed_up=True)
        assert raised.value is err
    # an op the runtime binds to a device kernel
    op = torch.ops.aten.relu.default
    err = HostSync("read")
    with pytest.raises(HostSync):
        _capture(_op_graph(op), Tasks({op: raiser(err)}), warmed_up=True)


def test_the_uncapturable_rule_by_node_kind():
    runtime = Tasks()
    interp = CaptureInterpreter(_op_graph(torch.relu), runtime, UpdateTable(), workspaces, UpdateSchedule(),
                                WorkspaceLifetime(), warmed_up=True)
    graph = fx.Graph()
    x = graph.placeholder("x")
    method = graph.call_method("item", (x,))
    module = graph.call_module("lin", (x,))
    plain = graph.call_function(torch.relu, (x,))
    assert not interp._uncapturable(x, HostSync("read"))
    assert not interp._uncapturable(module, HostSync("read"))
    assert interp._uncapturable(method, HostSync("read"))  # a method is never bound: its host read is the op's
    assert interp._uncapturable(method, RuntimeError("any"))  # after a warm-up
    assert interp._uncapturable(plain, RuntimeError("any"))
    assert not interp._uncapturable(plain, CaptureError("ours"))
    assert not interp._uncapturable(method, RuntimeError("CUDA out of memory"))
    cold = CaptureInterpreter(_op_graph(torch.relu), runtime, UpdateTable(), workspaces, UpdateSchedule(),
                              WorkspaceLifetime())
    assert cold.warmed_up is False
    assert not cold._uncapturable(plain, RuntimeError("any")) and cold._uncapturable(plain, HostSync("read"))
    bound = CaptureInterpreter(_op_graph(torch.relu), Tasks({torch.relu: abs}), UpdateTable(), workspaces,
                               UpdateSchedule(), WorkspaceLifetime(), warmed_up=True)
    assert not bound._uncapturable(plain, HostSync("read")) and bound._uncapturable(method, HostSync("read"))


# --- the update table -------------------------------------------------------------------------------

def _entry(node: str, sources: tuple[HostSource, ...], handle_n: int, event: bool = True) -> UpdateEntry:
    """A FIA-like entry whose host args come from `sources` (PA's op: context_lens, scale's slot)."""
    handle = TaskHandle()
    handle.n = handle_n
    op = PA
    names = {SEQ_LENS: "context_lens", QSL: "scale"}
    host_args = tuple(HostArg(names[s], s) for s in sources)
    return UpdateEntry(node, tiling.PA, handle, Event(node) if event else None, op,
                       lambda *a: LOG.append(("issue", node, a[4], a[5])), ["q", "k", "v", "bt", [0], 0.5, "ws", None],
                       {h.kernel_arg: [0] for h in host_args}, host_args)


def test_an_entry_takes_the_steps_host_lists_in_place_of_the_frozen_ones():
    entry = _entry("pa_0", (SEQ_LENS, QSL), 1)
    assert entry.positions == [(4, SEQ_LENS), (5, QSL)] and entry.sources == {SEQ_LENS, QSL}
    assert entry.arguments({SEQ_LENS: [7, 8], QSL: [1, 2]}) == ["q", "k", "v", "bt", [7, 8], [1, 2], "ws", None]
    assert entry.args[4] == [0]  # the captured arguments stay
    assert entry.describe() == {
        "node": "pa_0", "kernel": tiling.PA, "event": True, "frozen_at_capture": {"context_lens": [0], "scale": [0]},
        "refresh": {"context_lens": {"input": "seq_lens", "conversion": "list"},
                    "scale": {"input": "query_start_loc", "conversion": "ends"}}}


def test_a_table_refuses_a_node_twice_and_gathers_its_entries_sources():
    table = UpdateTable()
    table.add(_entry("a", (SEQ_LENS,), 1))
    table.add(_entry("b", (QSL,), 2))
    assert table.sources == {SEQ_LENS, QSL} and list(table.entries) == ["a", "b"]
    with pytest.raises(ValueError, match="^node: a captured twice in one graph$"):
        table.add(_entry("a", (), 3))
    assert [d["node"] for d in table.describe()] == ["a", "b"]


def _table() -> UpdateTable:
    table = UpdateTable()
    table.add(_entry("a", (SEQ_LENS,), 1))
    table.add(_entry("b", (QSL,), 2))
    table.add(_entry("c", (SEQ_LENS, QSL), 3, event=False))
    return table


def test_the_first_apply_issues_every_entry_and_records_every_event():
    table = _table()
    host = {SEQ_LENS: [3, 5], QSL: [1, 2]}
    assert UpdateSchedule().apply(table, Tasks(), host) == 3
    assert LOG == [("update", 1), ("issue", "a", [3, 5], 0.5), ("updated",), ("record", "a"),
                   ("update", 2), ("issue", "b", [0], [1, 2]), ("updated",), ("record", "b"),
                   ("update", 3), ("issue", "c", [3, 5], [1, 2]), ("updated",)]
    assert table.issued == host and table.issued[SEQ_LENS] is not host[SEQ_LENS]  # a copy


def test_where_updates_persist_only_the_entries_whose_lists_changed_are_issued():
    table = _table()
    runtime = Tasks()
    table.apply(runtime, {SEQ_LENS: [3, 5], QSL: [1, 2]})
    LOG.clear()
    host = {SEQ_LENS: [3, 6], QSL: [1, 2]}
    assert table.apply(runtime, host) == 2
    assert [e for e in LOG if e[0] == "issue"] == [("issue", "a", [3, 6], 0.5), ("issue", "c", [3, 6], [1, 2])]
    assert [e for e in LOG if e[0] == "record"] == [("record", "a"), ("record", "b")]  # recorded either way
    LOG.clear()
    host[SEQ_LENS].append(9)  # the caller's list changed in place after the apply: the table kept a copy
    assert table.apply(runtime, {SEQ_LENS: [3, 6], QSL: [1, 2]}) == 0
    assert LOG == [("record", "a"), ("record", "b")]


def test_where_updates_do_not_persist_every_entry_is_issued_every_time():
    table = _table()
    runtime = Tasks(persist=False)
    host = {SEQ_LENS: [3, 5], QSL: [1, 2]}
    assert table.apply(runtime, host) == 3
    assert table.apply(runtime, host) == 3


def test_an_empty_table_issues_nothing():
    table = UpdateTable()
    assert table.apply(Tasks(), {}) == 0 and table.issued == {} and LOG == []


def test_apply_reads_only_its_own_sources():
    table = UpdateTable()
    table.add(_entry("a", (SEQ_LENS,), 1))
    assert table.apply(Tasks(), {SEQ_LENS: [1]}) == 1  # no query_start_loc list needed
    assert table.issued == {SEQ_LENS: [1]}


# --- an inner compiler's graph -----------------------------------------------------------------------

class Inner:
    compiler = "inductor"

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, args, workspaces):
        self.calls.append((args, workspaces))
        LOG.append(("inner",))
        return (torch.ones(1),)


def test_an_inner_compiled_graph_is_warmed_up_and_captured_as_its_compiled_code():
    gm = _pa_graph()
    inner = gm.meta[INNER_KEY] = Inner()
    runtime = Plain(warms_up=True)
    args = _args()
    graph, outputs, table = capture_graph(gm, runtime, args, workspaces, UpdateSchedule(), WorkspaceLifetime(), "b8")
    assert LOG == [("warmup", "b8"), ("inner",), ("capture", "b8"), ("inner",), ("captured", "b8")]
    assert inner.calls[1] == (args, workspaces) and outputs[0].tolist() == [1.0] and table.entries == {}
    assert graph is runtime.graphs[0]


def test_an_inner_compiled_graph_is_refused_on_a_task_update_runtime():
    gm = _pa_graph()
    gm.meta[INNER_KEY] = Inner()
    with pytest.raises(CaptureError, match="^inner_compiler 'inductor': its compiled graphs hold no task groups, "
                                           "which runtime 'tasks' needs for its updates$"):
        capture_graph(gm, Tasks(), _args(), workspaces, UpdateSchedule(), WorkspaceLifetime())
    assert LOG == []


def test_the_schedule_guard_makes_the_event_waits_and_resets_it():
    event = UpdateSchedule().guard(Tasks(), "pa_3")
    assert event.name == "pa_3" and LOG == [("event", "pa_3"), ("wait", "pa_3"), ("reset", "pa_3")]
    assert cap.WorkspaceFor is not None


def test_each_workspace_node_gets_its_own_slot():
    slots = {}

    def per_node(node: fx.Node) -> torch.Tensor:
        return slots.setdefault(node.name, torch.zeros(64, dtype=torch.uint8))
    seen = []

    def pa(*args):
        seen.append(args[6])
        return args[0]
    gm = _pa_graph(kernels=2)
    capture_graph(gm, Tasks({PA: pa}, warms_up=True), _args(), per_node, UpdateSchedule(), WorkspaceLifetime())
    first, second = (n.args[6].name for n in gm.graph.nodes if n.target is PA)
    assert [s is slots[first] for s in seen] == [True, False, True, False]  # warm-up, then capture
    assert [s is slots[second] for s in seen] == [False, True, False, True]


def test_an_uncapturable_op_names_its_node_and_op():
    op = raiser(HostSync("read"))
    with pytest.raises(UncapturableOp) as raised:
        _capture(_op_graph(op), Tasks())
    assert raised.value.node == "the_op" and raised.value.op is op


def test_a_bound_op_gets_the_nodes_keyword_arguments():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (x, x), {"alpha": 3}))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    seen = []
    runtime = Plain({torch.ops.aten.add.Tensor: lambda *a, **k: seen.append(k) or a[0]})
    WarmupInterpreter(gm, runtime).run(torch.ones(1))
    assert seen == [{"alpha": 3}]


def test_the_graphs_label_is_empty_unless_given():
    runtime = Tasks({PA: fake_pa})
    capture_graph(_pa_graph(), runtime, _args(), workspaces, UpdateSchedule(), WorkspaceLifetime())
    assert runtime.graphs[0].label == ""


def test_after_a_warm_up_an_op_failing_only_in_the_capture_is_uncapturable():
    """The capture knows the graph ran eagerly just before (the device graph's `warms_up`): then any
    error of an unbound op in the capture is the op's (on a device, a host sync refused)."""
    for warms_up, expected in ((True, UncapturableOp), (False, RuntimeError)):
        runtime = Tasks({PA: fake_pa}, warms_up=warms_up)

        def in_capture_only(x):
            if runtime.graphs[-1].capturing:
                raise RuntimeError("NPU function error: aclrtSynchronizeStream, error code is 107027")
            return x
        with pytest.raises(RuntimeError) as raised:
            capture_graph(_op_graph(in_capture_only), runtime, [torch.zeros(2)], workspaces, UpdateSchedule(),
                          WorkspaceLifetime())
        assert type(raised.value) is expected, warms_up


def test_an_inner_compiled_graph_is_warmed_up_with_the_capture_arguments():
    gm = _pa_graph()
    inner = gm.meta[INNER_KEY] = Inner()
    args = _args()
    capture_graph(gm, Plain(warms_up=True), args, workspaces, UpdateSchedule(), WorkspaceLifetime(), "b8")
    assert inner.calls[0] == (args, workspaces) and inner.calls[0][0] is args
