"""The small contracts of `lowering/`, by plain calls (no compile): a replay's phase seconds
(`phase_seconds.py`), a step's outputs cut and cloned (`outputs.py`), the probe the direct dispatcher
learns from (`served.py`), the start-up record and its INFO line (`startup.py`) and the graph budget's
count and fit (`budget.py`). mutmut's tests for these modules (the compile-level use of each is
`tests/test_graph_budget.py`'s, `tests/test_direct_dispatch.py`'s and the runner's tests')."""
from __future__ import annotations

import collections
import dataclasses
import logging
import sys
import threading
import types

import pytest
import sympy
import torch

from ascend_compile import ledger
from ascend_compile.lowering import budget as budget_mod
from ascend_compile.lowering import served, startup
from ascend_compile.lowering.budget import GraphBudget, fit, sample
from ascend_compile.lowering.outputs import narrowed_outputs, returned_outputs
from ascend_compile.lowering.phase_seconds import PhaseSeconds
from ascend_compile.passes.workspaces import GraphKey
from ascend_compile.runtime.sim import SimRuntime
from ascend_compile.config import CompileConfig

S, B = sympy.Symbol("s"), sympy.Symbol("b")


# --- phase_seconds.py ---------------------------------------------------------------------------------------

def test_a_replay_adds_each_phase_and_their_sum_to_device():
    phases = PhaseSeconds()
    phases.replayed(1.0, 1.5, 3.0, 6.0)
    assert dict(phases) == {"copy_in": 0.5, "launch_and_updates": 1.5, "synchronize": 3.0}
    assert phases.device == 5.0
    phases.replayed(10.0, 10.25, 10.5, 11.0)
    assert dict(phases) == {"copy_in": 0.75, "launch_and_updates": 1.75, "synchronize": 3.5}
    assert phases.device == 6.0 == phases.total()
    assert PhaseSeconds().device == 0.0  # each counter its own sum


# --- outputs.py ---------------------------------------------------------------------------------------------

def test_outputs_are_cut_to_the_steps_sizes_from_the_start_of_each_dimension():
    padded = torch.arange(32.0).reshape(8, 4)
    both = torch.arange(64.0).reshape(8, 8)
    out = narrowed_outputs([padded, both], [(S, 4), (S, B)], {S: 3, B: 5}, ())
    assert out[0].shape == (3, 4) and torch.equal(out[0], padded[:3])
    assert out[1].shape == (3, 5) and torch.equal(out[1], both[:3, :5])
    assert out[0].data_ptr() == padded.data_ptr()  # a view, not a copy


def test_outputs_skipped_of_no_shape_or_not_tensors_or_already_the_size_are_kept_as_they_are():
    a, b, c = torch.zeros(8, 2), torch.zeros(8, 2), torch.zeros(3, 2)
    out = narrowed_outputs([a, b, 7, c], [(S, 2), None, (S,), (S, 2)], {S: 3}, [0])
    assert out[0] is a and out[1] is b and out[2] == 7 and out[3] is c
    out = narrowed_outputs([a, b], [(S, 2), (S, 2)], {S: 3}, [1])
    assert out[0].shape == (3, 2) and out[1] is b


def test_returned_outputs_are_clones_unless_asked_not_and_aliased_ones_the_callers_views():
    out, other, caller = torch.ones(3), torch.zeros(2), torch.full((2,), 5.0)
    cloned = returned_outputs([out, other, "x"], True, {1: caller})
    assert isinstance(cloned, tuple) and len(cloned) == 3
    assert torch.equal(cloned[0], out) and cloned[0].data_ptr() != out.data_ptr()
    assert cloned[1] is caller and cloned[2] == "x"
    kept = returned_outputs([out, other], False, {})
    assert kept[0] is out and kept[1] is other
    assert returned_outputs([out], False, {0: caller})[0] is caller


# --- served.py ----------------------------------------------------------------------------------------------

