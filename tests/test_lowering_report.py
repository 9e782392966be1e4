"""What a compiled artifact reports of itself (`lowering/report.py`): plan.json's content (`describe`) and
the memory it holds (`memory_report`), read from a stand-in artifact holding exactly what the report reads,
so each field's source is known. mutmut's tests for the module (the compile-level plan.json and `inspect`
are `tests/test_graph_budget.py`'s and the runner's tests')."""
from __future__ import annotations

import collections
import types

import pytest

from ascend_compile.lowering import report
from ascend_compile.passes.workspaces import GraphKey

NS = types.SimpleNamespace
DECODE, MIXED, P16, P32 = GraphKey(4, True), GraphKey(4, False), GraphKey(16, False, True), GraphKey(32, False, True)
P64 = GraphKey(64, False, True)


class _Numel:
    def __init__(self, n):
        self.n = n

    def numel(self):
        return self.n


class _Described:
    def __init__(self, what):
        self.what = what

    def describe(self):
        return self.what


class _Graph:
    """A captured graph entry (`GraphEntry`) or piecewise graph: what the report reads of it."""

    def __init__(self, name, graph=True, pieces=(), memory=None, eager_reason=None, verified=None, seconds=0.0,
                 table=None, eager=None, described=None):
        self.name, self.graph, self.pieces, self.eager_reason = name, graph, pieces, eager_reason
        self.verified, self.capture_seconds, self.table = verified, seconds, _Described(table or {"rows": name})
        self.eager, self._memory, self._described = eager or {}, memory or {name: 1}, described or {"pieces": name}

    def memory(self):
        return self._memory

    def describe(self):
        return self._described


class _Node:
    def __init__(self, name):
        self.name = name


def _art(**kw):
    """A stand-in artifact: two inputs (an in-place KV cache checked each step, a frozen parameter), one
    graph key with a kernel, captured as a full graph."""
    rewritten_plan = {
        "inputs": [{"index": 0, "role": "kv_cache"}, {"index": 1, "role": "static"}, {"index": 2, "role": "batch"}],
        "graphs": {str(DECODE): {"kernels": [{"kernel": "pa"}]}, str(MIXED): {"kernels": []}},
        "workspace": {"slots": 1},
    }
    fields = dict(
        config=NS(model_name="llama", kernel_policy="auto"),
        rewritten=NS(describe=lambda: {k: (dict(v) if isinstance(v, dict) else [dict(x) for x in v])
                                       for k, v in rewritten_plan.items()},
                     piecewise=None, piecewise_reason="no piecewise sizes"),
        runtime=NS(describe=lambda: {"name": "sim"}),
        group=None, checked=[0], specialized={}, graphs={}, piecewise={}, uncapturable={},
        target=NS(describe_kernel=lambda call: {"target": call.node.name}),
        failures=NS(graphs={"b8.decode": "207008"}),
        startup=NS(describe=lambda art: {"seconds": {}, "of": art}),
        served=collections.Counter(), not_full=collections.Counter(), workspaces={},
    )
    fields.update(kw)
    return NS(**fields)


def test_the_plan_has_the_model_the_passes_plan_the_runtime_the_config_and_each_in_place_inputs_check():
    art = _art()
    plan = report.describe(art)
    assert plan["model"] == "llama" and plan["runtime"] == {"name": "sim"} and plan["workspace"] == {"slots": 1}
    assert plan["config"] == {"model_name": "llama", "kernel_policy": "auto"}
    assert plan["config"] is not vars(art.config)
    assert plan["inputs"] == [{"index": 0, "role": "kv_cache", "address_checked": True},
                              {"index": 1, "role": "static", "address_checked": False},  # a frozen parameter
                              {"index": 2, "role": "batch"}]  # copied: no address to check
    assert plan["failed_captures"] == {"b8.decode": "207008"} and plan["startup"] == {"seconds": {}, "of": art}
    assert plan["piecewise"] == {"enabled": False, "reason": "no piecewise sizes"}
    assert plan["served"] == {"steps": {}, "not_full": {}}
    assert "group" not in plan["workspace"]


def test_a_workspace_group_is_in_the_plans_workspace():
    plan = report.describe(_art(group=_Described({"models": 2})))
    assert plan["workspace"] == {"slots": 1, "group": {"models": 2}}


def test_each_kernel_gets_its_decision_its_node_and_the_targets_word(monkeypatch):
    calls = {"gm4": [NS(meta=_Described({"kernel": "pa", "tiling": 7}), node=_Node("attn_0"))]}
    monkeypatch.setattr(report, "kernel_calls", lambda gm: calls[gm])
    plan = report.describe(_art(specialized={DECODE: "gm4"}))
    assert plan["graphs"][str(DECODE)]["kernels"] == [{"kernel": "pa", "tiling": 7, "node": "attn_0",
                                                      "target": "attn_0"}]


def test_a_captured_graph_gets_its_update_table_capture_seconds_and_first_replay_check():
    graphs = {(DECODE, ()): _Graph("b4.decode", seconds=0.123456, verified={"max_abs": 0.0}),
              (MIXED, ()): _Graph("b4.mixed", seconds=1.0)}
    plan = report.describe(_art(graphs=graphs))
    assert plan["graphs"][str(DECODE)] == {"kernels": [{"kernel": "pa"}], "update_table": {"rows": "b4.decode"},
                                           "capture_seconds": 0.1235, "verified": {"max_abs": 0.0}}
    assert plan["graphs"][str(MIXED)] == {"kernels": [], "update_table": {"rows": "b4.mixed"},
                                          "capture_seconds": 1.0}


