"""The vLLM integration's memory bookkeeping and planning inputs, module by module, without vLLM and
without compiling: our graphs' memory taken out of vLLM's KV-cache budget (`kv_budget.py`), the
figures and log lines of `memory.py` around the estimate (the graphs tracked, the override, the
report after each capture, the pieces' pool replay and buffers; the planning context and the metadata
inputs: `test_vllm_planning_unit.py`, `test_vllm_metadata_unit.py`). vLLM's workers, configs and layers
are plain objects with the fields read. Each test runs in milliseconds (the mutation selection of these modules, `tools/mutation/modules.toml`)."""
from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ascend_compile.integrations.vllm import kv_budget, memory

NS = types.SimpleNamespace
MIB = 1 << 20


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG, logger="ascend_compile")
    return caplog


@pytest.fixture
def fresh(monkeypatch):
    """This process's graphs tracked, handed-over count and reservation flag, fresh; no override set."""
    monkeypatch.setattr(memory, "_TRACKED", memory.weakref.WeakKeyDictionary())
    monkeypatch.setattr(memory, "_HANDED_OVER", [0])
    monkeypatch.setattr(memory, "_RESERVED", [False])
    monkeypatch.delenv(memory.ENV, raising=False)


class _Graph:
    """A handed-over graph (`DeferredCompile`) as the budget sees it."""

    def __init__(self, figure=None, compiled=None):
        self.figure, self.compiled, self.reserved = figure, compiled, None


# ------------------------------------------------------------------------------ memory.py: bookkeeping


def test_graphs_are_tracked_in_the_order_handed_over_until_compiled(fresh):
    assert memory.handed_over() == 0 and memory.tracked() == []
    a, b = _Graph(), _Graph()
    memory.track(a)
    since = memory.handed_over()
    memory.track(b)
    c = _Graph()
    memory.track(c)
    assert since == 1 and memory.handed_over() == 3
    assert memory.tracked() == [a, b, c]
    assert memory.tracked(since) == [b, c] and memory.tracked(3) == []
    b.compiled = object()
    assert memory.tracked() == [a, c] and memory.tracked(1) == [c]


def test_a_graph_no_longer_referenced_is_not_tracked(fresh):
    memory.track(_Graph())
    kept = _Graph()
    memory.track(kept)
    assert memory.tracked() == [kept] and memory.handed_over() == 2


def test_the_estimate_totals_its_parts_and_describes_them_in_mib():
    figure = memory.GraphMemoryEstimate(3 * MIB, MIB // 2, 5 * MIB, 4)
    assert figure.total == 3 * MIB + MIB // 2 + 5 * MIB
    assert figure.describe() == ("8.5 MiB (workspaces 3.0, static buffers 0.5, graph pool 5.0 MiB, over 4 graphs)")


def _report(pool=True, piecewise=True):
    report = {"workspace_bytes": {"pa": 3 * MIB, "fia": MIB},
              "graphs": {"b4.decode": {"static_inputs_bytes": 100}, "b8.decode": {"static_inputs_bytes": 20}}}
    if piecewise:
        report["piecewise"] = {"p32": {"static_inputs_bytes": 3}, "p64": {"static_inputs_bytes": 5000}}
    if pool:
        report["pool"] = {"graph": {"reserved_bytes": 2 * MIB}}
    return report


def test_the_reported_graph_memory_is_workspaces_every_graphs_and_sizes_buffers_and_the_graph_pool():
    assert memory.graph_memory(_report()) == {"workspaces": 4 * MIB, "buffers": 5123, "pool": 2 * MIB}
    assert memory.graph_memory(_report(pool=False, piecewise=False)) == {"workspaces": 4 * MIB, "buffers": 120,
                                                                         "pool": 0}
    assert memory.graph_memory({**_report(pool=False), "pool": {}})["pool"] == 0
    assert memory.graph_memory({**_report(pool=False), "pool": {"graph": {}}})["pool"] == 0


class _Artifact:
    def __init__(self, report, captures=2, pieces=1):
        self._report, self.stats = report, {"captures": captures, "piecewise_captures": pieces}

    def memory_report(self):
        return self._report


DETAIL = "(workspaces 4.0, static buffers 0.0, graph pool 2.0 MiB)"


def _report_of(total_extra=0):
    report = _report(piecewise=False)
    report["graphs"] = {"b4.decode": {"static_inputs_bytes": total_extra}}
    return report


def test_after_a_capture_with_nothing_reserved_the_figure_to_reserve_is_logged(fresh, logs):
    total = 6 * MIB
    assert memory.log_graph_memory(_Artifact(_report_of())) == total
    (record,) = logs.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        f"ascend_compile: vLLM graphs take 6.0 MiB outside vLLM's KV-cache budget after 3 captures {DETAIL}: "
        f"reserve it by lowering gpu_memory_utilization or kv_cache_memory_bytes")


