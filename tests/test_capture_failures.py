"""A capture the device refuses costs that one graph (issue 48, item 2): the simulator fails chosen
captures as the device does (an error at `capture_begin`, out of memory inside, an error at
`capture_end`, `runtime/sim/faults.py`); those graphs' steps are served piecewise or eagerly, equal to
eager, one WARNING each, counted; every other graph is captured and replayed. A device out of streams
(207008) is tried for no new graph after it. Two ranks: see tests/test_tensor_parallel.py's
`sim_capture_fault` cases."""
from __future__ import annotations

import logging

import pytest
import torch

import ascend_compile
from ascend_compile.backend import backend
from ascend_compile.config import CompileConfig
from ascend_compile.lowering.capture_failures import device_error, device_resource_error
from ascend_compile.runtime.sim import SimRuntime
from ascend_compile.runtime.sim.faults import out_of_memory, streams_exhausted
from ascend_compile.targets import Target
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu

MAX_LEN = 512
#: decode steps of 3 and 7 sequences (buckets 4 and 8), a mixed step of 6 tokens (bucket 8), and steps
#: of 12 and 20 tokens, above the largest bucket: piecewise sizes 16 and 32
STEPS = [[10, 20, 30], [40, 50, 60, 70, 80, 90, 11], ([40, 300, 17], [3, 1, 2]), [5] * 12, [9] * 20, [33, 44],
         [7] * 12, [12, 13, 14, 15, 16, 17, 18]]


def _serve(faults, caplog, piecewise_sizes=(16, 32), runtime=None, steps=STEPS, **options):
    """Every step of `STEPS`, compiled on a simulator whose `faults` inject what the list says
    ((label, phase) pairs), each step checked against the model run eagerly; the artifacts."""
    cfg = LlamaConfig(num_layers=2, num_blocks=128)
    model, reference = build(cfg), build(cfg)
    sim = runtime or SimRuntime()
    for label, phase in faults:
        sim.faults.inject(label, phase=phase)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=(4, 8), piecewise_sizes=piecewise_sizes, **options)
    fn = ascend_compile.compile(model, backend=backend(config, on_compiled=artifacts.append,
                                                        target=lambda device, config: Target(sim)))
    batch = PagedBatch(cfg, seed=3)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ascend_compile"):
        for step in steps:
            lens, qlens = step if isinstance(step, tuple) else (step, None)
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=1e-5, rtol=1e-5)
    assert len(artifacts) == 1
    return artifacts[0]


@pytest.mark.parametrize("phase", ["begin", "inside", "end"])
def test_a_bucket_and_a_piece_size_the_device_refuses_are_served_otherwise_and_the_rest_captured(caplog, phase):
    art = _serve([("b4.decode", phase), ("p32 piece 0", phase)], caplog)
    # b4.decode: not captured, its step served piecewise (p16); p32: not captured, its step eagerly
    assert art.stats["failed_captures"] == 2
    assert set(art.failures.graphs) == {"b4.decode", "p32"}
    graphs = {entry.name: entry for entry in art.graphs.values()}
    assert graphs["b4.decode"].graph is None and "failed on the device" in graphs["b4.decode"].eager_reason
    assert graphs["b8.decode"].graph is not None and graphs["b8.decode"].replays == 2
    assert graphs["b8.mixed"].graph is not None and graphs["b8.mixed"].replays == 1
    pieces = {g.name: g for g in art.piecewise.values()}
    assert pieces["p16"].pieces and pieces["p16"].replays == 4  # b4.decode's 2 steps, the 2 of 12 tokens
    assert not pieces["p32"].pieces and pieces["p32"].eager_reason
    assert art.served[("decode", "piecewise")] == 4 and art.served[("decode", "eager")] == 1
    assert art.stats["captures"] == 2 and art.stats["piecewise_captures"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one per graph, naming it and the device's error
    assert "b4.decode" in warnings[0] and ("error code is 507000" in warnings[0] or phase != "begin")
    plan = art.describe()
    assert plan["failed_captures"] == art.failures.graphs


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_budget_of_streams_spent_costs_the_graphs_past_it_not_the_steps(caplog):
    """A device with 3 streams left (one a graph) where the compile counted on more (`graph_budget`: as
    when other work holds streams): b4.decode, b8.decode and b8.mixed are captured, then p16 is refused
    at `capture_begin` with 207008 and p32 is not tried (4 captures begun, not 5); both serve their steps
    eagerly, every step equal to eager; the full graphs keep replaying; one WARNING."""
    art = _serve([], caplog, runtime=SimRuntime(stream_budget=3), graph_budget=100)
    assert art.stats["captures"] == 3 and art.stats["failed_captures"] == 1 and art.stats["captures_not_tried"] == 1
    assert set(art.failures.graphs) == {"p16", "p32"} and "207008" in art.failures.graphs["p16"]
    assert "not tried" in art.failures.graphs["p32"]
    assert art.stats["replays"] == 5 and art.runtime.faults.held == 3 and art.runtime.faults.captures == 4
    assert len(_warnings(caplog)) == 1 and "no graph not yet captured is tried" in _warnings(caplog)[0]


def test_after_the_device_runs_out_of_streams_no_new_graph_is_tried(caplog):
    """One stream where the compile wants 5 graphs: b4.decode is captured, b8.decode refused (207008),
    and no capture is begun after it (2 in all): b8.mixed, p16 and p32 are not tried; every step equal
    to eager (b4.decode's replayed, the rest eagerly); one WARNING."""
    art = _serve([], caplog, runtime=SimRuntime(stream_budget=1), graph_budget=100)
    assert art.runtime.faults.captures == 2
    assert art.stats["captures"] == 1 and art.stats["failed_captures"] == 1 and art.stats["captures_not_tried"] == 3
    assert art.stats["piecewise_captures"] == 0 and art.stats["replays"] == 2
    assert art.served[("decode", "full")] == 2 and art.served[("mixed", "eager")] == 1
    assert len(_warnings(caplog)) == 1


def test_steps_of_a_graph_not_tried_are_served_on_pieces_already_captured(caplog):
    """p16's pieces captured first, then b4.decode takes the last stream: b8.decode is refused (207008),
    b8.mixed and p32 not tried; the steps of b8's graphs are served on p16's pieces, p32's eagerly."""
    steps = [[5] * 12, *STEPS]
    probe = _serve([], caplog, piecewise_sizes=(16,), steps=steps[:1])
    pieces = len(next(iter(probe.piecewise.values())).pieces)
    caplog.clear()
    art = _serve([], caplog, runtime=SimRuntime(stream_budget=pieces + 1), graph_budget=100, steps=steps)
    assert art.runtime.faults.captures == pieces + 2
    assert art.stats["piecewise_captures"] == 1 and art.stats["captures"] == 1
    assert "207008" in art.failures.graphs["b8.decode"] and set(art.failures.graphs) == {"b8.decode", "b8.mixed", "p32"}
    assert art.served[("decode", "piecewise")] == 5 and art.served[("mixed", "piecewise")] == 1
    assert art.served[("decode", "eager")] == 1  # the 20 tokens: p32 not tried


def test_a_graph_captured_before_the_streams_ran_out_is_captured_again_when_its_inputs_move(caplog):
    """b4.decode captured, b8.decode refused (207008); then the KV cache is replaced: b4.decode, whose
    old graph gives its stream back, is captured again and replays; b8.decode is still not tried."""
    cfg = LlamaConfig(num_layers=2, num_blocks=128)
    model, reference = build(cfg), build(cfg)
    sim = SimRuntime(stream_budget=1)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=(4, 8), piecewise_sizes=(16,), graph_budget=100)
    fn = ascend_compile.compile(model, backend=backend(config, on_compiled=artifacts.append,
                                                        target=lambda device, config: Target(sim)))
    batch = PagedBatch(cfg, seed=3)
    with torch.no_grad():
        for lens in ([10, 20, 30], [40, 50, 60, 70, 80, 90, 11], "new cache", [11, 21, 31], [41, 51, 61, 71, 81]):
            if lens == "new cache":
                for m in (model, reference):
                    m.layers[0].attn.key_cache = m.layers[0].attn.key_cache.clone()
                continue
            inputs = batch.step(lens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=1e-5, rtol=1e-5)
    art = artifacts[-1]
    assert art.stats["recaptures"] == 1 and art.stats["captures"] == 2 and art.served[("decode", "full")] == 2
    assert sim.faults.captures == 3  # b4.decode, b8.decode (refused), b4.decode again


