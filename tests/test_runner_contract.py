"""The runner's contract, at the artifact (`lowering/runner.py`, with `piecewise_serve.py`): what serves
each step (a full graph, the pieces of the smallest piecewise size holding it, else eager) and why, each
reason logged once and counted; the step's counters; a step that raises counted, logged and noted with
the graph that ran it; `capture_all` capturing every decode bucket at the first capture. The two-layer
example Llama on the simulator: each test compiles in about a second."""
from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import fx

from ascend_compile.lowering.graph_entry import GraphEntry
from ascend_compile.lowering.piecewise import PiecewiseGraph
from examples.llama import PagedBatch
from tests.test_failed_steps import assert_close
from tests.test_piecewise import _compile, _llama

NO_GRAPH = "no graph for {} tokens in {} sequences (buckets [4, 8])"


class Raised(RuntimeError):
    """The failure a test puts into a step."""


class RaisedWithoutNotes(RuntimeError):
    """A failure without `add_note`, as every exception before Python 3.11: raised as it is."""

    @property
    def add_note(self):
        raise AttributeError("add_note")


def _steps(fn, reference, batch, steps):
    with torch.no_grad():
        for lens, qlens in steps:
            inputs = batch.step(lens, qlens)
            assert_close(fn(**inputs), reference(**inputs))


def test_each_step_is_served_by_a_full_graph_the_pieces_or_eagerly_each_reason_logged_once(caplog):
    """Buckets 4 and 8, piecewise sizes 16, 32 and 64: decodes in a bucket replay the full graph; a 40-token
    prefill goes to the p64 pieces (captured once); a 100-token prefill, above both, runs eagerly. Every
    step is counted with its host conversions (two length inputs each, no host copy); each reason is
    counted per step and logged once (the 41-token prefill of 40 query tokens gives the
    same reason as the first); every step equals eager."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", piecewise_sizes=[16, 32, 64])
    batch = PagedBatch(cfg, seed=4)
    steps = [([5, 9], None), ([40], [40]), ([100], [100]), ([6, 10], None), ([41], [40]), ([101], [100])]
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        _steps(fn, reference, batch, steps)
    art = artifacts[-1]
    stats = art.stats
    assert (stats["steps"], stats["host_conversions"], stats["host_copies"]) == (6, 12, 0), stats
    assert (stats["captures"], stats["replays"], stats["updates"]) == (1, 2, 4), stats
    assert (stats["piecewise_captures"], stats["piecewise_steps"], stats["eager_fallbacks"]) == (1, 2, 2), stats
    assert stats["failed_steps"] == 0 and stats["recaptures"] == 0, stats
    assert art.served == {("decode", "full"): 2, ("prefill", "piecewise"): 2, ("prefill", "eager"): 2}
    piecewise = NO_GRAPH.format(40, 1)
    eager = f"{NO_GRAPH.format(100, 1)}; above the largest piecewise size (64 tokens)"
    assert art.not_full == {piecewise: 2, eager: 2}  # the reason names the query tokens: the same twice
    assert caplog.text.count(f"ascend_compile: {piecewise}: serving it piecewise (p64)") == 1
    assert caplog.text.count(f"ascend_compile: {eager}: running eagerly") == 1
    assert [str(k) for k, _ in art.graphs] == ["b4.decode"] and [str(k) for k, _ in art.piecewise] == ["p64"]
    assert art.seconds["host"] > 0 and art.seconds["launch_and_updates"] > 0, art.seconds
    assert art.pieces.launches["replays"] == 2 * len(next(iter(art.piecewise.values())).pieces)


@pytest.mark.parametrize("options, why", [
    (dict(runtime="sim", piecewise_sizes=[]), "piecewise_sizes is empty"),
    (dict(runtime="eager"), "the runtime captures no graphs"),
])
def test_without_piecewise_graphs_a_step_no_bucket_holds_runs_eagerly_saying_why(options, why, caplog):
    """No piecewise variant (none asked, or a runtime without graphs): the step runs eagerly, the reason
    naming why there are no pieces; the decode step in a bucket is still served as full."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, **options)
    batch = PagedBatch(cfg, seed=4)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        _steps(fn, reference, batch, [([5, 9], None), ([40], [40])])
    art = artifacts[-1]
    reason = f"{NO_GRAPH.format(40, 1)}; not piecewise: {why}"
    assert art.not_full == {reason: 1} and art.served == {("decode", "full"): 1, ("prefill", "eager"): 1}
    assert art.stats["eager_fallbacks"] == 1 and art.stats["piecewise_steps"] == 0
    assert f"ascend_compile: {reason}: running eagerly" in caplog.text
    art.rewritten.piecewise_reason = None  # no reason given (not from the passes): the default one
    _steps(fn, reference, batch, [([41], [41])])
    assert art.not_full[f"{NO_GRAPH.format(41, 1)}; not piecewise: the runtime has no graphs"] == 1
    if options["runtime"] == "eager":  # the counters of work outside graphs are shown even at 0
        shown = ("launches_outside_graph", "saved_bytes", "synchronizes")
        assert set(shown) <= set(art.stats) and all(art.stats[k] == 0 for k in shown), art.stats


def test_capture_all_captures_every_decode_bucket_largest_first_at_the_first_capture(caplog, monkeypatch):
    """`capture_all`: the first step captures the decode graphs of both buckets, 8 then 4 (under a
    progress bar named for it); later steps capture nothing more; a mixed step's own graph is captured
    when it comes."""
    from ascend_compile.lowering import runner

    bars = []

    def progress(items, what):
        items = list(items)
        bars.append((what, [str(k) for k in items]))
        return items

    monkeypatch.setattr(runner, "progress", progress)
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", capture_all=True)
    batch = PagedBatch(cfg, seed=4)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        _steps(fn, reference, batch, [([5, 9], None), ([6, 10, 3, 4, 7], None)])
    art = artifacts[-1]
    assert sorted(str(k) for k, _ in art.graphs) == ["b4.decode", "b8.decode"]
    assert art.stats["captures"] == 2 and art.stats["replays"] == 2, art.stats
    captured = [line.split("captured ")[1].split(" in ")[0] for line in caplog.messages if "captured b" in line]
    assert captured == ["b8.decode", "b4.decode"], caplog.messages
    assert bars == [("ascend_compile capture", ["b8.decode", "b4.decode"])]
    _steps(fn, reference, batch, [([9, 3], [2, 1])])
    assert art.stats["captures"] == 3 and sorted(str(k) for k, _ in art.graphs)[-1] == "b8.decode"