def test_a_graph_handed_over_after_the_kv_cache_was_sized_warns_that_none_of_it_is_reserved(fresh, logs):
    memory.reserved_once()
    assert memory._RESERVED == [True]
    assert memory.log_graph_memory(_Artifact(_report_of(), captures=4, pieces=0)) == 6 * MIB
    (record,) = logs.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"ascend_compile: a vLLM graph handed over after the KV cache was sized (dynamo compiled the model again) "
        f"takes 6.0 MiB after 4 captures {DETAIL} outside vLLM's KV-cache budget, none of it reserved: set "
        f"ASCEND_COMPILE_GRAPH_MEMORY to the total of every graph's figure logged")


def test_more_than_reserved_warns_with_the_bytes_to_set(fresh, logs):
    total = 6 * MIB + 1
    assert memory.log_graph_memory(_Artifact(_report_of(1)), reserved=6 * MIB) == total
    (record,) = logs.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"ascend_compile: vLLM graphs take 6.0 MiB after 3 captures {DETAIL}, more than the 6.0 MiB reserved "
        f"before the KV cache was sized: set ASCEND_COMPILE_GRAPH_MEMORY to at least {total}")


@pytest.mark.parametrize("reserved", [6 * MIB, 9 * MIB, 0 + 6 * MIB])
def test_within_what_was_reserved_is_logged_beside_it(fresh, logs, reserved):
    memory.reserved_once()  # a graph with its share: reserved before the KV cache was sized
    assert memory.log_graph_memory(_Artifact(_report_of()), reserved=reserved) == 6 * MIB
    (record,) = logs.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        f"ascend_compile: vLLM graphs take 6.0 MiB after 3 captures {DETAIL}, of the {reserved / MIB:.1f} MiB "
        f"reserved before the KV cache was sized")


def test_a_reserved_figure_of_zero_bytes_is_a_reservation(fresh, logs):
    memory.log_graph_memory(_Artifact(_report_of()), reserved=0)
    assert logs.records[0].levelno == logging.WARNING and "more than the 0.0 MiB reserved" in logs.text


@pytest.mark.parametrize("value, expected", [(None, None), ("auto", None), (" auto ", None), ("0", 0),
                                             ("1048576", MIB), (" 7 ", 7)])
def test_the_override_is_bytes_or_auto(fresh, monkeypatch, value, expected):
    assert memory.ENV == "ASCEND_COMPILE_GRAPH_MEMORY"
    if value is not None:
        monkeypatch.setenv(memory.ENV, value)
    assert memory.override() == expected


@pytest.mark.parametrize("value", ["-1", "1.5", "lots", "", "AUTO"])
def test_an_override_not_bytes_is_refused_naming_it(fresh, monkeypatch, value):
    monkeypatch.setenv(memory.ENV, value)
    with pytest.raises(ValueError) as err:
        memory.override()
    assert str(err.value) == f"ASCEND_COMPILE_GRAPH_MEMORY: expected 'auto' or a number of bytes >= 0, got {value!r}"


def test_the_planning_target_sizes_workspaces_by_its_estimate_and_is_the_target_otherwise():
    asked = []
    target = NS(workspace_estimate=lambda config, dtype: asked.append((config, dtype)) or "estimate",
                workspace_need=lambda config, dtype: "need", runtime="runtime")
    planning = memory._Planning(target)
    assert planning.workspace_need("config", torch.float16) == "estimate"
    assert asked == [("config", torch.float16)]
    assert planning.runtime == "runtime"
    with pytest.raises(AttributeError):
        planning.no_such_attribute


