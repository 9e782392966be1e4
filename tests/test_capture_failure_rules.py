"""`lowering/capture_failures.py` at the level of its functions: which errors are the device's (and of
those, which say it ran out of memory or streams), a capture's outcome agreed by the ranks of the
groups its collectives name (one all-reduce, max, per group), and `CaptureFailures`' bookkeeping: a
failed capture logged once and counted, no new graph tried after the streams ran out, a graph captured
before still tried. Fast: no model is compiled, the ranks are stood in by a fake all-reduce
(tests/test_capture_failures.py and tests/test_tensor_parallel.py check the same end to end)."""
from __future__ import annotations

import collections
import logging

import pytest
import torch
import torch.distributed as dist
from torch import fx

from ascend_compile.errors import AscendCompileError, CaptureError
from ascend_compile.lowering import capture_failures as cf
from ascend_compile.lowering.capture_failures import (FAILED, STOOD, STREAMS_RAN_OUT, CaptureFailures, NotTried,
                                                      agreed_failure, collective_groups, device_error,
                                                      device_resource_error, first_line, specialization_error,
                                                      streams_out)

NPU_ERROR = "NPU function error: aclmdlRICaptureBegin, error code is {}\n[ERROR] 2026-01-01 more lines"
STREAMS = RuntimeError(NPU_ERROR.format(207008))


# --- which errors are the device's ----------------------------------------------------------------

@pytest.mark.parametrize("err, device, resource, out", [
    (RuntimeError(NPU_ERROR.format(507000)), True, False, False),
    (STREAMS, True, True, True),
    (RuntimeError("NPU function error: x, error code is 1, Stream resources are insufficient"), True, True, True),
    (RuntimeError("Stream resources are insufficient"), False, False, False),  # not the runtime's own words
    (RuntimeError("CUDA error: an illegal memory access"), True, False, False),
    (RuntimeError("NPU out of memory. Tried to allocate 2.00 GiB"), True, True, False),
    (torch.OutOfMemoryError("anything"), True, True, False),
    (RuntimeError("shape mismatch"), False, False, False),
    (ValueError("error code is 207008"), False, False, False),  # a Python error, whatever it says
    (CaptureError("out of memory, error code is 207008"), False, False, False),  # one of this package's
    (NotTried("not tried: the device's streams ran out"), False, False, True),
])
def test_device_errors_resources_and_streams_are_told_apart(err, device, resource, out):
    assert device_error(err) is device
    assert device_resource_error(err) is resource
    assert streams_out(err) is out


def test_the_error_code_must_be_a_number():
    assert not device_error(RuntimeError("error code is unknown"))
    assert device_error(RuntimeError("the error code is 5"))


def test_first_line_is_the_type_and_the_messages_first_line():
    assert first_line(RuntimeError(NPU_ERROR.format(507000))) == \
        "RuntimeError: NPU function error: aclmdlRICaptureBegin, error code is 507000"
    assert first_line(ValueError("\n  padded\nsecond")) == "ValueError: padded"
    assert first_line(RuntimeError()) == "RuntimeError: "


# --- collectives and the ranks' agreement ---------------------------------------------------------

def _graph(*calls: tuple) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    for target, args, kwargs in calls:
        x = graph.call_function(target, (x, *args), kwargs)
    graph.output(x)
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.fixture
def ranks(monkeypatch):
    """torch.distributed as initialised, groups resolved to their names, and an all-reduce whose other
    ranks' outcomes are `peers[group]`; the calls made land in `calls`."""
    calls, peers = [], {}

    def all_reduce(tensor, op=None, group=None):
        calls.append((group, int(tensor.item()), op, tensor.dtype, tensor.device))
        tensor.copy_(torch.maximum(tensor, torch.tensor([peers.get(group, 0)], dtype=tensor.dtype)))
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_resolve_process_group", lambda name: f"pg:{name}")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls, peers


def test_without_torch_distributed_a_graph_names_no_group():
    gm = _graph((torch.ops._c10d_functional.all_reduce.default, ("sum", "tp"), {}))
    assert not dist.is_initialized() and collective_groups(gm) == []