def test_a_probe_sees_the_calls_reported_inside_it_in_order_and_nested_probes_each_see_every_call():
    served.report("before", (), None)  # no probe: nothing kept, nothing raised
    with served.probe() as outer:
        served.report("a", (1, 2), "ra")
        with served.probe() as inner:
            served.report("b", (3,), "rb")
        served.report("c", (), "rc")
    served.report("after", (), None)
    assert [s.artifact for s in outer] == ["a", "b", "c"] and [s.artifact for s in inner] == ["b"]
    assert outer[0] == served.Served("a", (1, 2), "ra") and inner[0] is outer[1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        outer[0].artifact = "z"


def test_a_probe_and_unreported_work_in_a_thread_that_never_had_either():
    seen = []

    def fresh(first):
        with served.probe() as calls:
            if first == "unreported":
                with served.unreported():
                    served.report("silent", (), None)
            served.report("heard", (), None)
        seen.append([s.artifact for s in calls])

    for first in ("probe", "unreported"):
        thread = threading.Thread(target=fresh, args=(first,))
        thread.start()
        thread.join()
    assert seen == [["heard"], ["heard"]]


def test_calls_inside_unreported_are_not_reported_and_the_block_ends_it_even_nested():
    with served.probe() as calls:
        with served.unreported():
            served.report("silent", (), None)
            with served.unreported():
                served.report("silent too", (), None)
            served.report("still silent", (), None)
        served.report("heard", (), None)
    assert [s.artifact for s in calls] == ["heard"]
    with pytest.raises(KeyError):
        with served.probe(), served.unreported():
            raise KeyError("x")
    with served.probe() as calls:  # an exception ends both blocks
        served.report("heard again", (), None)
    assert [s.artifact for s in calls] == ["heard again"]


def test_a_probe_is_the_threads_own():
    errors = []

    def elsewhere():  # a thread that never set a probe: its reports go nowhere, and raise nothing
        try:
            served.report("elsewhere", (), None)
        except Exception as error:  # noqa: BLE001 - the test's finding
            errors.append(error)

    with served.probe() as calls:
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        served.report("here", (), None)
    assert [s.artifact for s in calls] == ["here"] and errors == []


# --- startup.py ---------------------------------------------------------------------------------------------

def _budget(**kw):
    return GraphBudget(**{"full": 4, "pieces": 3, "sizes": [16, 32], "dropped": [], "budget": 20,
                          "source": "the graph_budget option", **kw})


class _Plan:
    def describe(self):
        return {"file": "plan.json", "reused": 2}


def test_a_new_startup_has_no_phases_budget_or_plan():
    s = startup.Startup()
    assert s.phases == collections.Counter() and s.budget is None and s.plan is None
    assert startup.Startup().phases is not s.phases


def test_compiled_records_the_phases_budget_and_plan_in_one_info_line(caplog):
    s, phases = startup.Startup(), collections.Counter(passes=1.234, dynamo_trace=0.5, other=9.0)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        s.compiled(phases, _budget(), _Plan())
    assert s.phases is phases and s.budget == _budget() and s.plan == {"file": "plan.json", "reused": 2}
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.name == "ascend_compile"
    assert record.getMessage() == ("ascend_compile: start-up: dynamo_trace 0.50 s, passes 1.23 s; 10 graphs to "
                                   "capture (4 full, 2 piecewise sizes x 3 pieces), a budget of 20")


def test_compiled_with_nothing_timed_no_budget_and_no_plan_says_so(caplog):
    s = startup.Startup()
    s.plan = {"stale": True}
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        s.compiled(collections.Counter(), _budget(budget=None, sizes=[]))
    assert s.plan is None
    assert caplog.records[0].getMessage() == ("ascend_compile: start-up: nothing timed; 4 graphs to capture "
                                              "(4 full, 0 piecewise sizes x 3 pieces), no budget known")


def _graph(name, seconds):
    return types.SimpleNamespace(name=name, capture_seconds=seconds)


def test_describe_gives_the_phases_in_ledger_order_each_capture_their_sum_the_budget_and_the_plan():
    s = startup.Startup()
    art = types.SimpleNamespace(graphs={1: _graph("b4.decode", 0.123456), 2: _graph("b8.decode", 0.0)},
                                piecewise={3: _graph("p16", 0.25)})
    assert s.describe(art) == {"seconds": {}, "captures": {"b4.decode": 0.1235, "p16": 0.25},
                               "capture_seconds": 0.3735}
    s.compiled(collections.Counter(passes=1.000049, dynamo_trace=0.5, other=2.0), _budget(dropped=[8]), _Plan())
    described = s.describe(art)
    assert list(described["seconds"].items()) == [("dynamo_trace", 0.5), ("passes", 1.0)]
    assert list(described["seconds"]) == [p for p in ledger.PHASES if p in ("passes", "dynamo_trace")]
    assert described["graph_budget"] == _budget(dropped=[8]).describe()
    assert described["plan"] == {"file": "plan.json", "reused": 2}
    assert described["capture_seconds"] == 0.3735
    art.graphs = {1: _graph("b4.decode", 0.00001), 2: _graph("b8.decode", 0.00004)}
    assert s.describe(art)["capture_seconds"] == 0.25  # each rounded, then the sum


def test_progress_is_a_tqdm_bar_named_what_where_tqdm_is_installed_else_the_items(monkeypatch):
    items = [1, 2, 3]
    bar = startup.progress(items, "capturing")
    assert type(bar).__module__.startswith("tqdm") and bar.desc == "capturing" and bar.unit == "graph"
    assert bar.mininterval == 1.0 and bar.delay == 1.0 and list(bar) == items
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: importing it raises ImportError
    assert startup.progress(items, "capturing") is items


# --- budget.py ----------------------------------------------------------------------------------------------

def test_a_budget_counts_full_graphs_and_pieces_per_size_kept_and_describes_them():
    b = GraphBudget(full=5, pieces=3, sizes=[8, 16], dropped=[4], budget=11, source="here")
    assert b.graphs == 11
    assert b.describe() == {"graphs": 11, "full_graphs": 5, "piecewise_sizes": 2, "graphs_per_piecewise_size": 3,
                            "budget": 11, "budget_source": "here", "dropped_piecewise_sizes": [4]}
    assert "dropped_piecewise_sizes" not in GraphBudget(5, 3, [8], [], None, "x").describe()


def test_the_sizes_kept_are_spread_evenly_the_largest_always_and_the_smallest_from_two_on():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    assert sample(sizes, 9) == sizes and sample(sizes, 8) == sizes and sample(sizes, 8) is not sizes
    assert sample(sizes, 1) == [128] and sample(sizes, 0) == [] and sample(sizes, -3) == []
    assert sample(sizes, 2) == [1, 128] and sample(sizes, 3) == [1, 16, 128] and sample(sizes, 4) == [1, 4, 32, 128]
    assert sample(sizes, 5) == [1, 4, 16, 32, 128] and sample(sizes, 7) == [1, 2, 4, 16, 32, 64, 128]
    assert sample([5], 1) == [5] and sample([], 0) == []


class _Variant:
    def __init__(self, attention):
        self.gm = attention


class _Rewritten:
    """What `fit` reads of `RewrittenGraphs`: the piecewise variant's keys, each full graph key's variant
    (its `gm` here the attention nodes it holds), where to turn piecewise off."""

    def __init__(self, sizes, full_keys, eager=()):
        self.piecewise = types.SimpleNamespace(keys=[GraphKey(s, False, True) for s in sizes]) if sizes else None
        self.piecewise_reason = None
        self.choices = {key: () for key in full_keys}
        self._eager = set(eager)

    def variant_for(self, key):
        return _Variant(["attention"] if key in self._eager else [])


@pytest.fixture
def pieces(monkeypatch):
    """`fit` with the piecewise variant splitting into `pieces[0]` pieces (`pieces_per_size`) and a full
    graph's attention nodes read from the stand-in."""
    count = [3]
    monkeypatch.setattr(budget_mod, "pieces_per_size", lambda rewritten: count[0] if rewritten.piecewise else 0)
    monkeypatch.setattr(budget_mod, "attention_nodes", lambda gm: gm)
    return count


FULL = [GraphKey(4, True), GraphKey(4, False), GraphKey(8, True)]


def test_within_the_budget_every_size_is_kept_and_nothing_said(pieces, caplog):
    rewritten = _Rewritten([16, 32, 64], FULL)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        b = fit(rewritten, SimRuntime(), CompileConfig(graph_budget=12))
    assert b == GraphBudget(3, 3, [16, 32, 64], [], 12, "the graph_budget option") and not caplog.records
    assert [k.bucket for k in rewritten.piecewise.keys] == [16, 32, 64]


def test_a_full_graph_holding_an_eager_layer_is_not_counted(pieces):
    b = fit(_Rewritten([16], FULL, eager=[GraphKey(4, False)]), SimRuntime(), CompileConfig())
    assert (b.full, b.pieces, b.sizes, b.budget) == (2, 3, [16], None)


def test_over_the_budget_sizes_are_dropped_keeping_the_largest_with_one_warning(pieces, caplog):
    rewritten = _Rewritten([16, 32, 64, 128], FULL)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        b = fit(rewritten, SimRuntime(), CompileConfig(graph_budget=11))
    assert b == GraphBudget(3, 3, [16, 128], [32, 64], 11, "the graph_budget option") and b.graphs == 9
    assert [k.bucket for k in rewritten.piecewise.keys] == [16, 128] and rewritten.piecewise_reason is None
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == ("ascend_compile: 15 graphs (3 full, 4 piecewise sizes x 3 pieces) exceed the "
                                   "budget of 11 (the graph_budget option): piecewise sizes [32, 64] dropped, "
                                   "[16, 128] kept")
    b = fit(_Rewritten([16, 32, 64, 128], FULL), SimRuntime(), CompileConfig(graph_budget=6))
    assert b.sizes == [128] and b.dropped == [16, 32, 64]  # (6 - 3) // 3 = 1: the largest


def test_exactly_the_budget_fits(pieces):
    assert fit(_Rewritten([16, 32], FULL), SimRuntime(), CompileConfig(graph_budget=9)).dropped == []
    assert fit(_Rewritten([16, 32], FULL), SimRuntime(), CompileConfig(graph_budget=8)).dropped == [16]


def test_a_budget_no_size_fits_turns_piecewise_off_saying_why(pieces, caplog):
    rewritten = _Rewritten([16, 32], FULL)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        b = fit(rewritten, SimRuntime(), CompileConfig(graph_budget=2))
    assert (b.sizes, b.dropped, b.graphs) == ([], [16, 32], 3)
    assert rewritten.piecewise is None
    assert rewritten.piecewise_reason == "no piecewise size fits the graph budget (2, the graph_budget option)"
    assert caplog.records[0].getMessage().endswith(
        "piecewise sizes [16, 32] dropped, none (steps no full graph serves run eagerly) kept")
    rewritten = _Rewritten([16, 32], FULL)
    assert fit(rewritten, SimRuntime(), CompileConfig(graph_budget=5)).sizes == [] and rewritten.piecewise is None


def test_the_budget_is_the_option_else_the_runtimes_less_the_graphs_others_took_else_none(pieces):
    sim = SimRuntime(stream_budget=10)
    b = fit(_Rewritten([16], FULL), sim, CompileConfig(graph_budget=50), taken=7)
    assert (b.budget, b.source) == (50, "the graph_budget option")
    b = fit(_Rewritten([16], FULL), sim, CompileConfig())
    assert (b.budget, b.source) == (10, "the simulator's stream_budget, one stream a graph (`faults.py`)")
    b = fit(_Rewritten([16], FULL), sim, CompileConfig(), taken=4)
    assert (b.budget, b.source) == (6, "the simulator's stream_budget, one stream a graph (`faults.py`), less 4 "
                                       "graphs of the other models sharing it")
    b = fit(_Rewritten([16], FULL), sim, CompileConfig(), taken=12)
    assert b.budget == 0 and b.sizes == []
    b = fit(_Rewritten([16], FULL), SimRuntime(), CompileConfig(), taken=4)
    assert (b.budget, b.source) == (None, "the simulator's stream_budget, one stream a graph (`faults.py`)")
    b = fit(_Rewritten([16], FULL), types.SimpleNamespace(name="eager"), CompileConfig(), taken=4)
    assert (b.budget, b.source, b.sizes) == (None, "runtime 'eager' captures no graphs", [16])


def test_without_pieces_or_a_piecewise_variant_nothing_is_dropped(pieces):
    b = fit(_Rewritten([], FULL), SimRuntime(), CompileConfig(graph_budget=1))
    assert (b.full, b.pieces, b.sizes, b.dropped, b.graphs) == (3, 0, [], [], 3)
    pieces[0] = 0
    rewritten = _Rewritten([16, 32], FULL)
    b = fit(rewritten, SimRuntime(), CompileConfig(graph_budget=1))
    assert (b.sizes, b.dropped) == ([16, 32], []) and rewritten.piecewise is not None


def test_a_budget_below_the_full_graphs_keeps_no_piecewise_size_even_of_one_piece(pieces):
    pieces[0] = 1
    b = fit(_Rewritten([16, 32], FULL), SimRuntime(), CompileConfig(graph_budget=2))
    assert (b.sizes, b.dropped) == ([], [16, 32])
    b = fit(_Rewritten([16, 32], FULL), SimRuntime(), CompileConfig(graph_budget=4))
    assert (b.sizes, b.dropped) == ([32], [16])


def test_a_piecewise_size_captures_the_pieces_its_variant_splits_into():
    """Counted before any capture, as many as the pieces a piecewise key then captures: a 2-layer llama's
    attention splits it into 3 pieces, its cache writes (padding-safe) staying in them."""
    import ascend_compile
    from ascend_compile.backend import backend
    from ascend_compile.passes.split_pieces import Piece
    from ascend_compile.targets import Target
    from examples.llama import LlamaConfig, PagedBatch, build

    cfg = LlamaConfig(num_layers=2, vocab_size=32, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8,
                      ffn_size=16, num_blocks=64)
    artifacts = []
    torch._dynamo.reset()
    fn = ascend_compile.compile(build(cfg), backend=backend(
        CompileConfig(max_model_len=256, capture_sizes=(4,), piecewise_sizes=(16,)), on_compiled=artifacts.append,
        target=lambda device, config: Target(SimRuntime())))
    with torch.no_grad():
        fn(**PagedBatch(cfg, seed=2).step([5] * 12))
    (art,) = artifacts
    (graph,) = art.piecewise.values()
    assert budget_mod.pieces_per_size(art.rewritten) == sum(isinstance(s, Piece) for s in graph.segments) == 3
    assert art.startup.budget.pieces == 3
    art.rewritten.piecewise = None
    assert budget_mod.pieces_per_size(art.rewritten) == 0


def test_the_pieces_are_counted_on_the_graph_split_as_served_its_padding_safe_writes_kept_in_pieces(monkeypatch):
    """A padding-safe cache write stays in a piece where it is served (`piecewise_serve.py`): the count splits
    the variant the same way, with no step guard or refusal (a write made eager between two nodes of a piece
    would split it in two)."""
    from ascend_compile.passes.split_pieces import EagerNode, Piece

    built = []

    class Graph:
        def __init__(self, key, specialization, variant, gm, signature, padded, uncapturable, step_guard,
                     kernels_refused=None, padding_safe=()):
            built.append((key, gm, signature, uncapturable, step_guard, kernels_refused, set(padding_safe)))
            self.segments = [Piece.__new__(Piece), EagerNode.__new__(EagerNode), Piece.__new__(Piece)]

    monkeypatch.setattr(budget_mod, "PiecewiseGraph", Graph)
    write = lambda node, safe: types.SimpleNamespace(node=node, padding_safe=safe)  # noqa: E731
    variant = types.SimpleNamespace(keys=[GraphKey(16, False, True), GraphKey(64, False, True)], gm="gm")
    rewritten = types.SimpleNamespace(piecewise=variant, signature="sig", mutations=types.SimpleNamespace(
        writes=[write("reshape_and_cache", True), write("index_put", False), write("reshape_and_cache_1", True)]))
    assert budget_mod.pieces_per_size(rewritten) == 2
    assert built == [(GraphKey(64, False, True), "gm", "sig", set(), None, None,
                      {"reshape_and_cache", "reshape_and_cache_1"})]