def test_the_estimates_rewrite_logs_nothing_below_warning_and_the_level_comes_back(logs):
    log = logging.getLogger("ascend_compile")
    for level in (logging.NOTSET, logging.INFO, logging.ERROR):
        log.setLevel(level)
        with memory._quiet():
            assert log.level == max(level, logging.WARNING)
        assert log.level == level
    log.setLevel(logging.DEBUG)
    with pytest.raises(KeyError), memory._quiet():
        raise KeyError("x")
    assert log.level == logging.DEBUG


# -------------------------------------------------------------------------------------------- kv_budget.py


class _Worker:
    """vLLM's worker: `determine_available_memory` answers after the profiling run handed graphs over."""

    GIB = 1 << 30

    def __init__(self, during=(), user_set=None, plan=None, fields=True):
        self.during, self.plan, self.fields = list(during), plan, fields
        self.cache_config, self.vllm_config = NS(kv_cache_memory_bytes=user_set), object()
        self.handed = []

    def determine_available_memory(self):
        """vLLM's answer."""
        self.handed = [_Graph(figure) for figure in self.during]
        for graph in self.handed:
            memory.track(graph)
        if self.plan is not None:  # vLLM 0.33 applying its startup plan
            self.cache_config.kv_cache_memory_bytes = self.plan
        if self.fields:
            self.available_kv_cache_memory_bytes, self.peak_activation_memory = 10 * self.GIB, self.GIB
        return 10 * self.GIB


def _estimate(graph, vllm_config):
    if isinstance(graph.figure, Exception):
        raise graph.figure
    if graph.figure is None:
        return None
    return memory.GraphMemoryEstimate(graph.figure - 300, 200, 100, 2)


@pytest.fixture
def worker_cls(fresh, monkeypatch):
    monkeypatch.setattr(memory, "estimate", _estimate)
    cls = type("Worker", (_Worker,), {})
    kv_budget.wrap(cls)
    return cls


def test_the_wrapped_answer_is_vllms_less_our_graphs_with_its_bookkeeping_moved_alike(worker_cls, logs):
    before = _Graph(MIB)
    memory.track(before)  # handed over before this profiling run: not in its figure
    worker = worker_cls(during=[3 * MIB, MIB])
    left = 10 * _Worker.GIB - 4 * MIB
    assert worker.determine_available_memory() == left
    assert worker.available_kv_cache_memory_bytes == left
    assert worker.peak_activation_memory == _Worker.GIB + 4 * MIB
    assert [g.reserved for g in worker.handed] == [3 * MIB, MIB] and before.reserved is None
    assert memory._RESERVED == [True]
    assert logs.messages == [
        f"ascend_compile: 4.0 MiB taken out of vLLM's KV-cache budget for our graphs (estimated: "
        f"{_estimate(worker.handed[0], None).describe()}; {_estimate(worker.handed[1], None).describe()}): "
        f"{left / MIB:.1f} MiB left for the KV cache"]


def test_the_wrapper_keeps_the_name_and_wraps_once(worker_cls):
    wrapped = worker_cls.determine_available_memory
    assert wrapped.__name__ == "determine_available_memory" and wrapped.__doc__ == "vLLM's answer."
    assert getattr(wrapped, kv_budget._WRAPPED) is True and not hasattr(_Worker.determine_available_memory,
                                                                         kv_budget._WRAPPED)
    kv_budget.wrap(worker_cls)
    assert worker_cls.determine_available_memory is wrapped
    worker = worker_cls(during=[MIB])
    assert worker.determine_available_memory() == 10 * _Worker.GIB - MIB  # taken out once


def test_no_graph_handed_over_leaves_vllms_answer(worker_cls, logs):
    worker = worker_cls()
    assert worker.determine_available_memory() == 10 * _Worker.GIB
    assert worker.peak_activation_memory == _Worker.GIB and memory._RESERVED == [False] and logs.messages == []


def test_a_worker_without_vllms_bookkeeping_fields_still_gets_the_reduced_answer(worker_cls):
    worker = worker_cls(during=[MIB], fields=False)
    assert worker.determine_available_memory() == 10 * _Worker.GIB - MIB
    assert not hasattr(worker, "available_kv_cache_memory_bytes") and not hasattr(worker, "peak_activation_memory")