def test_the_groups_a_graphs_collectives_name_once_each_in_name_order(ranks):
    c10d = torch.ops._c10d_functional
    gm = _graph((c10d.all_reduce.default, ("sum", "tp"), {}),
                (c10d.all_reduce, ("sum",), {"group_name": "dp"}),  # a packet, the group as a keyword
                (torch.ops.aten.relu.default, (), {}),
                (c10d.all_gather_into_tensor.default, (2, "tp"), {}))
    assert collective_groups(gm) == ["pg:dp", "pg:tp"]
    assert collective_groups(_graph((torch.ops.aten.relu.default, (), {}))) == []
    assert collective_groups(_graph((torch.relu, (), {}))) == []  # a Python function: no schema to read


def test_a_call_module_named_like_a_collective_is_no_collective(ranks):
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_method("relu", (x,)))
    assert collective_groups(fx.GraphModule(torch.nn.Module(), graph)) == []


def test_the_outcome_is_the_worst_over_every_group_one_all_reduce_each(ranks):
    calls, peers = ranks
    peers.update({"pg:dp": FAILED, "pg:tp": STOOD})
    assert agreed_failure(STOOD, ["pg:tp", "pg:dp"], torch.device("cpu")) == FAILED
    assert [(g, v) for g, v, *_ in calls] == [("pg:tp", STOOD), ("pg:dp", STOOD)]
    assert all(op == dist.ReduceOp.MAX and dtype == torch.int32 and device == torch.device("cpu")
               for *_, op, dtype, device in calls)
    calls.clear()
    peers.update({"pg:dp": FAILED, "pg:tp": STREAMS_RAN_OUT})
    assert agreed_failure(STOOD, ["pg:dp", "pg:tp"], torch.device("cpu")) == STREAMS_RAN_OUT
    assert [v for _, v, *_ in calls] == [STOOD, FAILED]  # each group gets the outcome agreed so far
    assert agreed_failure(STREAMS_RAN_OUT, ["pg:dp"], torch.device("cpu")) == STREAMS_RAN_OUT
    assert agreed_failure(FAILED, [], torch.device("cpu")) == FAILED
    assert (STOOD, FAILED, STREAMS_RAN_OUT) == (0, 1, 2)


# --- CaptureFailures --------------------------------------------------------------------------------

def _failures() -> CaptureFailures:
    return CaptureFailures(collections.Counter(), torch.device("cpu"))


PLAIN = _graph((torch.ops.aten.relu.default, (), {}))
TP = _graph((torch.ops._c10d_functional.all_reduce.default, ("sum", "tp"), {}))


def test_a_capture_that_stood_is_remembered(caplog):
    failures = _failures()
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        assert failures.settle("b4.decode", PLAIN, None) is None
    assert failures.captured == {"b4.decode"} and failures.graphs == {} and not failures.stats
    assert failures.streams_out is None and not caplog.records


def test_a_capture_failed_on_the_device_is_logged_once_and_counted(caplog):
    failures = _failures()
    err = RuntimeError(NPU_ERROR.format(507000))
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        why = failures.settle("b4.decode", PLAIN, err)
    assert why == ("b4.decode: its capture failed on the device (RuntimeError: NPU function error: "
                   "aclmdlRICaptureBegin, error code is 507000)")
    assert failures.graphs == {"b4.decode": why} and failures.captured == set()
    assert failures.stats == {"failed_captures": 1} and failures.streams_out is None
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.name == "ascend_compile"
    assert record.getMessage() == (f"ascend_compile: {why}: its steps are served piecewise or eagerly; "
                                   "every other graph is still captured")
    failures.begin("b8.decode")  # other graphs are still tried


def test_after_the_streams_ran_out_no_graph_not_yet_captured_is_tried(caplog):
    failures = _failures()
    assert failures.settle("b4.decode", PLAIN, None) is None
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        why = failures.settle("b8.decode", PLAIN, STREAMS)
    assert why.startswith("b8.decode: its capture failed on the device (RuntimeError: ")
    assert failures.streams_out == "the device's streams ran out at the capture of b8.decode"
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.getMessage().endswith(
        "the device has no stream left: no graph not yet captured is tried again, their steps are served on "
        "pieces already captured, else eagerly")
    failures.begin("b4.decode")  # captured before: its old graph gives its stream back
    with pytest.raises(NotTried, match="^not tried: the device's streams ran out at the capture of b8.decode$"):
        failures.begin("b16.decode")
    with pytest.raises(NotTried):
        failures.begin("b8.decode")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        why = failures.settle("b16.decode", PLAIN, NotTried("not tried: the device's streams ran out at b8"))
    assert why == "b16.decode: not tried: the device's streams ran out at b8"
    assert failures.graphs["b16.decode"] == why
    assert failures.stats == {"failed_captures": 1, "captures_not_tried": 1}
    (record,) = caplog.records
    assert record.levelno == logging.DEBUG and record.getMessage() == f"ascend_compile: {why}"
    failures.settle("b32.decode", PLAIN, RuntimeError("NPU function error: y, Stream resources are insufficient"))
    assert failures.streams_out == "the device's streams ran out at the capture of b8.decode"  # the first stays
    assert failures.stats["failed_captures"] == 2