def test_a_full_graph_step_that_raises_is_counted_logged_and_names_its_graph(monkeypatch, caplog):
    """A replay raising: the error reaches the caller with a note naming the graph, one WARNING names the
    graph and the error's type, `failed_steps` counts it (an error that takes no note: raised as it is);
    the next step (replay restored) equals eager."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([5, 9], None)])
    replay = GraphEntry.replay

    def raising(*args, **kwargs):
        raise Raised("injected")

    monkeypatch.setattr(GraphEntry, "replay", raising)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ascend_compile"), \
            pytest.raises(Raised) as err:
        fn(**batch.step([6, 10], None))
    art = artifacts[-1]
    assert art.stats["failed_steps"] == 1 and art.stats["steps"] == 2, art.stats
    notes = getattr(err.value, "__notes__", [])
    assert len(notes) == 1 and notes[0].startswith("ascend_compile: b4.decode: "), notes
    assert "ascend_compile: b4.decode: the step raised Raised; " in caplog.text
    monkeypatch.setattr(GraphEntry, "replay", lambda *args, **kwargs: (_ for _ in ()).throw(RaisedWithoutNotes()))
    with torch.no_grad(), pytest.raises(RaisedWithoutNotes):
        fn(**batch.step([6, 10], None))
    monkeypatch.setattr(GraphEntry, "replay", replay)
    _steps(fn, reference, batch, [([7, 11], None)])
    assert art.stats["failed_steps"] == 2 and art.stats["replays"] == 2


def test_a_piecewise_step_that_raises_names_its_pieces(monkeypatch, caplog):
    """A piecewise step raising (after its capture): noted and logged with the piecewise graph's name,
    counted; a step raising while its pieces are captured on its values: the same, said to be captured."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([40], [40])])
    art = artifacts[-1]
    name = str(next(iter(art.piecewise))[0])

    def raising(*args, **kwargs):
        raise Raised("injected")

    monkeypatch.setattr(PiecewiseGraph, "run", raising)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ascend_compile"), pytest.raises(Raised) as err:
        fn(**batch.step([41], [40]))
    assert err.value.__notes__[0].startswith(f"ascend_compile: {name}: "), err.value.__notes__
    assert f"ascend_compile: {name}: the step raised Raised; " in caplog.text
    assert art.stats["failed_steps"] == 1, art.stats
    monkeypatch.setattr(PiecewiseGraph, "capture", raising)
    caplog.clear()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ascend_compile"), pytest.raises(Raised) as err:
        fn(**batch.step([300], [300]))  # a new piecewise size: captured for this step
    key = f"p{next(s for s in art.config.piecewise_sizes if s >= 300)}"  # not kept: its capture raised
    assert key != name and [str(k) for k, _ in art.piecewise] == [name] and err.value.__notes__[0].startswith(f"ascend_compile: {key}: "), err.value.__notes__
    assert f"ascend_compile: {key}: the step raised Raised while captured; " in caplog.text
    assert re.fullmatch(rf"ascend_compile: {key}: it may have written 4 KV caches at its own slots \d+\.\.\d+ \(300 "
                        r"slots\), for its 1 sequences \(query tokens 300\), and no other row; run the same step "
                        r"again to write them anew", err.value.__notes__[0]), err.value.__notes__
    written = err.value.__notes__[0].removeprefix(f"ascend_compile: {key}: ")
    assert caplog.messages[-1] == f"ascend_compile: {key}: the step raised Raised while captured; {written}"
    assert art.stats["failed_steps"] == 2, art.stats
    monkeypatch.setattr(PiecewiseGraph, "capture", lambda *a, **k: (_ for _ in ()).throw(RaisedWithoutNotes()))
    with torch.no_grad(), pytest.raises(RaisedWithoutNotes):
        fn(**batch.step([300], [300]))
    monkeypatch.setattr(PiecewiseGraph, "run", lambda *a, **k: (_ for _ in ()).throw(RaisedWithoutNotes()))
    with torch.no_grad(), pytest.raises(RaisedWithoutNotes):
        fn(**batch.step([42], [40]))
    assert art.stats["failed_steps"] == 4, art.stats


@pytest.mark.parametrize("dispatch", ["dynamo", "direct"])
def test_a_moved_kv_cache_captures_the_full_graph_and_the_pieces_again(dispatch, caplog):
    """A KV cache replaced after a decode and a piecewise step: the next decode and piecewise steps
    capture their graphs again (logged once, counted), equal to eager. Through the direct dispatcher the
    direct call stops at the moved cache (`MovedInputs`) and the step goes through dynamo: each step
    counted once."""
    import ascend_compile
    from ascend_compile.backend import backend
    from ascend_compile.config import CompileConfig

    cfg, model, reference = _llama()
    torch._dynamo.reset()
    artifacts = []
    config = CompileConfig(max_model_len=1024, capture_sizes=(4, 8), runtime="sim")
    fn = ascend_compile.compile(model, backend=backend(config, on_compiled=artifacts.append),
                                **({"dispatch": "direct"} if dispatch == "direct" else {}))
    batch = PagedBatch(cfg, seed=6)
    _steps(fn, reference, batch, [([5, 9], None), ([40], [40])])
    for m in (model, reference):
        m.layers[0].attn.key_cache = m.layers[0].attn.key_cache.clone()
        m.layers[1].down.weight = torch.nn.Parameter(m.layers[1].down.weight * 1.5)  # a new weight too
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        _steps(fn, reference, batch, [([6, 10], None), ([41], [40])])
    assert len(artifacts) == 1
    stats = artifacts[-1].stats
    assert (stats["steps"], stats["host_conversions"]) == (4, 8), stats
    assert (stats["recaptures"], stats["captures"], stats["piecewise_captures"]) == (2, 2, 2), stats
    assert (stats["replays"], stats["piecewise_steps"]) == (2, 2), stats
    assert caplog.text.count("moved since b4.decode was captured: re-capturing it") == 1
    assert "1 KV cache input" in caplog.text and "1 parameter" in caplog.text, caplog.text
    if dispatch == "direct":  # the direct call named what moved, and went through dynamo
        assert "in-place inputs moved since their graph was captured" in caplog.text
        assert "l_self_modules_layers_modules_0_modules_attn_buffers_key_cache_" in caplog.text


def test_verify_every_checks_the_first_replay_and_every_nth_of_full_and_piecewise_graphs():
    """`verify_every=2`: replays 1, 3 and 5 of the full graph and steps 1, 3 and 5 of the pieces are
    checked against eager, each record naming its replay; none differs."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", verify=True, verify_every=2)
    batch = PagedBatch(cfg, seed=6)
    _steps(fn, reference, batch, [([5, 9], None)] * 5 + [([40], [40])] * 5)
    art = artifacts[-1]
    assert (art.stats["verified_replays"], art.stats["verify_failures"]) == (6, 0), art.stats
    (entry,), (graph,) = art.graphs.values(), art.piecewise.values()
    assert entry.verified["ok"] and entry.verified["replay"] == 5 and entry.replays == 5
    assert graph.verified["ok"] and graph.verified["replay"] == 5 and graph.replays == 5
    assert entry.eager_reason is None and graph.eager_reason is None
    assert art.served == {("decode", "full"): 5, ("prefill", "piecewise"): 5}


def test_an_op_a_piece_capture_refuses_is_run_between_pieces_and_no_full_graph_tries_it(monkeypatch, caplog):
    """An uncapturable op (`test_uncapturable.host_gate`, a host read) first met in a piece's capture: the
    pieces are split again around it (every layer's call run between pieces), one WARNING names it, and
    the decode graph holding it is never tried (no capture, not counted as a failed one): its steps go
    to the pieces, the reason naming the op. Without piecewise graphs the decode graph's own capture
    meets it: counted, warned without the pieces' clause, its steps eager."""
    from examples import llama
    from ascend_compile.passes.split_pieces import EagerNode
    from tests import test_uncapturable

    monkeypatch.setattr(llama.Attention, "attend", test_uncapturable._attend)
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=6)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        _steps(fn, reference, batch, [([40], [40]), ([5, 9], None), ([6, 10], None)])
    art = artifacts[-1]
    (why,) = art.uncapturable.values()
    assert why.startswith("uncapturable_test.host_gate (node ") and " cannot be captured: Tensor.tolist()" in why
    assert caplog.messages == [f"ascend_compile: {why}: graphs holding it run their steps eagerly; piecewise "
                               f"graphs run it eagerly"]
    stats = art.stats
    assert (stats["captures"], stats["uncapturable_graphs"], stats["eager_fallbacks"]) == (0, 0, 0), stats
    assert (stats["piecewise_captures"], stats["piecewise_steps"]) == (2, 3), stats
    assert art.not_full == {NO_GRAPH.format(40, 1): 1, f"b4.decode: not captured, {why}": 2}
    assert {str(k): e.eager_reason for (k, _), e in art.graphs.items()} == {"b4.decode": f"b4.decode: not captured, {why}"}
    for graph in art.piecewise.values():
        eager = [s.why for s in graph.segments if isinstance(s, EagerNode)]
        assert eager.count("uncapturable_test.host_gate cannot be captured") == 2, eager

    caplog.clear()
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", piecewise_sizes=[])
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        _steps(fn, reference, batch, [([5, 9], None), ([6, 10], None)])
    art = artifacts[-1]
    (why,) = art.uncapturable.values()
    assert caplog.messages == [f"ascend_compile: {why}: graphs holding it run their steps eagerly"]
    assert (art.stats["uncapturable_graphs"], art.stats["eager_fallbacks"], art.stats["captures"]) == (1, 2, 0)
    assert art.not_full == {f"b4.decode: not captured, {why}; not piecewise: piecewise_sizes is empty": 2}