def test_the_override_replaces_the_estimate_as_each_graphs_share_and_the_total(worker_cls, monkeypatch, logs):
    monkeypatch.setenv(memory.ENV, str(2 * MIB))
    worker = worker_cls(during=[ValueError("never estimated"), None])
    assert worker.determine_available_memory() == 10 * _Worker.GIB - 2 * MIB
    assert [g.reserved for g in worker.handed] == [2 * MIB, 2 * MIB]
    assert logs.messages == [
        f"ascend_compile: 2.0 MiB taken out of vLLM's KV-cache budget for our graphs "
        f"(ASCEND_COMPILE_GRAPH_MEMORY={2 * MIB}): {(10 * _Worker.GIB - 2 * MIB) / MIB:.1f} MiB left for the KV cache"]


def test_an_override_of_zero_takes_nothing_out(worker_cls, monkeypatch):
    monkeypatch.setenv(memory.ENV, "0")
    worker = worker_cls(during=[MIB])
    assert worker.determine_available_memory() == 10 * _Worker.GIB
    assert worker.peak_activation_memory == _Worker.GIB and worker.handed[0].reserved == 0


def test_a_refusal_fails_start_up_as_the_compile_would(worker_cls):
    worker = worker_cls(during=[MIB, ValueError("layer refused")])
    with pytest.raises(ValueError, match="^layer refused$"):
        worker.determine_available_memory()


def test_an_estimate_that_fails_reserves_nothing_and_says_how_to_reserve(worker_cls, logs):
    worker = worker_cls(during=[MIB, KeyError("x")])
    assert worker.determine_available_memory() == 10 * _Worker.GIB
    assert worker.peak_activation_memory == _Worker.GIB and memory._RESERVED == [False]
    assert [r.levelno for r in logs.records] == [logging.WARNING, logging.WARNING]
    assert logs.messages == [
        "ascend_compile: no graph memory estimate (KeyError: 'x')",
        "ascend_compile: graph memory not reserved in vLLM's KV-cache budget (no estimate, see above): set "
        "ASCEND_COMPILE_GRAPH_MEMORY to the bytes to reserve, or lower gpu_memory_utilization"]
    assert [g.reserved for g in worker.handed] == [None, None]


def test_a_graph_without_an_estimate_reserves_nothing(worker_cls, logs):
    worker = worker_cls(during=[None, MIB])
    assert worker.determine_available_memory() == 10 * _Worker.GIB
    assert memory._RESERVED == [False] and [g.reserved for g in worker.handed] == [None, None]
    assert len(logs.records) == 1 and "(no estimate, see above)" in logs.messages[0]


def test_a_kv_cache_size_the_user_set_is_left_with_a_warning_of_what_our_graphs_take(worker_cls, logs):
    worker = worker_cls(during=[3 * MIB], user_set=5 * _Worker.GIB)
    assert worker.determine_available_memory() == 10 * _Worker.GIB
    assert worker.available_kv_cache_memory_bytes == 10 * _Worker.GIB and worker.peak_activation_memory == _Worker.GIB
    assert worker.handed[0].reserved == 3 * MIB and memory._RESERVED == [True]
    (record,) = logs.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"ascend_compile: kv_cache_memory_bytes={5 * _Worker.GIB} is set: vLLM's KV cache is not reduced for our "
        f"graphs, which will take 3.0 MiB more (estimated: {_estimate(worker.handed[0], None).describe()})")


def test_vllms_startup_plan_already_left_our_graphs_out(worker_cls, logs):
    worker = worker_cls(during=[3 * MIB], plan=7 * _Worker.GIB)  # set by vLLM inside the call, not by the user
    assert worker.determine_available_memory() == 10 * _Worker.GIB
    assert worker.peak_activation_memory == _Worker.GIB and worker.handed[0].reserved == 3 * MIB
    (record,) = logs.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        f"ascend_compile: vLLM applied its startup plan (kv_cache_memory_bytes={7 * _Worker.GIB}), saved with our "
        f"graphs' 3.0 MiB already left out")