def test_a_capture_that_failed_on_another_rank_fails_here(ranks, caplog):
    calls, peers = ranks
    failures = _failures()
    peers["pg:tp"] = FAILED
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        why = failures.settle("b4.decode", TP, None)
    assert why == "b4.decode: its capture failed on another rank of its collectives' groups"
    assert failures.graphs == {"b4.decode": why} and failures.stats == {"failed_captures": 1}
    assert failures.captured == set() and len(caplog.records) == 1 and calls[0][:2] == ("pg:tp", STOOD)
    peers["pg:tp"] = STREAMS_RAN_OUT
    failures.settle("b8.decode", TP, None)
    assert failures.streams_out == "the device's streams ran out at the capture of b8.decode"
    peers["pg:tp"] = STOOD
    assert failures.settle("b16.decode", TP, None) is None and failures.captured == {"b16.decode"}
    failures.settle("b32.decode", TP, STREAMS)
    assert calls[-1][:2] == ("pg:tp", STREAMS_RAN_OUT)  # this rank's own outcome goes in


def test_a_graph_without_collectives_decides_alone(ranks):
    calls, peers = ranks
    peers["pg:tp"] = FAILED
    assert _failures().settle("b4.decode", PLAIN, None) is None and calls == []


def test_device_failure_returns_the_devices_errors_and_raises_the_rest():
    failures = _failures()
    err = RuntimeError(NPU_ERROR.format(507000))
    assert failures.device_failure("b4", 4, (("s0", 3),), err) is err
    not_tried = NotTried("not tried")
    assert failures.device_failure("b4", 4, (), not_tried) is not_tried
    ours = CaptureError("ours")
    with pytest.raises(CaptureError) as raised:
        failures.device_failure("b4", 4, (("s0", 3),), ours)
    assert raised.value is ours
    plain = RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError) as raised:
        failures.device_failure("b4", 4, (), plain)
    assert raised.value is plain
    with pytest.raises(CaptureError) as raised:
        failures.device_failure("b4.decode", 4, (("s0", 3), ("s1", 7)), plain)
    assert raised.value.__cause__ is plain
    assert str(raised.value) == str(specialization_error("b4.decode", 4, (("s0", 3), ("s1", 7)), plain))


def test_a_specialization_error_names_the_sizes_kept_and_the_cure():
    err = specialization_error("b8.decode", 8, (("s0", 3), ("s1", 7)), ValueError("boom"))
    assert isinstance(err, CaptureError) and isinstance(err, AscendCompileError)
    assert str(err) == (
        "capturing b8.decode failed: the graph pads the step to 8 tokens and keeps the sizes s0=3, s1=7 as seen; "
        "one of them may be a step size the model never equates with the token count (e.g. positions [T, 1] "
        "beside ids [T] when every size is symbolic): name the step dims "
        "(`ascend_compile.compile(model, options, step_dims=...)`). The capture's error: boom")


def test_a_new_record_starts_empty():
    stats = collections.Counter()
    failures = CaptureFailures(stats, torch.device("cpu"))
    assert failures.stats is stats and failures.device == torch.device("cpu")
    assert (failures.graphs, failures.captured, failures.streams_out) == ({}, set(), None)
    failures.begin("anything")
    assert cf.log.name == "ascend_compile"


def test_the_ranks_flag_is_made_on_the_artifacts_device_not_the_default_one(ranks, monkeypatch):
    """The flag each rank all-reduces lives on the artifact's device (the backend's collectives run there),
    whatever `torch.set_default_device` says: here the default is the meta device, the artifact's the CPU."""
    devices = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: devices.append(tensor.device))
    torch.set_default_device("meta")
    try:
        assert agreed_failure(STOOD, ["pg:tp"], torch.device("cpu")) == STOOD
        assert _failures().settle("b4.decode", TP, None) is None
    finally:
        torch.set_default_device(None)
    assert devices == [torch.device("cpu")] * 2