def test_a_capture_the_device_refuses_costs_that_graph_and_that_piece_size_only(caplog):
    """The simulator refusing b4.decode's capture and p32's second piece (an error inside each): b4's steps
    go to the p16 pieces, p32's eagerly, its pieces freed; b8.decode is captured and replays; each
    refused graph counted and warned once, not counted as captured."""
    from tests.test_capture_failures import _serve

    steps = [[10, 20, 30], [5] * 20, [40, 50, 60, 70, 80, 90, 11], [11, 21, 31], [6] * 20]
    art = _serve([("b4.decode", "inside"), ("p32 piece 1", "inside")], caplog, steps=steps)
    assert set(art.failures.graphs) == {"b4.decode", "p32"} and art.stats["failed_captures"] == 2
    graphs = {entry.name: entry for entry in art.graphs.values()}
    assert graphs["b4.decode"].graph is None and "failed on the device" in graphs["b4.decode"].eager_reason
    assert graphs["b8.decode"].graph is not None and graphs["b8.decode"].replays == 1
    pieces = {g.name: g for g in art.piecewise.values()}
    assert pieces["p16"].replays == 2 and pieces["p32"].pieces == [] and pieces["p32"].produced == {}
    assert "failed on the device" in pieces["p32"].eager_reason and pieces["p32"].describe()["capture_seconds"] == 0
    assert (art.stats["captures"], art.stats["piecewise_captures"]) == (1, 1), art.stats
    assert art.served == {("decode", "piecewise"): 2, ("decode", "eager"): 2, ("decode", "full"): 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "b4.decode" in warnings[0] and "p32" in warnings[1], warnings


@pytest.mark.parametrize("clone", [True, False])
def test_outputs_are_the_callers_own_unless_clone_outputs_is_off_and_host_seconds_leave_out_the_device(clone):
    """A full graph's and a piecewise graph's outputs survive the next step of the same graph (copies of
    the static outputs), or under `clone_outputs=False` are those static outputs (the next step writes
    them). The host seconds of steps are at most their wall time less the device's; the host's waits
    are counted."""
    import time

    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", clone_outputs=clone)
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([5, 9], None), ([40], [40])])  # both graphs captured
    art = artifacts[-1]
    before, wall = dict(art.seconds), 0.0
    waits, counted = art.runtime.synchronizes, art.stats["synchronizes"]
    for lens, qlens in [([5, 9], None), ([40], [40])]:
        with torch.no_grad():
            first_inputs = batch.step(lens, qlens)
            start = time.perf_counter()
            first = fn(**first_inputs)
            wall += time.perf_counter() - start
            want = reference(**first_inputs)
            kept = first.clone()
            start = time.perf_counter()
            second = fn(**batch.step([n + 1 for n in lens], qlens))
            wall += time.perf_counter() - start
        assert (first.data_ptr() == second.data_ptr()) is not clone
        assert_close(kept, want)
        if clone:
            assert_close(first, want)  # untouched by the second step
    host = art.seconds["host"] - before["host"]
    device = art.seconds.device - sum(before[k] for k in before if k != "host")
    assert 0 < host and 0 < device and host + device <= wall, (host, device, wall)
    # the host's waits for the device inside these steps, each counted once
    assert art.stats["synchronizes"] - counted == art.runtime.synchronizes - waits > 0, art.stats


@pytest.mark.parametrize("runtime", ["sim", "eager"])
def test_a_key_captures_up_to_max_specializations_values_of_a_specialized_size(runtime, caplog):
    """A caller's buffer of fixed width under `dynamic=True` (a specialized size): bucket 4 captures widths
    20 and 30 (each logged), a third width runs eagerly saying why; the p16 pieces too, where the runtime
    has graphs; the buffer written as eager writes it (the eager runtime locating the write)."""
    from tests.test_runtime_graphs import Caller, compiled, make_step

    torch._dynamo.reset()
    body = "buf[0, :n].copy_(tokens)\nreturn logits"
    fn, artifacts = compiled(make_step(body), dynamic=True, max_specializations=2, runtime=runtime)
    reference, caller = make_step(body), Caller(0)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="ascend_compile"):
        for size, width in ((3, 20), (3, 30), (3, 40), (3, 20), (9, 20), (9, 30), (9, 40)):
            inputs = caller.step(size)
            got, want = torch.zeros(1, width, dtype=torch.int64), torch.zeros(1, width, dtype=torch.int64)
            assert_close(fn(**inputs, buf=got), reference(**inputs, buf=want))
            assert torch.equal(got, want)
    art = artifacts[-1]
    (symbol,) = [str(s) for s in art.signature.specialized]
    assert sorted((str(k), s) for k, s in art.graphs) == [("b4.decode", ((symbol, 20),)), ("b4.decode", ((symbol, 30),))]
    full = f"b4.decode already has 2 captures for other values of ['{symbol}']"
    assert caplog.messages.count(f"ascend_compile: b4.decode: new specialized sizes {{'{symbol}': 20}}: capturing it") == 1
    assert caplog.messages.count(f"ascend_compile: b4.decode: new specialized sizes {{'{symbol}': 30}}: capturing it") == 1
    nine = "no graph for 9 tokens in 9 sequences (buckets [1, 2, 4, 8])"
    if runtime == "eager":
        assert art.not_full == {full: 1, f"{nine}; not piecewise: the runtime captures no graphs": 3}
        assert art.stats["eager_fallbacks"] == 4 and art.served == {("decode", "full"): 3, ("decode", "eager"): 4}
        return
    assert art.not_full == {full: 1, nine: 2, f"{nine}; p16 already has 2 captures for other values of the "
                                              f"specialized sizes": 1}
    assert sorted((str(k), s) for k, s in art.piecewise) == [("p16", ((symbol, 20),)), ("p16", ((symbol, 30),))]
    assert [g.name for g in art.piecewise.values()] == [f"p16[{symbol}=20]", f"p16[{symbol}=30]"]
    assert (art.stats["captures"], art.stats["piecewise_captures"], art.stats["eager_fallbacks"]) == (2, 2, 2)


def test_under_save_cache_rows_each_step_saves_its_own_cache_rows_counted():
    """`save_cache_rows`: each step, full or piecewise, saves the rows of its slots in every KV cache
    (4 caches of 2 heads x 16 float32: 128 bytes a row) before it runs, the saves counted as launches
    outside the graph; by default nothing is saved and both counts stay 0."""
    for save, rows in ((True, (2, 40)), (False, (0, 0))):
        cfg, model, reference = _llama()
        fn, artifacts = _compile(model, runtime="sim", save_cache_rows=save)
        batch = PagedBatch(cfg, seed=4)
        _steps(fn, reference, batch, [([5, 9], None)])
        stats = artifacts[-1].stats
        assert stats["saved_bytes"] == 4 * rows[0] * 128 and (stats["launches_outside_graph"] > 0) is save, stats
        launches = stats["launches_outside_graph"]
        _steps(fn, reference, batch, [([40], [40])])
        assert stats["saved_bytes"] == 4 * sum(rows) * 128 and stats["piecewise_steps"] == 1, stats
        assert stats["launches_outside_graph"] == 2 * launches, stats  # as many saves per step


def test_a_full_graph_whose_checked_replay_differs_serves_no_later_step(caplog):
    """`verify_every=1`; from the second step on the task updates are skipped (stale lengths): that
    replay differs from eager, eager's result is returned, and the graph serves no later step (its
    steps go to the pieces, the reason naming the replay and the first mismatch)."""
    from tests.test_verify import RecordOnly

    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", verify=True, verify_every=1)
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([5, 9], None)])
    art = artifacts[-1]
    art.target.updates = RecordOnly()
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        _steps(fn, reference, batch, [([6, 10], None), ([7, 11], None)])
    assert "ascend_compile: b4.decode: first replay differs from eager: output 0" in caplog.text  # named
    (entry,) = art.graphs.values()
    assert entry.verified["replay"] == 2 and not entry.verified["ok"] and entry.replays == 2
    reason = f"b4.decode: its replay 2 differed from eager ({entry.verified['mismatches'][0]})"
    assert entry.eager_reason == reason and art.not_full == {reason: 1}
    assert (art.stats["verified_replays"], art.stats["verify_failures"], art.stats["replays"]) == (3, 1, 2)
    assert art.served == {("decode", "full"): 2, ("decode", "piecewise"): 1}