@pytest.mark.parametrize("figure", [10 * _Worker.GIB, 10 * _Worker.GIB + 1])
def test_nothing_left_for_the_kv_cache_is_refused_naming_the_figures(worker_cls, monkeypatch, figure):
    monkeypatch.setenv(memory.ENV, str(figure))
    worker = worker_cls(during=[MIB])
    with pytest.raises(ValueError) as err:
        worker.determine_available_memory()
    assert str(err.value) == (
        f"ascend_compile: our graphs need {figure} bytes (ASCEND_COMPILE_GRAPH_MEMORY={figure}) outside vLLM's "
        f"KV-cache budget, but vLLM has only {10 * _Worker.GIB} bytes for the KV cache: raise "
        f"gpu_memory_utilization, lower max_model_len or the capture sizes, or set ASCEND_COMPILE_GRAPH_MEMORY")
    assert worker.peak_activation_memory == _Worker.GIB


def test_one_byte_left_is_kept(worker_cls, monkeypatch):
    monkeypatch.setenv(memory.ENV, str(10 * _Worker.GIB - 1))
    assert worker_cls(during=[MIB]).determine_available_memory() == 1


def test_reserve_reads_the_figure_it_is_given_not_the_workers_bookkeeping(fresh, monkeypatch):
    monkeypatch.setattr(memory, "estimate", _estimate)
    worker = NS(cache_config=NS(kv_cache_memory_bytes=None), vllm_config=None, available_kv_cache_memory_bytes=50,
                peak_activation_memory=5)
    assert kv_budget.reserve(worker, 1000, None, [_Graph(400)]) == 600
    assert (worker.available_kv_cache_memory_bytes, worker.peak_activation_memory) == (-350, 405)


def test_the_estimate_is_asked_with_the_workers_vllm_config(fresh, monkeypatch):
    asked = []
    monkeypatch.setattr(memory, "estimate", lambda graph, config: asked.append(config) or
                        memory.GraphMemoryEstimate(1, 1, 1, 1))
    worker = NS(cache_config=NS(kv_cache_memory_bytes=None), vllm_config="config")
    assert kv_budget.reserve(worker, 100, None, [_Graph(), _Graph()]) == 94
    assert asked == ["config", "config"]


class _Resolved:
    pass


def test_the_worker_class_is_vllms_parallel_config_worker_cls_a_class_or_its_qualified_name(monkeypatch, logs):
    module = types.ModuleType("hd_workers")
    module.NPUWorker = _Resolved
    monkeypatch.setitem(sys.modules, "hd_workers", module)
    assert kv_budget.worker_class(NS(parallel_config=NS(worker_cls=_Resolved))) is _Resolved
    assert kv_budget.worker_class(NS(parallel_config=NS(worker_cls="hd_workers.NPUWorker"))) is _Resolved
    package = types.ModuleType("hd_workers.npu")  # vLLM-Ascend's "vllm_ascend.worker.worker_v1.NPUWorker": dotted
    package.NPUWorker = _Resolved
    monkeypatch.setitem(sys.modules, "hd_workers.npu", package)
    assert kv_budget.worker_class(NS(parallel_config=NS(worker_cls="hd_workers.npu.NPUWorker"))) is _Resolved
    for unresolved in (None, "auto", 3):  # vLLM resolves "auto" later
        assert kv_budget.worker_class(NS(parallel_config=NS(worker_cls=unresolved))) is None
    assert kv_budget.worker_class(NS()) is None
    assert logs.messages == []


@pytest.mark.parametrize("name, error", [("hd_no_such_module.Worker", "ModuleNotFoundError: No module named "
                                                                       "'hd_no_such_module'"),
                                         ("hd_workers.Missing", "AttributeError: ")])
def test_a_worker_class_that_does_not_import_is_warned_of(monkeypatch, logs, name, error):
    monkeypatch.setitem(sys.modules, "hd_workers", types.ModuleType("hd_workers"))
    assert kv_budget.worker_class(NS(parallel_config=NS(worker_cls=name))) is None
    (record,) = logs.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        f"ascend_compile: graph memory not reserved in vLLM's KV-cache budget: worker class {name} does not "
        f"import ({error}")


def test_install_wraps_the_worker_class_vllm_runs(fresh, monkeypatch, logs):
    cls = type("Worker", (_Worker,), {})
    kv_budget.install(NS(parallel_config=NS(worker_cls=cls)))
    assert getattr(cls.determine_available_memory, kv_budget._WRAPPED)
    assert logs.messages == []