def test_specializations_are_listed_by_name_the_first_captured_also_the_keys_own():
    graphs = {(DECODE, (("s", 3),)): _Graph("b4.decode.s3", seconds=0.5),
              (DECODE, (("s", 5),)): _Graph("b4.decode.s5", seconds=0.25, verified={"ok": True})}
    graph = report.describe(_art(graphs=graphs))["graphs"][str(DECODE)]
    assert graph["specializations"] == {
        "b4.decode.s3": {"update_table": {"rows": "b4.decode.s3"}, "capture_seconds": 0.5},
        "b4.decode.s5": {"update_table": {"rows": "b4.decode.s5"}, "capture_seconds": 0.25, "verified": {"ok": True}}}
    assert graph["update_table"] == {"rows": "b4.decode.s3"} and graph["capture_seconds"] == 0.5
    assert "verified" not in graph


def test_a_graph_not_captured_says_why_by_name_and_one_not_captured_without_a_reason_says_nothing():
    graphs = {(DECODE, ()): _Graph("b4.decode", graph=None, eager_reason="an op that cannot be captured"),
              (MIXED, ()): _Graph("b4.mixed", graph=None)}
    plan = report.describe(_art(graphs=graphs))
    assert plan["graphs"][str(DECODE)] == {"kernels": [{"kernel": "pa"}],
                                           "not_captured": {"b4.decode": "an op that cannot be captured"}}
    assert plan["graphs"][str(MIXED)] == {"kernels": []}
    graphs = {(DECODE, ()): _Graph("b4.decode", graph=None, eager_reason="refused"),
              (MIXED, ()): _Graph("b4.mixed", seconds=1.0)}  # a graph after one not captured still described
    assert report.describe(_art(graphs=graphs))["graphs"][str(MIXED)]["capture_seconds"] == 1.0


def test_served_steps_are_by_kind_then_path_sorted_and_not_full_most_common_first():
    served = collections.Counter({("mixed", "eager"): 2, ("decode", "graph"): 5, ("decode", "eager"): 1})
    not_full = collections.Counter({"a": 1, "b": 3})
    plan = report.describe(_art(served=served, not_full=not_full))
    assert plan["served"]["steps"] == {"decode": {"eager": 1, "graph": 5}, "mixed": {"eager": 2}}
    assert list(plan["served"]["steps"]) == ["decode", "mixed"] and list(plan["served"]["steps"]["decode"]) == [
        "eager", "graph"]
    assert list(plan["served"]["not_full"].items()) == [("b", 3), ("a", 1)]


def _piecewise_art(first_eager=None, uncapturable=None, graphs=None):
    variant = NS(keys=[P16, P32, P64], kernels=("fia", "pa", "fia"))
    rewritten = NS(piecewise=variant, plan=NS(graph_slot={str(P16): 0, str(P32): 1, str(P64): 2}))
    pieces = graphs if graphs is not None else {
        (P16, ()): _Graph("p16", graph=None, pieces=(1,), eager=first_eager or {}, described={"n": 16}),
        (P32, ()): _Graph("p32", graph=None, pieces=(1,), eager={_Node("other"): "x"}, described={"n": 32})}
    return NS(rewritten=rewritten, piecewise=pieces, uncapturable=uncapturable or {})


def test_the_piecewise_plan_gives_sizes_kernels_the_largest_sizes_slot_each_graph_and_the_first_ones_eager_nodes():
    art = _piecewise_art(first_eager={_Node("attn_0"): "attention", _Node("print_1"): "an op not captured"})
    assert report._piecewise(art) == {
        "enabled": True, "sizes": [16, 32, 64], "kernels": ["fia", "pa"], "workspace_slot": 2,
        "graphs": {"p16": {"n": 16}, "p32": {"n": 32}},
        "eager_nodes": {"attn_0": "attention", "print_1": "an op not captured"}}


def test_the_piecewise_plan_names_the_uncapturable_ops_and_without_graphs_no_eager_nodes():
    art = _piecewise_art(uncapturable={"aten.nonzero": "dynamic shape"}, graphs={})
    assert report._piecewise(art) == {"enabled": True, "sizes": [16, 32, 64], "kernels": ["fia", "pa"],
                                      "workspace_slot": 2, "graphs": {},
                                      "uncapturable_ops": {"aten.nonzero": "dynamic shape"}}


def test_describe_includes_the_piecewise_plan():
    art = _art()
    piecewise = _piecewise_art(graphs={})
    art.rewritten.piecewise, art.rewritten.plan = piecewise.rewritten.piecewise, piecewise.rewritten.plan
    assert report.describe(art)["piecewise"]["sizes"] == [16, 32, 64]


def test_memory_is_each_workspace_slots_size_each_captured_graphs_and_piecewise_keys_and_the_pool():
    graphs = {1: _Graph("b4.decode", memory={"static": 10}), 2: _Graph("b4.mixed", graph=None)}
    piecewise = {3: _Graph("p16", graph=None, pieces=(1,), memory={"pieces": 5}), 4: _Graph("p32", pieces=())}
    art = _art(workspaces={"slot0": _Numel(100), "slot1": _Numel(7)}, graphs=graphs, piecewise=piecewise,
               runtime=NS(memory_stats=lambda: {"reserved": 4096}))
    assert report.memory_report(art) == {"workspace_bytes": {"slot0": 100, "slot1": 7},
                                         "graphs": {"b4.decode": {"static": 10}},
                                         "piecewise": {"p16": {"pieces": 5}}, "pool": {"reserved": 4096}}


def test_memory_without_a_pool_has_none_and_a_workspace_group_is_described():
    art = _art(group=_Described({"models": 2}), runtime=NS())
    assert report.memory_report(art) == {"workspace_bytes": {}, "workspace_group": {"models": 2}, "graphs": {},
                                         "piecewise": {}}
    with pytest.raises(KeyError):
        report.memory_report(_art())["pool"]