@pytest.mark.parametrize("scale, ok", [(1.5, True), (2.5, False)])
def test_a_replay_is_checked_within_the_tolerance_of_the_graphs_depth(monkeypatch, scale, ok):
    """A four-layer graph whose first replay returns logits off by `scale` times float32's one-layer row
    tolerance: within the tolerance of four layers (twice one layer's, `verify.row_tolerance`) the graph
    keeps serving; past it, the replay is refused and eager's result returned."""
    from ascend_compile.lowering.runner import CompiledArtifact
    from ascend_compile.lowering.verify import ROW_TOLERANCE

    replay = CompiledArtifact._replay
    rtol = ROW_TOLERANCE[torch.float32][0]

    def off_by_scale(self, entry, plan):
        logits, *rest = replay(self, entry, plan)
        return (logits * (1 + scale * rtol), *rest)

    monkeypatch.setattr(CompiledArtifact, "_replay", off_by_scale)
    cfg, model, reference = _llama(num_layers=4)
    fn, artifacts = _compile(model, runtime="sim", verify=True)
    inputs = PagedBatch(cfg, seed=4).step([5, 9], None)
    with torch.no_grad():
        want, got = reference(**inputs), fn(**inputs)
    (entry,) = artifacts[-1].graphs.values()
    assert entry.verified["ok"] is ok and (entry.eager_reason is None) is ok, entry.verified
    assert_close(got, want * (1 + scale * rtol) if ok else want)


def test_a_step_with_an_input_requiring_grad_under_grad_mode_runs_as_traced():
    """The artifact called under grad mode with weights requiring grad (as dynamo 2.10's guards let
    through): the step runs as traced, its output requiring grad, counted as an eager fallback only."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    seen = []
    _steps(fn, reference, batch, [([5, 9], None)])
    art = artifacts[-1]
    call = art._call
    art._call = lambda args, direct, fixed=None: (seen.append(args), call(args, direct, fixed))[1]
    _steps(fn, reference, batch, [([6, 10], None)])
    del art._call
    args = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
            and a.dim() == 2 and a.shape[0] == a.shape[1] else a for a in seen[0]]
    assert any(getattr(a, "requires_grad", False) for a in args)
    before = dict(art.stats)
    with torch.enable_grad():
        (out,) = art(*args)
    assert out.requires_grad and out.grad_fn is not None
    assert art.stats["eager_fallbacks"] == 1 and art.stats["steps"] == before["steps"] == 2
    assert art.stats["replays"] == before["replays"] and sum(art.not_full.values()) == 0
    assert art._fallbacks_logged == {"grad mode is on and an input requires grad (autograd kept)"}
    with torch.no_grad():
        (again,) = art(*seen[0])  # the same step's arguments, no grad: replayed
    assert_close(again, out.detach())
    assert art.stats["replays"] == before["replays"] + 1


def test_an_output_viewing_a_callers_tensor_is_returned_as_that_view_full_and_piecewise():
    """`return logits, buf[0]` after writing `buf`: the second output is the caller's own row (its
    storage), as eager returns it, whether a full graph (3 tokens) or the pieces (9 tokens) served."""
    from tests.test_runtime_graphs import Caller, compiled, make_step

    torch._dynamo.reset()
    body = "buf[0, :n].copy_(tokens)\nreturn logits, buf[0]"
    fn, artifacts = compiled(make_step(body), runtime="sim")
    reference, caller = make_step(body), Caller(0)
    with torch.no_grad():
        for size in (3, 9, 9, 3):
            inputs = caller.step(size)
            got, want = torch.zeros(1, 40, dtype=torch.int64), torch.zeros(1, 40, dtype=torch.int64)
            (logits, row), (want_logits, want_row) = fn(**inputs, buf=got), reference(**inputs, buf=want)
            assert row.data_ptr() == got.data_ptr() and torch.equal(row, want_row) and torch.equal(got, want)
            assert_close(logits, want_logits)
    assert sum(a.stats["piecewise_steps"] for a in artifacts) == 2 and sum(a.stats["replays"] for a in artifacts) >= 1


def test_a_step_the_targets_guard_refuses_goes_to_the_pieces_which_run_the_attention_ops(monkeypatch):
    """A target whose step guard refuses sequences of 101-999 tokens (the capture step's 1,024 pass): the
    decode step holding one goes to the p4 pieces, whose kernels the guard refuses too, so the layers'
    attention ops run between them (counted per reason); every step equals eager."""
    from ascend_compile.targets import Target

    why = "a sequence of 101-999 tokens"
    monkeypatch.setattr(Target, "step_guard", lambda self, gm, key, config: lambda host, args: (
        why if any(100 < n < 1000 for lens in host.values() for n in lens) else None))
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([5, 9], None), ([5, 120], None), ([130], [40]), ([40], [40]), ([6, 10], None),
                                  ([7, 130], None)])
    art = artifacts[-1]
    assert art.not_full == {why: 2, NO_GRAPH.format(40, 1): 2}
    assert art.served == {("decode", "full"): 2, ("decode", "piecewise"): 2, ("prefill", "piecewise"): 2}
    assert (art.stats["replays"], art.stats["piecewise_steps"], art.stats["eager_fallbacks"]) == (2, 4, 0)
    refused = {str(k): dict(g.refusals) for (k, _), g in art.piecewise.items()}
    assert refused == {"p4": {why: 2}, "p64": {why: 1}}  # each refused step once (p4: its capture's, then another)


def test_a_staged_input_overlapping_one_the_graph_writes_runs_eagerly_saying_which(caplog):
    """The caller's buffer a view of the value cache (`test_audit36_survivors.WritesBeforeAttending`): the
    step runs eagerly, the reason naming the overlapping inputs, each step counted; a buffer of its own
    (no overlap) is replayed."""
    from tests.test_audit36_survivors import WritesBeforeAttending, _rows_of_first_block
    from tests.test_runtime_graphs import Caller, compiled

    torch._dynamo.reset()
    model, reference = WritesBeforeAttending(), WritesBeforeAttending()
    fn, artifacts = compiled(model, runtime="sim")
    caller = Caller(0)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="ascend_compile"):
        for size in (3, 3):
            inputs = caller.step(size)
            got = fn(**inputs, buf=_rows_of_first_block(model, inputs["block_table"]))
            assert_close(got, reference(**inputs, buf=_rows_of_first_block(reference, inputs["block_table"])))
            assert_close(model.value_cache, reference.value_cache)
        inputs = caller.step(3)
        own = torch.zeros_like(_rows_of_first_block(model, inputs["block_table"]))
        assert_close(fn(**inputs, buf=own), reference(**inputs, buf=own.clone()))
    art = artifacts[-1]
    (why,) = art.not_full
    assert why.startswith("inputs [") and why.endswith("] overlap in memory and the graph writes one of them"), why
    assert art.not_full[why] == 2 and art.served[("decode", "eager")] == 2 and art.stats["eager_fallbacks"] == 2
    assert caplog.text.count(f"{why}: running eagerly") == 1 and art.stats["steps"] == 3
    assert art.served[("decode", "full")] == 1 and art.stats["replays"] == 1, art.stats


def test_plan_json_says_what_was_captured_and_served_and_a_runtime_verifying_by_default_verifies(tmp_path):
    """With `dump_dir`: plan.json names the captured decode graph and piecewise size; the artifact's
    `describe` and `memory_report` answer. A runtime whose first replays are verified by default (as the
    devices') verifies them with `verify` unset; `verify=False` turns it off."""
    import glob
    import json

    import ascend_compile
    from ascend_compile.backend import backend
    from ascend_compile.config import CompileConfig
    from ascend_compile.runtime.sim import SimRuntime
    from ascend_compile.targets import Target

    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", dump_dir=str(tmp_path))
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([5, 9], None), ([40], [40])])
    art = artifacts[-1]
    (path,) = glob.glob(str(tmp_path / "**" / "plan.json"), recursive=True)
    plan = json.loads(open(path).read())
    assert plan["graphs"]["b4.decode"]["capture_seconds"] > 0 and "update_table" in plan["graphs"]["b4.decode"]
    assert plan["piecewise"]["graphs"]["p64"]["captured"] is True
    described = art.describe()
    assert described["piecewise"]["graphs"]["p64"]["replays"] == 1 and "workspace_group" not in described
    assert set(art.memory_report()) == {"workspace_bytes", "graphs", "piecewise", "pool"}

    for verify, checked in ((None, 2), (False, 0)):
        sim = SimRuntime()
        sim.verify_first_replays = True
        cfg, model, reference = _llama()
        torch._dynamo.reset()
        artifacts = []
        config = CompileConfig(max_model_len=1024, capture_sizes=(4, 8), verify=verify)
        fn = ascend_compile.compile(model, backend=backend(config, on_compiled=artifacts.append,
                                                            target=lambda device, config: Target(sim)))
        _steps(fn, reference, PagedBatch(cfg, seed=4), [([5, 9], None), ([40], [40]), ([6, 10], None)])
        assert artifacts[-1].stats["verified_replays"] == checked, (verify, artifacts[-1].stats)