def test_install_without_a_resolved_worker_class_says_so(logs):
    kv_budget.install(NS(parallel_config=NS(worker_cls="auto")))
    kv_budget.install(NS())
    assert logs.messages == [
        "ascend_compile: graph memory not reserved in vLLM's KV-cache budget: parallel_config.worker_cls is not "
        "resolved ('auto')",
        "ascend_compile: graph memory not reserved in vLLM's KV-cache budget: parallel_config.worker_cls is not "
        "resolved (None)"]
    assert all(r.levelno == logging.INFO for r in logs.records)


# ------------------------------------------------------------------------ memory.py: the pieces' pool replay


class _Trace:
    """A piece's allocation trace: what its replay leaves held (by id) and which ids each output holds."""

    def __init__(self, name, handles, outputs, events):
        self.name, self.handles, self.outputs, self.events = name, handles, outputs, events

    def replay_held(self, model, values):
        self.events.append(("replay", self.name, values))
        return dict(self.handles)


def _pieces(monkeypatch, events, traces):
    """A piecewise graph of pieces P0, an eager node E1, pieces P2 and P3, as `_piece_pool` reads it:
    P0 makes `a`, its view `v` (one storage: id 0) and `t` (id 1), and a temporary (id 2); E1 reads `t`,
    P2 reads `v`, P3 reads `a` and makes the graph's output `o`. Each size's pool model (a fresh one per
    size) logs its releases, and reserves 1,000 bytes per replay it saw plus its size's token count."""
    from ascend_compile.passes import split_pieces

    a, v, t, x, o = "a", "v", "t", "x", "o"
    segments = [split_pieces.Piece([a, v, t], [], [a, v, t]), NS(node="E1"), split_pieces.Piece([x], [v], []),
                split_pieces.Piece([o], [a], [o])]
    graph = NS(segments=segments, gm="gm", last_uses=lambda: {a: 3, v: 2, t: 1, o: 4})
    keys = []
    monkeypatch.setattr(memory, "_piecewise_graph", lambda rewritten, key: keys.append(key) or graph)
    monkeypatch.setattr(split_pieces, "piece_module", lambda gm, piece: (gm, segments.index(piece)))
    kernels = []

    def trace_allocations(module, one_kernel):
        kernels.append(one_kernel)
        return traces[module[1]]

    monkeypatch.setattr(memory, "trace_allocations", trace_allocations)
    models = []

    def pool_model(runtime):
        model = NS(release=lambda handle: events.append(("release", handle)), runtime=runtime)
        model.reserved_bytes = lambda: 1000 * sum(e[0] == "replay" for e in events)
        models.append(model)
        return model

    monkeypatch.setattr(memory, "pool_model", pool_model)
    padded = lambda bucket, max_blocks: {"s0": bucket, "blocks": max_blocks}  # noqa: E731
    rewritten = NS(piecewise=NS(keys=[NS(bucket=64), NS(bucket=16)]), max_blocks=7,
                   signature=NS(padded_symbols=padded))
    return rewritten, keys, kernels, models


def test_every_sizes_pieces_are_replayed_smallest_first_outputs_held_until_their_last_reader(monkeypatch):
    """The sizes' pieces replayed smallest first, on one pool model of the runtime's, at each size's padded
    values; the pieces traced once, from the largest size's split, as the runtime records kernels; a
    piece's outputs held until its last reader is captured, what is still held let go after the size's
    last piece; the figure what the model reserves after them all."""
    events = []
    traces = {0: _Trace("P0", {0: "h0", 1: "h1", 2: "h2"}, ((0,), (0,), (1,)), events),
              2: _Trace("P2", {0: "h4"}, (), events), 3: _Trace("P3", {0: "h3"}, ((0,),), events)}
    rewritten, keys, kernels, models = _pieces(monkeypatch, events, traces)
    runtime = NS(device_kernels=NS(is_kernel=lambda op: False))
    assert memory._piece_pool(rewritten, runtime) == 6000
    assert keys == [rewritten.piecewise.keys[-1]]
    assert kernels == [runtime.device_kernels.is_kernel] * 3  # each piece traced once, as the runtime records kernels
    assert [m.runtime for m in models] == [runtime]
    one_size = [
        ("replay", "P0"), ("release", "h2"),  # a temporary: let go with the capture
        ("release", "h1"),  # `t`: read by E1 only, let go before P2 is captured
        ("replay", "P2"), ("release", "h4"),
        # `a` and its view `v` (one storage): held while P3, `a`'s reader, is captured, though `v` is read by P2
        ("replay", "P3"),
        ("release", "h0"), ("release", "h3")]  # what is still held, let go after the size's last piece
    assert [e[:2] for e in events] == one_size + one_size
    assert [e[2] for e in events if e[0] == "replay"] == [{"s0": 16, "blocks": 7}] * 3 + [{"s0": 64, "blocks": 7}] * 3


