"""`integrations/vllm/deferred.py`'s `DeferredCompile` on its own, with a binder and a compile that stand
in for the real ones (`StepBinder`, `backend.compile_graph`): a step runs as traced until the binder says
it can be compiled against, then compiles once (reporting the artifact, installing the direct path where
asked), and after that every step is checked (metadata asking for other attention, a sequence longer than
`max_model_len`) before the artifact runs; each reason to run as traced is logged once, at DEBUG for vLLM's
start-up reasons, WARNING for others; new captures log the graphs' memory. The real binder, compile and
stand-in vLLM: `tests/test_vllm.py`."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import fx

from ascend_compile.config import CompileConfig
from ascend_compile.integrations.vllm import deferred as deferred_module
from ascend_compile.integrations.vllm import memory
from ascend_compile.integrations.vllm.deferred import EXPECTED, DeferredCompile
from ascend_compile.lowering import served
from ascend_compile.lowering.runner import CompiledArtifact


class Binder:
    def __init__(self) -> None:
        self.ready: str | None = "no forward context"
        self.unserved: str | None = None
        self.longest: int | None = None
        self.asked: list[list[str]] = []

    def layer_names(self, gm):
        return ["l0", "l1"]

    def not_ready(self, layers):
        self.asked.append(list(layers))
        return self.ready

    def unserved_step(self):
        return self.unserved

    def longest_sequence(self):
        return self.longest


class Artifact(CompiledArtifact):
    """A compiled artifact that adds 100 (the traced graph adds 1), counting its captures."""

    def __init__(self) -> None:  # noqa: D107 - none of the real artifact's state is read here
        self.stats = {"captures": 0, "piecewise_captures": 0}
        self.direct_calls: list[tuple] = []

    def __call__(self, *args):
        return args[0] + 100

    def call_direct(self, args, fixed=None):
        self.direct_calls.append((tuple(args), fixed))
        return args[0] + 1000


def _graph() -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: x + 1)


@pytest.fixture
def made(monkeypatch):
    """(deferred, binder, compiles, installs, memory logs) with `compile_graph`, `fast_path.install` and
    `memory.log_graph_memory` recorded."""
    compiles, installs, logs = [], [], []
    artifact = Artifact()

    def compile_graph(gm, example_inputs, config, target, bind=None):
        compiles.append((gm, list(example_inputs), config, target, bind))
        return artifact

    monkeypatch.setattr(deferred_module, "compile_graph", compile_graph)
    monkeypatch.setattr(deferred_module.fast_path, "install", installs.append)
    monkeypatch.setattr(memory, "log_graph_memory", lambda a, reserved: logs.append((a, reserved)))
    binder = Binder()

    def make(direct: bool = False, recorded="recorded inputs", on_compiled=None):
        return DeferredCompile(_graph(), [torch.zeros(2)], CompileConfig(max_model_len=64), binder, "target",
                               on_compiled, recorded, direct=direct)

    return make, binder, compiles, installs, logs, artifact


def test_until_the_binder_is_ready_steps_run_as_traced_and_nothing_compiles(made):
    make, binder, compiles, *_ = made
    graph = make()
    assert graph.layers == ["l0", "l1"]
    assert graph(torch.ones(2)).tolist() == [2.0, 2.0]
    assert binder.asked == [["l0", "l1"]] and compiles == [] and graph.compiled is None
    assert graph.graph_inputs is None
    assert memory.tracked(memory.handed_over() - 1) == [graph]  # counted among the graphs handed over


def test_the_first_ready_step_compiles_once_against_the_binder(made):
    make, binder, compiles, installs, logs, artifact = made
    reported = []
    graph = make(on_compiled=reported.append)
    graph(torch.ones(2))
    binder.ready = None
    assert graph(torch.ones(2)).tolist() == [101.0, 101.0]
    assert graph(torch.ones(2)).tolist() == [101.0, 101.0]
    assert len(compiles) == 1 and graph.compiled is artifact and reported == [artifact]
    gm, example_inputs, config, target, bind = compiles[0]
    assert gm is graph.gm and bind is binder and target == "target" and config.max_model_len == 64
    assert len(example_inputs) == 1 and torch.equal(example_inputs[0], torch.zeros(2))
    assert graph.graph_inputs == "recorded inputs"
    assert installs == []  # not asked to put the direct path in front


def test_the_direct_path_is_installed_at_the_first_compiled_step_where_asked(made):
    make, binder, compiles, installs, *_ = made
    binder.ready = None
    graph = make(direct=True)
    graph(torch.ones(2))
    graph(torch.ones(2))
    assert installs == [graph]
    other = make(direct=True, recorded=None)  # nothing recorded: no route to arm
    other(torch.ones(2))
    assert installs == [graph]


def test_a_compile_giving_no_artifact_is_called_but_not_reported_nor_routed(made, monkeypatch):
    make, binder, compiles, installs, *_ = made
    monkeypatch.setattr(deferred_module, "compile_graph", lambda *args, **kwargs: (lambda x: x * 7))
    reported = []
    binder.ready = None
    graph = make(direct=True, on_compiled=reported.append)
    assert graph(torch.ones(2)).tolist() == [7.0, 7.0]
    assert reported == [] and installs == [] and graph.graph_inputs is None


def test_after_compiling_a_step_the_graph_does_not_serve_runs_as_traced(made, caplog):
    make, binder, *_ = made
    binder.ready = None
    graph = make()
    graph(torch.ones(2))
    binder.unserved = "layer 'l0''s metadata asks for non-causal attention"
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        assert graph(torch.ones(2)).tolist() == [2.0, 2.0]
        assert graph(torch.ones(2)).tolist() == [2.0, 2.0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "ascend_compile: vLLM graph (2 attention layers) runs uncompiled: layer 'l0''s metadata asks for "
        "non-causal attention (logged once)"]
    binder.unserved = None
    assert graph(torch.ones(2)).tolist() == [101.0, 101.0]


def test_a_sequence_longer_than_max_model_len_runs_as_traced(made, caplog):
    make, binder, *_ = made
    binder.ready = None
    graph = make()
    binder.longest = 64
    assert graph(torch.ones(2)).tolist() == [101.0, 101.0]  # the longest the workspaces were sized for
    binder.longest = 65
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        assert graph(torch.ones(2)).tolist() == [2.0, 2.0]
    assert ("runs uncompiled: a sequence is longer than max_model_len=64, the longest the graphs' workspaces "
            "were sized for (set max_model_len in ASCEND_COMPILE_OPTIONS or vLLM's config) (logged once)") in caplog.text


@pytest.mark.parametrize("reason", EXPECTED)
def test_vllms_start_up_reasons_are_logged_at_debug_once(made, caplog, reason):
    make, binder, *_ = made
    binder.ready = reason
    graph = make()
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        graph(torch.ones(2))
        graph(torch.ones(2))
    records = [r for r in caplog.records if "runs uncompiled" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.DEBUG, f"ascend_compile: vLLM graph (2 attention layers) runs uncompiled: {reason} (logged once)")]
    assert graph.logged == {reason}


def test_a_direct_call_makes_the_same_checks_then_calls_the_artifact_directly(made):
    make, binder, compiles, *_ = made
    graph = make()
    assert graph.call_direct([torch.ones(2)]).tolist() == [2.0, 2.0]  # not ready: as traced
    binder.ready = None
    fixed = frozenset({0})
    assert graph.call_direct([torch.ones(2)], fixed).tolist() == [1001.0, 1001.0]
    assert graph.compiled.direct_calls[0][1] is fixed
    binder.longest = 1000
    assert graph.call_direct([torch.ones(2)]).tolist() == [2.0, 2.0]


def test_the_deferred_compile_reports_itself_to_the_dispatchers_probe(made):
    make, binder, *_ = made
    binder.ready = None
    graph = make()
    with served.probe() as calls:
        result = graph(torch.ones(2))
    assert [(c.artifact, c.result) for c in calls] == [(graph, result)]  # itself, not the artifact it calls


def test_each_new_capture_logs_the_graphs_memory_beside_what_was_reserved(made):
    make, binder, compiles, installs, logs, artifact = made
    binder.ready = None
    graph = make()
    graph.reserved = 12345
    graph(torch.ones(2))
    assert logs == []  # nothing captured yet
    artifact.stats["captures"] = 1
    graph(torch.ones(2))
    graph(torch.ones(2))
    assert logs == [(artifact, 12345)] and graph.captures == 1
    artifact.stats["piecewise_captures"] = 2
    graph(torch.ones(2))
    assert logs == [(artifact, 12345), (artifact, 12345)] and graph.captures == 3


def test_a_step_is_reported_once_with_its_arguments_and_result(made):
    """What dynamo called is reported (`served.report`) with the step's own arguments and result, once:
    not the artifact's call inside it."""
    make, binder, *_ = made
    binder.ready = None
    graph = make()
    x = torch.ones(2)
    with served.probe() as calls:
        result = graph(x)
    assert [(c.artifact, c.result) for c in calls] == [(graph, result)]
    assert len(calls[0].args) == 1 and calls[0].args[0] is x


def test_without_being_asked_the_direct_path_is_not_put_in_front(made):
    """`direct` defaults to off: the direct dispatcher is vLLM's option to ask for."""
    make, binder, compiles, installs, *_ = made
    binder.ready = None
    graph = DeferredCompile(_graph(), [torch.zeros(2)], CompileConfig(max_model_len=64), binder, "target", None,
                            "recorded inputs")
    graph(torch.ones(2))
    assert graph.compiled is not None and installs == []