def test_a_step_of_exactly_a_piecewise_size_runs_on_that_size():
    """16 and 64 query tokens: the p16 and p64 pieces (the smallest size holding the step), not eager."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", piecewise_sizes=[16, 64])
    _steps(fn, reference, PagedBatch(cfg, seed=4), [([16], [16]), ([64], [64]), ([70], [64])])
    art = artifacts[-1]
    assert sorted(str(k) for k, _ in art.piecewise) == ["p16", "p64"]
    assert art.stats["piecewise_steps"] == 3 and art.stats["eager_fallbacks"] == 0, art.stats


def test_kernels_the_target_refuses_every_step_leave_full_graphs_uncaptured_and_pieces_on_the_attention_ops(
        monkeypatch):
    """A target refusing every graph's kernels (`Target.eager_reason`): no full graph is captured, its steps
    going to the pieces (the reason the target's), whose layers' attention ops run between them instead
    of the kernels; every step equals eager."""
    from ascend_compile.targets import Target

    monkeypatch.setattr(Target, "eager_reason", lambda self, gm, key: f"{key}: its kernels are refused")
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    _steps(fn, reference, PagedBatch(cfg, seed=4), [([5, 9], None), ([40], [40]), ([6, 10], None)])
    art = artifacts[-1]
    assert (art.stats["captures"], art.stats["piecewise_captures"], art.stats["piecewise_steps"]) == (0, 2, 3)
    assert art.not_full == {"b4.decode: its kernels are refused": 2, NO_GRAPH.format(40, 1): 1}
    assert {g.name: (g.kernels_refused, g.eager_reason, g.replays) for g in art.piecewise.values()} == {
        "p4": ("p4: its kernels are refused", None, 2), "p64": ("p64: its kernels are refused", None, 1)}


def test_inputs_aliasing_each_other_where_none_is_staged_and_written_are_replayed():
    """Two layers sharing one KV cache (views of it: written in place, not staged) and positions a view of
    the token ids (staged, not written): aliasing that no staged copy can break, so every step is replayed
    (the overlap check is for a staged input aliasing one the graph writes); equal to eager."""
    from tests.test_runtime_graphs import Caller, compiled, make_step

    cfg, model, reference = _llama()
    for m in (model, reference):
        m.layers[1].attn.key_cache = m.layers[0].attn.key_cache[:]
        m.layers[1].attn.value_cache = m.layers[0].attn.value_cache[:]
    fn, artifacts = _compile(model, runtime="sim")
    _steps(fn, reference, PagedBatch(cfg, seed=4), [([5, 9], None), ([6, 10], None)])
    art = artifacts[-1]
    assert art.rewritten.mutations.alias_groups and art.served == {("decode", "full"): 2}, art.served

    torch._dynamo.reset()
    fn, artifacts = compiled(make_step("return logits"), runtime="sim")
    reference, caller = make_step("return logits"), Caller(0)
    with torch.no_grad():
        for size in (3, 3):
            inputs = caller.step(size)
            inputs["positions"] = inputs["ids"][:]
            buf = torch.zeros(1, 40, dtype=torch.int64)
            assert_close(fn(**inputs, buf=buf), reference(**inputs, buf=buf.clone()))
    art = artifacts[-1]
    assert art.rewritten.mutations.alias_groups and art.served == {("decode", "full"): 2}, art.served


def test_a_step_raising_while_its_pieces_are_captured_puts_its_cache_rows_back_under_save_cache_rows(monkeypatch):
    """The second node between pieces raising while a prefill's pieces are captured on its values (after
    the first pieces wrote its KV rows): under `save_cache_rows` every cache is as before the step; by
    default the step's own rows stay written (named in the error)."""
    from ascend_compile.lowering import piecewise_live
    from tests.test_failed_steps import caches

    run = piecewise_live.LiveCapture.run

    def failing(self, segment):
        if segment.node.name.endswith("_1"):  # the second layer's attention kernel
            raise Raised("in layer 1")
        return run(self, segment)

    monkeypatch.setattr(piecewise_live.LiveCapture, "run", failing)
    for save in (True, False):
        cfg, model, _ = _llama()
        fn, _ = _compile(model, runtime="sim", save_cache_rows=save)
        inputs = PagedBatch(cfg, seed=4).step([40], [40])
        before = [c.clone() for c in caches(model)]
        with torch.no_grad(), pytest.raises(Raised):
            fn(**inputs)
        same = [torch.equal(got, want) for got, want in zip(caches(model), before, strict=True)]
        assert all(same) if save else not all(same), (save, same)


def test_a_graph_the_target_rewrites_is_specialized_once_per_key_and_dumped(monkeypatch, tmp_path):
    """`Target.specialize` asked once per graph key (b4.decode, then b8.decode); a rewritten graph (here a
    copy) dumped as `<key>/3_specialized.py` under `dump_dir`; one the target leaves as is, not."""
    import glob

    from ascend_compile.targets import Target

    asked = []

    def rewrite(self, gm, key, config):
        asked.append(str(key))
        return fx.GraphModule(gm, gm.graph) if key.bucket == 8 else gm

    monkeypatch.setattr(Target, "specialize", rewrite)
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", dump_dir=str(tmp_path))
    _steps(fn, reference, PagedBatch(cfg, seed=4), [([5, 9], None), ([6, 10], None), ([1, 2, 3, 4, 5], None)] * 2)
    assert asked == ["b4.decode", "b8.decode"]
    dumped = glob.glob(str(tmp_path / "**" / "3_specialized.py"), recursive=True)
    assert [p.split("/")[-2] for p in dumped] == ["b8.decode"], dumped
    assert "def forward" in open(dumped[0]).read()


def test_capture_all_captures_every_decode_bucket_at_the_steps_specialized_sizes():
    """`capture_all` with a specialized size (a caller's buffer of fixed width under `dynamic=True`): the
    first step captures every bucket's decode graph at its width, each keyed by it."""
    from tests.test_runtime_graphs import BUCKETS, Caller, compiled, make_step

    torch._dynamo.reset()
    body = "buf[0, :n].copy_(tokens)\nreturn logits"
    fn, artifacts = compiled(make_step(body), dynamic=True, capture_all=True, runtime="sim")
    reference, caller = make_step(body), Caller(0)
    with torch.no_grad():
        for size in (3, 3):
            inputs = caller.step(size)
            got, want = torch.zeros(1, 20, dtype=torch.int64), torch.zeros(1, 20, dtype=torch.int64)
            assert_close(fn(**inputs, buf=got), reference(**inputs, buf=want))
            assert torch.equal(got, want)
    art = artifacts[-1]
    (symbol,) = [str(s) for s in art.signature.specialized]
    assert sorted((k.bucket, s) for k, s in art.graphs) == [(b, ((symbol, 20),)) for b in BUCKETS]
    assert art.stats["captures"] == len(BUCKETS)


def test_capture_all_leaves_a_graph_the_target_refuses_uncaptured(monkeypatch):
    """`capture_all` with the target refusing bucket 8's decode graph (`Target.eager_reason`): b4.decode
    is captured, b8.decode not (its steps go to the pieces, the reason the target's)."""
    from ascend_compile.targets import Target

    monkeypatch.setattr(Target, "eager_reason", lambda self, gm, key: (
        f"{key}: refused" if key.bucket == 8 and not key.piecewise else None))
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", capture_all=True)
    _steps(fn, reference, PagedBatch(cfg, seed=4), [([5, 9], None), ([1, 2, 3, 4, 5], None)])
    art = artifacts[-1]
    graphs = {str(k): e for (k, _), e in art.graphs.items()}
    assert graphs["b4.decode"].graph is not None and graphs["b8.decode"].graph is None
    assert art.stats["captures"] == 1 and art.not_full == {"b8.decode: refused": 1}, art.stats