def test_a_piece_whose_allocations_cannot_be_traced_gives_no_pool(monkeypatch):
    events = []
    traces = {0: _Trace("P0", {0: "h0"}, ((0,), (0,), ()), events), 2: None, 3: _Trace("P3", {}, ((),), events)}
    rewritten, _, kernels, models = _pieces(monkeypatch, events, traces)
    assert memory._piece_pool(rewritten, NS()) is None
    assert len(kernels) == 2 and events == [] and models == []  # traced up to the piece that fails, nothing replayed


def test_the_pieces_buffers_are_one_per_value_read_from_outside_the_pieces_at_every_size(monkeypatch):
    """`_piece_buffers`: a piece's input that no piece made, is a tensor, and is not used in place (a KV
    cache, a static input) nor a scalar gets a static buffer, once however many pieces read it, at each
    piecewise size's padded sizes (tokens, and the block table's width where a piece reads it)."""
    from ascend_compile.passes import split_pieces
    from ascend_compile.passes.providers import fresh_size
    from ascend_compile.passes.roles import Role

    mode = FakeTensorMode(shape_env=ShapeEnv())
    tokens, blocks = fresh_size(mode, 8, "tokens"), fresh_size(mode, 5, "blocks")
    graph = torch.fx.Graph()
    nodes = {}
    for name, shape, dtype in [("hidden", (tokens, 4), torch.float32), ("table", (3, blocks), torch.int32),
                               ("cache", (tokens, 2), torch.float16), ("scale", (1,), torch.float32),
                               ("weight", (6,), torch.float64), ("made", (tokens,), torch.float32)]:
        nodes[name] = graph.placeholder(name)
        with mode:
            nodes[name].meta["val"] = torch.empty(shape, dtype=dtype)
    nodes["count"] = graph.placeholder("count")
    nodes["count"].meta["val"] = tokens  # a size, not a tensor
    n = nodes
    pieces = [split_pieces.Piece([n["made"]], [n["hidden"], n["table"], n["cache"], n["count"]], [n["made"]]),
              NS(node="eager"),
              split_pieces.Piece([], [n["hidden"], n["made"], n["scale"], n["weight"]], [])]
    roles = {0: Role.BATCH, 1: Role.BLOCK_TABLE, 2: Role.KV_CACHE, 3: Role.SCALAR, 4: Role.STATIC}
    index = {n[name]: i for i, name in enumerate(["hidden", "table", "cache", "scale", "weight"])}
    keys = []
    monkeypatch.setattr(memory, "_piecewise_graph",
                        lambda rewritten, key: keys.append(key) or NS(segments=pieces, index=index, roles=roles))
    t, b = tokens.node.expr, blocks.node.expr
    signature = NS(padded_symbols=lambda bucket, max_blocks: {t: bucket, b: max_blocks})
    rewritten = NS(signature=signature, max_blocks=7, piecewise=NS(keys=[NS(bucket=16), NS(bucket=64)]))
    # hidden [T, 4] float32 and table [3, max_blocks] int32, at 16 and 64 tokens
    assert memory._piece_buffers(rewritten) == (16 * 4 * 4 + 3 * 7 * 4) + (64 * 4 * 4 + 3 * 7 * 4)
    assert [k.bucket for k in keys] == [64]
    del index[n["weight"]]  # an input the signature does not know (a value another segment made): copied
    assert memory._piece_buffers(rewritten) == (16 * 4 * 4 + 3 * 7 * 4 + 48) + (64 * 4 * 4 + 3 * 7 * 4 + 48)