def test_a_graph_freed_gives_its_stream_back():
    rt = SimRuntime(stream_budget=1)
    x = rt.empty((4,), torch.float32).fill_(1.0)
    with (g := rt.graph("a")).capture():
        x.add_(1)
    with pytest.raises(RuntimeError, match="error code is 207008") as err, rt.graph("b").capture():
        pass
    assert device_error(err.value) and device_resource_error(err.value)
    del g
    with (g := rt.graph("c")).capture():
        x.add_(1)
    assert rt.faults.held == 1


def test_the_device_errors_and_ours_are_told_apart():
    assert device_resource_error(streams_exhausted("x")) and device_resource_error(out_of_memory("x"))
    assert device_error(RuntimeError("NPU function error: aclnnAdd, error code is 507015")) and not device_resource_error(
        RuntimeError("NPU function error: aclnnAdd, error code is 507015"))
    assert not device_error(RuntimeError("The size of tensor a (4) must match the size of tensor b (8)"))
    assert not device_error(ascend_compile.errors.CaptureError("out of memory in our own words"))


@pytest.mark.parametrize("phase", ["begin", "inside"])
def test_on_npu_a_capture_refused_costs_that_graph(monkeypatch, caplog, phase):
    """Runtime "npu" on the fake torch_npu, whose graphs are the simulator's: the second capture
    (b8.decode, after b4.decode) refused at `capture_begin` with 207008, or out of memory inside it
    (after the eager warm-up, where any other error of an op would make it an uncapturable op); its
    steps served piecewise, the other graph's replayed."""
    fake = fake_torch_npu.install(monkeypatch)
    fake.sim.faults.inject(after=1, phase=phase, error=streams_exhausted if phase == "begin" else None)
    cfg = LlamaConfig(num_layers=2, num_blocks=128, block_size=128, dtype=torch.bfloat16)
    model, reference = build(cfg), build(cfg)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=(4, 8), piecewise_sizes=(16,), runtime="npu",
                           pa_max_batch=4)
    fn = ascend_compile.compile(model, backend=backend(config, on_compiled=artifacts.append))
    batch = PagedBatch(cfg, seed=3)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ascend_compile"):
        for lens in ([10, 20, 30], [40, 50, 60, 70, 80, 90, 11], [7] * 6):
            inputs = batch.step(lens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-2, rtol=2e-2)
    art = artifacts[0]
    assert art.stats["captures"] == 1 and art.stats["failed_captures"] >= 1
    assert ("207008" if phase == "begin" else "out of memory") in art.failures.graphs["b8.decode"]
    assert art.served[("decode", "full")] == 1 and not art.uncapturable