def test_a_direct_call_finding_an_in_place_input_moved_raises_naming_it_and_runs_nothing():
    """`call_direct` (no fixed positions): a KV cache at another address than at capture raises
    `MovedInputs` naming it, the step not counted; the same call through `__call__` captures again."""
    from ascend_compile.lowering.graph_entry import MovedInputs

    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([5, 9], None)])
    art, seen = artifacts[-1], []
    call = art._call
    art._call = lambda args, direct, fixed=None: (seen.append(args), call(args, direct, fixed))[1]
    _steps(fn, reference, batch, [([6, 10], None)])
    del art._call
    cache = next(i for i, name in art.names.items() if name.endswith("key_cache_"))
    args = list(seen[0])
    args[cache] = args[cache].clone()
    steps = art.stats["steps"]
    with torch.no_grad(), pytest.raises(MovedInputs) as moved:
        art.call_direct(args)
    assert moved.value.args[0] == [art.names[cache]] and art.stats["steps"] == steps
    assert art.stats["recaptures"] == 0 and art.stats["replays"] == 2
    with torch.no_grad():
        art(*args)
    assert art.stats["recaptures"] == 1 and art.stats["steps"] == steps + 1


def test_a_piecewise_graph_whose_checked_step_differs_serves_no_later_step(caplog):
    """`verify_every=1` on pieces: the p64 graph's first step is right; from the second its last piece's
    replay does nothing, so that step differs from eager (eager's result is returned, the warning names the
    graph), and the graph serves no later step, the reason naming the step and the first mismatch."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", verify=True, verify_every=1)
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([40], [40])])
    art = artifacts[-1]
    (graph,) = art.piecewise.values()
    assert graph.verified["ok"] and graph.eager_reason is None
    graph.pieces[-1].graph.replay = lambda: None
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        _steps(fn, reference, batch, [([41], [40]), ([42], [40])])
    assert "ascend_compile: p64: first replay differs from eager: output 0" in caplog.text
    assert graph.verified["replay"] == 2 and not graph.verified["ok"] and graph.replays == 2
    reason = f"p64: its step 2 differed from eager ({graph.verified['mismatches'][0]})"
    assert graph.eager_reason == reason and art.not_full[f"{NO_GRAPH.format(40, 1)}; {reason}"] == 1
    assert art.served == {("prefill", "piecewise"): 2, ("prefill", "eager"): 1}


def test_a_piecewise_step_runs_the_attention_kernels_between_its_pieces():
    """Where the step's plan lets them (no refusal of the target's), the attention between pieces runs
    the kernels the graph chose (FIA, one call per layer a step, through the runtime's binding), not the
    layers' own attention ops kept to run instead."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([40], [40])])
    art = artifacts[-1]
    (graph,) = art.piecewise.values()
    assert graph.fallbacks  # the layers' attention ops, there to run instead
    asked, kernel = [], art.runtime.kernel
    art.runtime.kernel = lambda op: asked.append(op) or kernel(op)
    _steps(fn, reference, batch, [([41], [40])])
    assert art.stats["piecewise_steps"] == 2
    assert asked.count(torch.ops.ascend.fused_infer_attention.default) == cfg.num_layers, asked


def test_each_piecewise_step_copies_in_once_and_replays_each_piece_once(caplog):
    """The host work of a piecewise step, counted (`PiecewiseServer.launches`): one copy-in (only the first
    piece reads values made outside the pieces), each piece replayed once and each eager node run once, the
    same at each step of the graph, its capture's step included."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        _steps(fn, reference, batch, [([40], [40]), ([50], [50]), ([60], [60])])
    art = artifacts[-1]
    (graph,) = art.piecewise.values()
    eager = len(graph.segments) - len(graph.pieces)
    assert (f"ascend_compile: captured p64: {len(graph.pieces)} pieces around {eager} eager nodes in "
            f"{graph.capture_seconds:.3f} s") in caplog.messages
    assert dict(art.pieces.launches) == {"copies": 3, "replays": 3 * len(graph.pieces), "eager_ops": 3 * eager}


def test_a_piecewise_capture_asks_the_target_for_its_graph_once_per_size_and_its_guards_of_that_graph(monkeypatch):
    """What `_capture` hands on: the target's piecewise form of the variant, made once per piecewise size
    (kept for a later capture of the same size), its step guard and refusal asked of that form and size
    with the artifact's config, the pieces padded to the size and the graph's block-table width, the
    capture begun under the graph's name (the device's stream budget counts it)."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([5, 9], None)])  # a full graph first: the artifact exists, no pieces yet
    art = artifacts[-1]
    calls, target, signature, failures = [], art.target, art.signature, art.failures

    class Spy:
        def __getattr__(self, name):
            return getattr(target, name)

        def piecewise_graph(self, gm, key, config):
            made = target.piecewise_graph(gm, key, config)
            calls.append(("piecewise_graph", gm, key, config, made))
            return made

        def step_guard(self, gm, key, config):
            calls.append(("step_guard", gm, key, config))
            return target.step_guard(gm, key, config)

        def eager_reason(self, gm, key):
            calls.append(("eager_reason", gm, key))
            return target.eager_reason(gm, key)

    padded, begin = type(signature).padded_symbols, type(failures).begin
    art.target = Spy()
    monkeypatch.setattr(type(signature), "padded_symbols", lambda self, bucket, blocks, symbols: calls.append(
        ("padded", bucket, blocks)) or padded(self, bucket, blocks, symbols))
    monkeypatch.setattr(type(failures), "begin", lambda self, name: calls.append(("begin", name)) or begin(self, name))
    from ascend_compile.lowering import capture_failures
    monkeypatch.setattr(capture_failures, "collective_groups", lambda gm: calls.append(("groups of", gm)) or [])
    _steps(fn, reference, batch, [([40], [40])])
    art.pieces.graphs.clear()  # captured again (as after moved inputs): the same size's form is kept
    _steps(fn, reference, batch, [([50], [50])])
    (_, variant, key, config, made), = [c for c in calls if c[0] == "piecewise_graph"]
    assert variant is art.rewritten.piecewise.gm and str(key) == "p64" and config is art.config
    assert [c for c in calls if c[0] == "step_guard"] == [("step_guard", made, key, art.config)] * 2
    assert [c for c in calls if c[0] == "eager_reason"] == [("eager_reason", made, key)] * 2
    assert [c for c in calls if c[0] == "padded"] == [("padded", 64, art.rewritten.max_blocks)] * 2
    assert [c for c in calls if c[0] == "begin"] == [("begin", "p64")] * 2
    groups_of = [c[1] for c in calls if c[0] == "groups of"]  # settled (and run live) on that form's collectives
    assert len(groups_of) >= 2 and all(gm is made for gm in groups_of)


def test_a_step_run_eagerly_is_logged_as_one_line_saying_why(caplog):
    """The fallback's log line is exactly `ascend_compile: <why>: running eagerly` (one line per reason,
    what a user greps for), once however many steps it serves."""
    cfg, model, reference = _llama()
    fn, _ = _compile(model, runtime="sim", piecewise_sizes=[])
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        _steps(fn, reference, PagedBatch(cfg, seed=4), [([40], [40]), ([41], [40])])
    reason = f"{NO_GRAPH.format(40, 1)}; not piecewise: piecewise_sizes is empty"
    lines = [r.getMessage() for r in caplog.records if "running eagerly" in r.getMessage()]
    assert lines == [f"ascend_compile: {reason}: running eagerly"]


def test_a_capture_is_logged_as_one_line_with_its_seconds_and_update_entries(caplog):
    """`ascend_compile: captured <graph> in <s> s (<n> update entries)`: one exact line per capture."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        _steps(fn, reference, PagedBatch(cfg, seed=4), [([5, 9], None), ([6, 10], None)])
    (entry,) = [e for e in artifacts[-1].graphs.values() if e.graph is not None]
    lines = [r.getMessage() for r in caplog.records if "captured b" in r.getMessage()]
    assert lines == [f"ascend_compile: captured {entry.name} in {entry.capture_seconds:.3f} s "
                     f"({len(entry.table.entries)} update entries)"] and entry.table.entries


def test_on_a_runtime_without_graphs_a_steps_outputs_are_its_eager_runs_own_not_copied(monkeypatch):
    """runtime="eager": each step runs the graph eagerly; its outputs are that run's own tensors (cut to
    the step), never cloned: a clone would be a copy per step no device needs."""
    cfg, model, reference = _llama()
    fn, _ = _compile(model, runtime="eager")
    made = []
    run_eager = GraphEntry.run_eager
    monkeypatch.setattr(GraphEntry, "run_eager", lambda self, *args: made.append(run_eager(self, *args)) or made[-1])
    inputs = PagedBatch(cfg, seed=4).step([5, 9], None)
    with torch.no_grad():
        got = fn(**inputs)
        assert_close(got, reference(**inputs))
    assert len(made) == 1 and got.data_ptr() == made[0][0].data_ptr()


def test_a_pa_decode_graph_is_captured_at_the_kv_length_its_block_table_and_max_model_len_allow(monkeypatch):
    """On the device, the decode graph PA serves (bucket 4 under `pa_max_batch=4`) is captured with every
    sequence at one KV length (`inputs.capture_seq_len`: at most 6144, what the block table holds,
    `max_model_len`; here 1000 tokens, below the 8 blocks of 128 the table holds), never at the padding's
    lengths; the FIA graph (bucket 8) at the padding's (None). Each step equals eager."""
    import ascend_compile
    from ascend_compile.backend import backend
    from ascend_compile.config import CompileConfig
    from examples.llama import LlamaConfig, build
    from tests import fake_torch_npu

    fake_torch_npu.install(monkeypatch)
    seen = {}
    capture = GraphEntry.capture

    def recording(self, runtime, args, workspaces, seq_len, *rest):
        seen[self.key.bucket] = seq_len
        return capture(self, runtime, args, workspaces, seq_len, *rest)

    monkeypatch.setattr(GraphEntry, "capture", recording)
    cfg = LlamaConfig(num_layers=2, num_blocks=128, block_size=128, dtype=torch.bfloat16)
    model, reference = build(cfg), build(cfg)
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=1000, capture_sizes=(4, 8), piecewise_sizes=(16,), runtime="npu",
                           pa_max_batch=4)
    fn = ascend_compile.compile(model, backend=backend(config))
    batch = PagedBatch(cfg, seed=3)
    with torch.no_grad():
        for lens in ([10, 20, 30], [7] * 6):
            inputs = batch.step(lens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-2, rtol=2e-2)
    assert seen == {4: 1000, 8: None}


def test_each_full_graph_is_settled_with_its_own_name_and_module(monkeypatch):
    """After each capture the artifact settles it (`CaptureFailures.settle`) with the graph's name and
    its own module, whose collectives name the ranks that must agree that the capture stood."""
    from ascend_compile.lowering.capture_failures import CaptureFailures

    settled = []
    settle = CaptureFailures.settle
    monkeypatch.setattr(CaptureFailures, "settle",
                        lambda self, name, gm, error: settled.append((name, gm)) or settle(self, name, gm, error))
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", piecewise_sizes=[])
    _steps(fn, reference, PagedBatch(cfg, seed=4), [([5, 9], None), ([6, 10, 3, 4, 5], None)])
    entries = [e for e in artifacts[-1].graphs.values() if e.graph is not None]
    assert len(entries) == 2 and settled == [(e.name, e.gm) for e in entries]


def test_the_capture_failure_contracts_hold_at_the_artifact(caplog):
    """tests/test_capture_failures.py and tests/test_runtime_graphs.py's cases where the runner's
    capture names the graph to the device's budget (`begin`) and to the error of a graph keeping
    sizes as seen (its name, bucket and sizes), run here, beside the runner's other contracts."""
    from tests import test_capture_failures, test_runtime_graphs

    test_capture_failures.test_a_graph_captured_before_the_streams_ran_out_is_captured_again_when_its_inputs_move(caplog)
    test_runtime_graphs.test_token_dims_the_general_trace_keeps_apart_are_a_clear_capture_error()


def test_a_step_the_pieces_refuse_runs_eagerly_counted_and_logged_with_the_refusal(caplog):
    """A 40-token prefill is served on the p64 pieces (its line logged exactly); then the pieces' plan
    refuses the next step (the target refuses its lengths and a kernel has no attention op to run
    instead): that step runs eagerly, equal to eager, counted as such under the reason with the
    refusal, logged once."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        _steps(fn, reference, batch, [([40], [40])])
        art = artifacts[-1]
        (graph,) = art.piecewise.values()
        graph.step_guard, graph.unbacked = (lambda host, args: "too many query tokens"), "fia_1"
        _steps(fn, reference, batch, [([50], [50])])
    refused = f"{NO_GRAPH.format(50, 1)}; too many query tokens, and fia_1 has no attention op to run instead"
    assert art.not_full == {NO_GRAPH.format(40, 1): 1, refused: 1}
    assert art.served == {("prefill", "piecewise"): 1, ("prefill", "eager"): 1} and art.stats["eager_fallbacks"] == 1
    lines = [r.getMessage() for r in caplog.records if "no graph for" in r.getMessage()]
    assert lines == [f"ascend_compile: {NO_GRAPH.format(40, 1)}: serving it piecewise (p64)",
                     f"ascend_compile: {refused}: running eagerly"]


def test_a_buckets_graph_is_specialised_by_the_target_once_for_all_its_captures(monkeypatch):
    """A bucket captured at two values of a specialized size (a fixed-size buffer under dynamic=True)
    holds two graphs of one specialised module: the target specialises each key once."""
    from ascend_compile.targets import Target
    from tests.test_runtime_graphs import Caller, compiled, make_step

    keys = []
    specialize = Target.specialize
    monkeypatch.setattr(Target, "specialize", lambda self, gm, key, config: keys.append(key) or specialize(self, gm, key, config))
    torch._dynamo.reset()
    body = "buf[0, :n].copy_(tokens)\nreturn logits"
    fn, artifacts = compiled(make_step(body), dynamic=True, max_specializations=2)
    reference, caller = make_step(body), Caller(0)
    with torch.no_grad():
        for width in (20, 30, 20):
            inputs = caller.step(3)
            a, b = torch.zeros(1, width, dtype=torch.int64), torch.zeros(1, width, dtype=torch.int64)
            fn(**inputs, buf=a)
            reference(**inputs, buf=b)
            assert torch.equal(a, b)
    art = artifacts[-1]
    graphs = [g for g in art.graphs.values() if g.graph is not None]
    assert len(graphs) == 2 and graphs[0].gm is graphs[1].gm
    assert [k for k in keys if k == graphs[0].key] == [graphs[0].key]


def test_a_target_specialising_by_the_config_gets_the_artifacts():
    """The CUDA target specialises each bucket's graph by the artifact's config (its split count, its
    inner compiler): tests/test_triton_kernels.py's CUDA path on a CPU stand-in, run here."""
    from tests import test_triton_kernels

    test_triton_kernels.test_backend_rewrites_to_device_lengths_for_the_cuda_runtime()


def test_a_full_graph_step_that_raises_is_noted_with_what_it_may_have_written(monkeypatch, caplog):
    """A replay raising: the error's note and the warning say which rows the step may have written (its
    slots, its sequences) and how to write them anew, the same words in both."""
    cfg, model, reference = _llama()
    fn, _ = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([5, 9], None)])
    monkeypatch.setattr(GraphEntry, "replay", lambda *a, **k: (_ for _ in ()).throw(Raised("injected")))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ascend_compile"), pytest.raises(Raised) as err:
        fn(**batch.step([6, 10], None))
    (note,) = err.value.__notes__
    assert re.fullmatch(r"ascend_compile: b4\.decode: it may have written 4 KV caches at its own slots \d+\.\.\d+ "
                        r"\(2 slots\), for its 2 sequences \(query tokens 1, 1\), and no other row; run the same step "
                        r"again to write them anew", note), note
    assert caplog.messages[-1] == f"ascend_compile: b4.decode: the step raised Raised; {note.split(': ', 2)[2]}"


def test_the_plan_is_written_at_each_capture_not_at_each_step(monkeypatch, tmp_path):
    """plan.json says what each capture decided: written when a graph is captured (or found never to
    be), never by a step replaying a graph already captured (no per-step host work)."""
    from ascend_compile.lowering.runner import CompiledArtifact

    writes = []
    write_plan = CompiledArtifact.write_plan
    monkeypatch.setattr(CompiledArtifact, "write_plan", lambda self: writes.append(1) or write_plan(self))
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", dump_dir=str(tmp_path), piecewise_sizes=[])
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([5, 9], None)])
    after_capture = len(writes)
    _steps(fn, reference, batch, [([6, 10], None), ([7, 11, 3], None), ([8, 12], None)])
    assert after_capture >= 1 and len(writes) == after_capture and artifacts[-1].stats["replays"] == 4


def test_capture_all_captures_every_decode_bucket_once_at_the_first_capture_only(monkeypatch):
    """`capture_all`: the first capture captures every bucket's decode graph; a later new graph (a new
    value of a specialized size) captures only itself, not every bucket again."""
    from tests.test_runtime_graphs import Caller, compiled, make_step

    torch._dynamo.reset()
    body = "buf[0, :n].copy_(tokens)\nreturn logits"
    fn, artifacts = compiled(make_step(body), dynamic=True, max_specializations=2, capture_all=True)
    reference, caller = make_step(body), Caller(0)
    with torch.no_grad():
        for width in (20, 30):
            inputs = caller.step(3)
            a, b = torch.zeros(1, width, dtype=torch.int64), torch.zeros(1, width, dtype=torch.int64)
            fn(**inputs, buf=a)
            reference(**inputs, buf=b)
            assert torch.equal(a, b)
    art = artifacts[-1]
    decode = [k for k in art.rewritten.choices if k.decode]
    assert len(decode) >= 2 and art.stats["captures"] == len(decode) + 1, (decode, art.stats)


def test_the_ranks_agree_on_a_capture_on_the_artifacts_own_device():
    """The capture failures' agreement between ranks (a flag all-reduced per collective group) is made
    on the artifact's runtime's device, where its process groups communicate, not the default one."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    _steps(fn, reference, PagedBatch(cfg, seed=4), [([5, 9], None)])
    art = artifacts[-1]
    assert art.failures.device == art.runtime.device and art.failures.device is not None


def test_lengths_a_provider_keeps_host_copies_of_are_counted_as_copies_not_conversions(monkeypatch):
    """A runtime keeping host copies of a step's lengths (vLLM-Ascend's `seq_lens_list`, through the
    prologue's provider, `passes/providers.py`): the runner takes them instead of reading the tensors,
    and counts each as a host copy, none as a conversion, step after step; the steps equal eager."""
    import dataclasses

    from ascend_compile.passes.providers import Provider
    from ascend_compile.passes.roles import Role

    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([5, 9], None)])
    art = artifacts[-1]
    (seq_lens,), (starts,) = art.signature.by_role(Role.SEQ_LENS), art.signature.by_role(Role.QUERY_START_LOC)
    host = lambda args: {seq_lens.name: args[seq_lens.index].tolist(), starts.name: args[starts.index].tolist()}  # noqa: E731
    prologue = art.rewritten.prologue
    monkeypatch.setattr(art.rewritten, "prologue", dataclasses.replace(prologue, provider=Provider((), lambda a: [], host)))
    before = dict(art.stats)
    _steps(fn, reference, batch, [([6, 10], None), ([7, 11, 3], None), ([40], [40])])
    assert art.stats["steps"] - before["steps"] == 3
    assert art.stats["host_copies"] - before["host_copies"] == 6 and art.stats["host_conversions"] == before["host_conversions"]


def test_under_grad_mode_steps_whose_inputs_need_no_grad_are_replayed():
    """Grad mode on (no `torch.no_grad()`), a model whose parameters need no grad: no input of the
    graph requires grad (its sizes are plain ints), so each step is replayed, not run with autograd."""
    cfg, model, reference = _llama()
    model.requires_grad_(False)
    reference.requires_grad_(False)
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    for lens in ([5, 9], [6, 10], [7, 11]):
        inputs = batch.step(lens, None)
        assert_close(fn(**inputs), reference(**inputs))
    art = artifacts[-1]
    assert art.stats["eager_fallbacks"] == 0 and art.stats["replays"] == 3, art.stats


def test_a_step_with_more_sequences_than_tokens_takes_a_bucket_holding_its_sequences():
    """Five sequences, one with no query token (four tokens): bucket 4 holds the tokens, not the
    sequences; the step is served by bucket 8's graph, equal to eager."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", piecewise_sizes=[])
    _steps(fn, reference, PagedBatch(cfg, seed=4), [([9, 9, 9, 9, 9], [1, 1, 1, 1, 0])])
    art = artifacts[-1]
    assert [e.key.bucket for e in art.graphs.values() if e.graph is not None] == [8] and art.stats["replays"] == 1


def test_a_full_graph_refusing_a_step_with_no_pieces_runs_it_eagerly_on_the_callers_arguments(monkeypatch):
    """A bucket's graph whose guard refuses the step, no piecewise graphs: the step runs as traced on
    the caller's own arguments, equal to eager, counted under the refusal."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", piecewise_sizes=[])
    batch = PagedBatch(cfg, seed=4)
    _steps(fn, reference, batch, [([5, 9], None)])
    art = artifacts[-1]
    (entry,) = art.graphs.values()
    monkeypatch.setattr(entry, "step_guard", lambda host, args: "b4: these lengths are refused")
    _steps(fn, reference, batch, [([6, 10], None)])
    assert art.not_full == {"b4: these lengths are refused; not piecewise: piecewise_sizes is empty": 1}
    assert art.served == {("decode", "full"): 1, ("decode", "eager"): 1}


def test_a_direct_call_a_full_graph_does_not_serve_goes_to_the_pieces_as_direct(monkeypatch):
    """A step the direct dispatcher calls (`call_direct`) that its bucket's graph does not serve (the
    graph never to be captured, or its guard refusing the step) is handed on as a direct call, so that
    moved inputs raise `MovedInputs` there instead of a capture."""
    from ascend_compile.lowering.runner import CompiledArtifact

    calls, handed = [], []
    call, not_full = CompiledArtifact._call, CompiledArtifact._not_full
    monkeypatch.setattr(CompiledArtifact, "_call", lambda self, args, *rest, **kw: calls.append(args) or call(self, args, *rest, **kw))
    monkeypatch.setattr(CompiledArtifact, "_not_full",
                        lambda self, args, caller_args, step, direct, why: handed.append((direct, why)) or
                        not_full(self, args, caller_args, step, direct, why))
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    _steps(fn, reference, PagedBatch(cfg, seed=4), [([5, 9], None)])
    art = artifacts[-1]
    (entry,) = art.graphs.values()
    with torch.no_grad():
        monkeypatch.setattr(entry, "step_guard", lambda host, args: "refused")
        art.call_direct(calls[0])
        monkeypatch.setattr(entry, "eager_reason", "never captured")
        art.call_direct(calls[0])
    assert handed == [(True, "refused"), (True, "never captured")]


def test_a_graph_captured_again_for_moved_caches_keeps_its_specialized_sizes():
    """A bucket's graph at a specialized size (a fixed-size buffer under dynamic=True) whose KV caches
    move (new tensors, the same contents): captured again at the same specialized size, equal to eager."""
    from tests.test_runtime_graphs import Caller, compiled, make_step

    torch._dynamo.reset()
    body = "buf[0, :n].copy_(tokens)\nreturn logits"
    module, reference = make_step(body), make_step(body)
    fn, artifacts = compiled(module, dynamic=True)
    caller = Caller(0)
    with torch.no_grad():
        for step in range(3):
            if step == 2:  # the caches move: new tensors holding what the old ones held
                module.key_cache, module.value_cache = module.key_cache.clone(), module.value_cache.clone()
            inputs = caller.step(3)
            a, b = torch.zeros(1, 20, dtype=torch.int64), torch.zeros(1, 20, dtype=torch.int64)
            torch.testing.assert_close(fn(**inputs, buf=a), reference(**inputs, buf=b))
            assert torch.equal(a, b)
    art = artifacts[-1]
    assert art.stats["recaptures"] == 1, art.stats
    assert [dict(g.specialization) for g in art.graphs.values() if g.graph is not None] == [{str(s): 20 for s in art.signature.specialized}]
