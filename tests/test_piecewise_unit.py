"""`lowering/piecewise.py` at its functions: a padded value cut to a step's sizes (`_narrow`, `sym_value`),
and a `PiecewiseGraph` of the two-layer example Llama on the simulator (p64: three pieces around the two
attention kernels): what `describe` and `memory` report, the step's plan under the target's refusals
(`plan`), the nodes run between pieces (`run_eager`), and what a capture refuses (`_capture_input`)."""
from __future__ import annotations

import time

import pytest
import sympy
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ascend_compile.lowering.piecewise import _narrow, real_plan, sym_value
from ascend_compile.passes.fx_utils import example_value
from ascend_compile.passes.split_pieces import EagerNode, Piece
from examples.llama import PagedBatch
from tests.test_piecewise import _compile, _llama


def test_sym_value_gives_an_int_a_float_or_a_bool_at_the_symbols_values():
    s0 = sympy.Symbol("s0")
    s = ShapeEnv().create_symintnode(s0, hint=5)
    assert sym_value(s * 2, {s0: 3}) == 6 and type(sym_value(s * 2, {s0: 3})) is int
    assert sym_value(s * 1.5, {s0: 3}) == 4.5 and type(sym_value(s * 1.5, {s0: 3})) is float
    assert sym_value(s > 2, {s0: 3}) is True and sym_value(s > 2, {s0: 1}) is False


def test_narrow_cuts_a_padded_tensor_to_its_examples_sizes_and_leaves_the_rest():
    s0 = sympy.Symbol("s0")
    padded = torch.arange(24.0).reshape(8, 3)
    cut = _narrow(padded, torch.empty(5, 3), {})
    assert cut.shape == (5, 3) and cut.data_ptr() == padded.data_ptr() and torch.equal(cut, padded[:5])
    assert _narrow(padded, torch.empty(8, 3), {}) is padded  # already the step's sizes: the value itself
    assert _narrow(padded, None, {}) is padded  # no shape known: as is
    pair = _narrow((padded, [padded]), (torch.empty(2, 3), [torch.empty(8, 1)]), {})
    assert type(pair) is tuple and pair[0].shape == (2, 3) and type(pair[1]) is list and pair[1][0].shape == (8, 1)
    s = ShapeEnv().create_symintnode(s0, hint=5)
    assert _narrow(64, s + 1, {s0: 6}) == 7  # a SymInt example: its value at the step's sizes
    assert _narrow("x", 3, {}) == "x"


@pytest.fixture(scope="module")
def p64():
    """The artifact, its p64 graph after a 40-token prefill (captured for it) and the step and arguments
    of a 50-token prefill it served next."""
    cfg, model, _ = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    with torch.no_grad():
        inputs = batch.step([40], [40])
        start = time.perf_counter()
        fn(**inputs)
        wall = time.perf_counter() - start  # the compile, the capture and the step
    art = artifacts[-1]
    (key, _), graph = next(iter(art.piecewise.items()))
    assert str(key) == "p64" and 0 < graph.capture_seconds < wall
    seen = []
    graph.plan = lambda step, args: seen.append((step, args)) or type(graph).plan(graph, step, args)
    try:
        with torch.no_grad():
            fn(**batch.step([50], [50]))  # a 50-token prefill on the same pieces: its step kept
    finally:
        del graph.plan
    return art, graph, seen[0]


def test_describe_counts_pieces_eager_nodes_and_why_and_says_what_was_asked(p64):
    _, graph, _ = p64
    assert graph.describe() == {"pieces": 3, "eager_nodes": 2, "eager_why": {"attention kernel: takes the step's lengths": 2},
                                "captured": True, "capture_seconds": round(graph.capture_seconds, 4), "replays": 2}
    assert 0 < graph.capture_seconds
    graph.refusals["MLA takes 1-16 query tokens"] += 2
    graph.verified, graph.eager_reason = {"ok": True}, "p64: why not"
    seconds, graph.capture_seconds = graph.capture_seconds, 0.123456
    try:
        described = graph.describe()
        assert described["capture_seconds"] == 0.1235  # to 0.1 ms
        assert described["attention_op_steps"] == {"MLA takes 1-16 query tokens": 2}
        assert described["verified"] == {"ok": True} and described["eager_reason"] == "p64: why not"
        pieces, graph.pieces = graph.pieces, []
        assert graph.describe()["captured"] is False  # no piece captured
        graph.pieces = pieces
        segments = graph.segments
        graph.segments = [*segments, EagerNode(graph.output, "uncapturable (sort)"),
                          EagerNode(graph.output, "uncapturable (topk)")]
        assert graph.describe()["eager_why"] == {"attention kernel: takes the step's lengths": 2, "uncapturable": 2}
        assert graph.describe()["eager_nodes"] == 4 and graph.describe()["pieces"] == 3
        graph.segments = segments
    finally:
        graph.refusals.clear()
        graph.verified, graph.eager_reason, graph.capture_seconds = None, None, seconds


def test_memory_counts_the_static_input_buffers_and_the_outputs_still_held(p64):
    """The first piece copies positions, input ids and slot mapping in (64 int64 each); every static
    output is released after the capture (held as weak aliases: the pool's memory)."""
    _, graph, _ = p64
    copied = [(n.name, tuple(b.shape), b.dtype) for n, b in graph.pieces[0].copied]
    assert sorted(copied) == sorted([("l_positions_", (64,), torch.int64), ("l_input_ids_", (64,), torch.int64),
                                     ("l_slot_mapping_", (64,), torch.int64)])
    assert graph.memory() == {"static_inputs_bytes": 3 * 64 * 8, "outputs_bytes": 0}
    last = graph.pieces[-1]
    released = set(last.released)
    last.released.clear()
    try:
        assert graph.memory()["outputs_bytes"] == sum(o.numel() * o.element_size() for o in last.outputs)
    finally:
        last.released.update(released)


def test_last_uses_name_each_values_last_reader_and_the_output_past_the_last_segment(p64):
    _, graph, _ = p64
    where = {n: i for i, s in enumerate(graph.segments) for n in (s.nodes if isinstance(s, Piece) else [s.node])}
    uses = graph.last_uses()
    for node, last in uses.items():
        readers = [where[u] for u in node.users if u.op != "output" and where.get(u) is not None]
        readers += [where[k] for k, (_, nodes) in graph.fallbacks.items() if node in nodes]
        readers += [len(graph.segments)] if graph.output in node.users else []
        assert last == max(r for r in readers if r != where.get(node)), node
    assert all(uses[n] == len(graph.segments) for n in graph.output.all_input_nodes)
    produced = set(graph.produced)
    assert produced and {n for n in produced if n in uses} == {n for n in produced
                                                               if any(where.get(u) != where[n] for u in n.users)}


def test_plan_takes_the_steps_own_lists_and_says_what_the_target_refuses(p64):
    """The step's plan is unpadded; a target refusing the kernels every step: the attention ops run, no
    refusal; refusing this step's lengths: counted, the ops run; a kernel without an op to run instead:
    the step refused, naming it."""
    _, graph, (step, args) = p64
    plan, use, why = graph.plan(step, args)
    assert (use, why) == (True, None) and plan.host == real_plan(step, graph.sources).host
    assert [len(v) for v in plan.host.values()] == [1, 1]  # one sequence: no padding to the 64 tokens
    saved = graph.kernels_refused, graph.step_guard, graph.unbacked
    try:
        graph.kernels_refused = "the kernels are refused"
        assert graph.plan(step, args)[1:] == (False, None)
        graph.kernels_refused, graph.step_guard = None, lambda host, args: "too many query tokens"
        assert graph.plan(step, args)[1:] == (False, None) and graph.refusals == {"too many query tokens": 1}
        graph.unbacked = "fia_0"
        assert graph.plan(step, args)[1:] == (False, "too many query tokens, and fia_0 has no attention op to run "
                                                    "instead")
        assert graph.refusals == {"too many query tokens": 1}  # a refused step is not counted as run
        graph.step_guard = lambda host, args: None
        assert graph.plan(step, args)[1:] == (True, None)
    finally:
        graph.kernels_refused, graph.step_guard, graph.unbacked = saved
        graph.refusals.clear()


def test_run_eager_runs_a_function_or_a_method_and_refuses_other_nodes(p64):
    art, graph, _ = p64
    g = fx.Graph()
    x = g.placeholder("x")
    method = g.call_method("add", (x, 2))
    function = g.call_function(torch.mul, (x,), {"other": 3})
    values = {x: torch.ones(2)}
    run = lambda node: graph.run_eager(art.runtime, node, values.get, None, True)  # noqa: E731
    assert torch.equal(run(method), torch.full((2,), 3.0))
    assert torch.equal(run(function), torch.full((2,), 3.0))
    with pytest.raises(ValueError, match="x: a placeholder node cannot run between pieces"):
        run(x)


def test_a_piece_reading_a_non_tensor_made_outside_it_is_refused_by_name(p64):
    art, graph, _ = p64
    g = fx.Graph()
    made = g.call_function(len, ([],))
    made.meta["val"] = "a string"
    with pytest.raises(ValueError, match=r"len(_1)?: a piece reads a non-tensor value made outside it \(str\)"):
        graph._capture_input(art.runtime, None, made, [])
    assert example_value(made) == "a string"


def test_eager_nodes_between_pieces_are_the_attention_kernels(p64):
    _, graph, _ = p64
    eager = [s for s in graph.segments if isinstance(s, EagerNode)]
    assert [type(s).__name__ for s in graph.segments] == ["Piece", "EagerNode", "Piece", "EagerNode", "Piece"]
    assert all(s.node in graph.fallbacks and not s.writes_caller for s in eager)


def test_a_step_copies_its_rows_in_once_a_piece_and_pads_the_slot_mapping_with_minus_one(p64):
    """After the 40- and 50-token steps: one copy-in per step (only the first piece reads values made
    outside the pieces), each piece replayed and each attention kernel run once a step; the slot
    mapping's buffer holds the last step's 50 slots, then -1 (the cache writes skip it)."""
    art, graph, (step, args) = p64
    assert dict(art.pieces.launches) == {"copies": 2, "replays": 6, "eager_ops": 4}
    assert graph.replays == 2
    (node, buffer), = [(n, b) for n, b in graph.pieces[0].copied if n.name == "l_slot_mapping_"]
    slots = args[graph.index[node]]
    assert slots.shape == (50,) and torch.equal(buffer[:50], slots) and bool((buffer[50:] == -1).all())
    (ids, ids_buffer), = [(n, b) for n, b in graph.pieces[0].copied if n.name == "l_input_ids_"]
    assert torch.equal(ids_buffer[:50], args[graph.index[ids]])
    assert art.seconds["copy_in"] > 0 and art.seconds["launch_and_updates"] > 0


def test_capture_input_gives_each_input_what_a_piece_is_captured_with(p64):
    """An earlier piece's static output itself; a weight (used in place) the caller's tensor; a SymInt
    its padded value; a non-tensor argument as passed; a value copied in each step one static buffer
    (made once, padded by role: a slot mapping with -1), shared by every piece reading it."""
    from ascend_compile.lowering.piecewise import _CapturedPiece

    art, graph, (step, args) = p64
    by_name = {n.name: n for n in graph.inputs}
    captured = _CapturedPiece(graph.pieces[1].piece, graph.pieces[1].gm)
    take = lambda node: graph._capture_input(art.runtime, captured, node, args)  # noqa: E731
    made, (producer, i) = next(iter(graph.produced.items()))
    assert take(made) is producer.outputs[i]
    weight = by_name["l_self_modules_embed_parameters_weight_"]
    assert take(weight) is args[graph.index[weight]]
    assert take(by_name["s72"]) == 64 and type(take(by_name["s72"])) is int
    positions = by_name["l_positions_"]
    assert take(positions) is graph.buffers[positions] and captured.copied == []  # the first piece copies it
    slots = by_name["l_slot_mapping_"]
    kept = graph.buffers.pop(slots)
    try:
        buffer = take(slots)
        assert buffer is not kept and buffer.shape == (64,) and bool((buffer == -1).all())
        assert captured.copied == [(slots, buffer)] and graph.buffers[slots] is buffer
        assert take(slots) is buffer and len(captured.copied) == 1
    finally:
        graph.buffers[slots] = kept
    scalar = fx.Graph().placeholder("scale")
    scalar.meta["val"] = 2.5
    graph.index[scalar] = 0
    try:
        assert take(scalar) is args[0]
    finally:
        del graph.index[scalar]


# -- `piecewise_live.LiveCapture` on a stand-in graph: what it runs, skips and copies ---------------------


class _Graph:
    """What `LiveCapture` asks of a `PiecewiseGraph`: its plan of the step, nodes and values."""

    def __init__(self, refusal=None):
        g = fx.Graph()
        self.x, self.y, self.h = g.placeholder("x"), g.placeholder("y"), g.placeholder("h")
        self.made, self.eager, self.later = g.call_function(torch.neg, (self.x,)), g.call_function(torch.abs, (self.y,)), \
            g.call_function(torch.relu, (self.y,))
        self.gm, self.workspace_nodes = fx.GraphModule(torch.nn.Module(), g), []
        self.refusal, self.ran, self.copies = refusal, [], None
        self.index = {self.x: 0, self.y: 1}
        self.host = {self.h: "lens"}
        self.produced = {}

    def plan(self, step, args, counted=True):
        self.counted = counted
        return type("Plan", (), {"host": {"lens": [3, 4]}})(), self.refusal is None, self.refusal

    def run_eager(self, runtime, node, value, workspace, use_kernels):
        self.ran.append((node.name, use_kernels, workspace))
        return f"{node.name} result"

    def piece_copies(self, captured, symbols):
        return self.copies


class _Runtime:
    def __init__(self):
        self.calls = []

    def after_piece(self):
        self.calls.append("after_piece")

    def after_piecewise_step(self):
        self.calls.append("after_piecewise_step")


def _live(monkeypatch, graph, collectives=()):
    from ascend_compile.lowering import piecewise_live

    monkeypatch.setattr(piecewise_live, "collective_groups", lambda gm: list(collectives) if gm is graph.gm else None)
    step = type("Step", (), {"symbols": {}})()
    return piecewise_live.LiveCapture(graph, _Runtime(), step, ["x arg", "y arg"], "workspace")


def test_live_capture_is_refused_where_the_step_is_or_the_graph_holds_collectives(monkeypatch):
    """Not run where the step cannot run on the pieces (a refusal), or where the graph holds functional
    collectives (the ranks agree on a capture only once it ends); the step planned uncounted (`serve`
    plans it again)."""
    graph = _Graph()
    live = _live(monkeypatch, graph)
    assert live.refused is False and graph.counted is False and live.use_kernels is True
    assert _live(monkeypatch, _Graph(refusal="no op to run instead")).refused is True
    assert _live(monkeypatch, _Graph(), collectives=["tp group"]).refused is True
    assert live.env == {} and live.skipped == set()


def test_live_capture_runs_the_nodes_between_pieces_skipping_writes_to_a_callers_tensor(monkeypatch):
    """A node writing a caller's tensor is not run, nor any node reading what it made; the others run on
    the step's values, with the workspace and the plan's kernel choice; each value read from the step's
    results, an earlier piece's outputs, the plan's host lists or the arguments; the copy-in skips values
    of skipped nodes and adds the padding; the runtime told after a piece and at the end."""
    graph = _Graph()
    live = _live(monkeypatch, graph)
    from ascend_compile.passes.split_pieces import Why

    writes = EagerNode(graph.made, Why("writes graph input storage (x)", writes_caller=True))
    assert writes.writes_caller
    live.run(writes)
    live.run(EagerNode(graph.eager, "attention kernel: takes the step's lengths"))
    assert live.skipped == {graph.made} and graph.ran == [(graph.eager.name, True, "workspace")]
    assert live.env[graph.eager] == f"{graph.eager.name} result"
    reads_skipped = graph.later
    reads_skipped.args = (graph.made,)
    live.run(EagerNode(reads_skipped, "attention kernel: takes the step's lengths"))
    assert live.skipped == {graph.made, graph.later} and len(graph.ran) == 1
    assert live.value(graph.eager) == f"{graph.eager.name} result" and live.value(graph.h) == [3, 4]
    assert live.value(graph.x) == "x arg" and live.value(graph.y) == "y arg"
    static = torch.arange(6.0).view(6, 1)
    graph.produced[graph.y] = (type("Captured", (), {"outputs": (static,)})(), 0)
    graph.y.meta["val"] = torch.empty(2, 1)
    assert torch.equal(live.value(graph.y), static[:2]) and live.value(graph.y).data_ptr() == static.data_ptr()
    live.env[graph.y] = "y made"
    assert live.value(graph.y) == "y made"  # the step's own result first
    dest_x, dest_skipped, pad, pad_value = torch.zeros(2), torch.zeros(2), torch.zeros(3), torch.full((3,), -1.0)
    graph.copies = ([dest_x, dest_skipped], [(pad, pad_value)])
    live.env[graph.x] = torch.tensor([5.0, 6.0])
    live.copy_in(type("Captured", (), {"copied": [(graph.x, None), (graph.made, None)]})())
    assert dest_x.tolist() == [5.0, 6.0] and dest_skipped.tolist() == [0.0, 0.0] and pad.tolist() == [-1.0] * 3
    replayed = []
    live.replay(type("Captured", (), {"graph": type("G", (), {"replay": lambda self: replayed.append(1)})()})())
    live.end()
    assert replayed == [1] and live.runtime.calls == ["after_piece", "after_piecewise_step"]


def test_a_kernel_whose_attention_call_reads_a_node_gone_from_the_graph_has_no_fallback(p64):
    """`_fallbacks`: each kernel's attention call as adapted, over the graph's own nodes (by name); a call
    reading a node the target's form of the graph lacks gives that kernel no op to run instead, and the
    other kernels keep theirs."""
    _, graph, _ = p64
    first, second = sorted(graph.fallbacks, key=lambda n: n.name)
    assert [n.name for n in graph.fallbacks[first][1]][:1] == ["q_1"]  # the call's reads, in this graph
    assert all(n.graph is graph.gm.graph for _, nodes in graph.fallbacks.values() for n in nodes)
    attention = graph.variant.attention
    op, args, kwargs = attention["out"]
    gone = fx.Graph().placeholder("not_in_this_graph")
    graph.variant.attention = {**attention, "out": (op, (gone, *args[1:]), kwargs)}
    try:
        found = graph._fallbacks()
    finally:
        graph.variant.attention = attention
    assert list(found) == [second] and found[second][0][0] is attention["out_1"][0]


def test_run_takes_a_piece_output_that_is_none_as_none(p64):
    """A step's values of piece outputs are their narrowed views, whatever they hold: an output that is
    None (an op returning nothing) is None, not looked up among the step's arguments."""
    import collections

    from ascend_compile.lowering.phase_seconds import PhaseSeconds

    art, graph, (step, args) = p64
    plan, use_kernels, _ = graph.plan(step, args)
    key = tuple(step.symbols.values())
    (returned,) = graph.output.all_input_nodes
    views = dict(graph._views[key])
    graph._views[key] = {**views, returned: None}
    replays = graph.replays
    try:
        outputs = graph.run(art.runtime, step, plan, use_kernels, args, art.pieces.workspace(graph.key), PhaseSeconds(),
                            collections.Counter())
    finally:
        graph._views[key], graph.replays = views, replays
    assert outputs == [None]


# -- `capture`, seen from outside: what it holds weakly, what it runs live, what it checks each step ------


@torch.no_grad()
def test_capture_holds_each_piece_output_weakly_from_the_first_piece_no_later_segment_reads(monkeypatch):
    """`_release`'s contract: before each piece is captured, exactly the piece outputs that no segment
    from that piece on reads are held as weak aliases (the graph pool may give their memory to that
    piece); after the capture every one is (the graph's outputs are read right after the step), each
    aliased once. Each captured piece names the split piece it was made from."""
    from ascend_compile.lowering.piecewise import PiecewiseGraph
    from ascend_compile.runtime.sim import SimRuntime
    from tests.test_failed_steps import assert_close

    seen, aliased = [], []
    capture_piece, weak_alias = PiecewiseGraph._capture_piece, SimRuntime.weak_alias

    def recording(self, runtime, piece, *rest):
        seen.append((self.segments.index(piece), {n: i in c.released for n, (c, i) in self.produced.items()}))
        return capture_piece(self, runtime, piece, *rest)

    monkeypatch.setattr(PiecewiseGraph, "_capture_piece", recording)
    monkeypatch.setattr(SimRuntime, "weak_alias", lambda self, t: aliased.append(t) or weak_alias(self, t))
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    inputs = PagedBatch(cfg, seed=4).step([40], [40])
    assert_close(fn(**inputs), reference(**inputs))
    (graph,) = artifacts[-1].piecewise.values()
    last_use = graph.last_uses()
    assert [index for index, _ in seen] == [i for i, s in enumerate(graph.segments) if isinstance(s, Piece)]
    assert [c.piece for c in graph.pieces] == [s for s in graph.segments if isinstance(s, Piece)]
    for index, released in seen:
        assert released == {node: last_use[node] < index for node in released}, index
    assert any(any(released.values()) for _, released in seen)  # some output is given up before the last piece
    assert all(c.released == set(range(len(c.outputs))) for c in graph.pieces)
    outputs = sorted((c.outputs[i].data_ptr(), tuple(c.outputs[i].shape)) for c, i in graph.produced.values())
    assert sorted((t.data_ptr(), tuple(t.shape)) for t in aliased
                  if (t.data_ptr(), tuple(t.shape)) in outputs) == outputs


@torch.no_grad()
def test_a_step_that_cannot_run_live_is_not_run_during_the_capture_and_still_equals_eager(monkeypatch):
    """A capture runs its step live (each piece's buffers filled, the piece replayed once, the nodes
    between run, the step's end told to the runtime), unless the live run is refused (here as for a
    graph holding functional collectives, which a rank must not run alone mid-capture): then nothing
    of the step runs during the capture, and the step, served by the pieces after it, equals eager."""
    import collections

    from ascend_compile.lowering import piecewise_live
    from tests.test_failed_steps import assert_close

    calls = collections.Counter()
    for name in ("copy_in", "replay", "run", "end"):
        method = getattr(piecewise_live.LiveCapture, name)
        monkeypatch.setattr(piecewise_live.LiveCapture, name,
                            lambda self, *a, _n=name, _m=method: calls.update([_n]) or _m(self, *a))
    for refused in (False, True):
        if refused:
            monkeypatch.setattr(piecewise_live, "collective_groups", lambda gm: {"tp": [0, 1]})
        calls.clear()
        cfg, model, reference = _llama()
        fn, artifacts = _compile(model, runtime="sim")
        inputs = PagedBatch(cfg, seed=4).step([40], [40])
        assert_close(fn(**inputs), reference(**inputs))
        (graph,) = artifacts[-1].piecewise.values()
        eager = len(graph.segments) - len(graph.pieces)
        expected = {} if refused else {"copy_in": 3, "replay": 3, "run": eager, "end": 1}
        assert dict(calls) == expected and graph.replays == 1, (refused, calls)


def test_a_host_scalar_changing_between_piecewise_steps_captures_the_pieces_again():
    """The pieces bake a host scalar's value (a temperature) in: one of another value is seen at the
    next step (`CapturedInputs`' scalars) and the pieces captured again (tests/test_piecewise.py)."""
    from tests.test_piecewise import test_a_host_scalar_changing_between_piecewise_steps_and_three_outputs as case

    case(dynamic=False)


@torch.no_grad()
def test_a_parameter_argument_swapped_between_piecewise_steps_under_frozen_parameters():
    """Under `frozen_parameters` a parameter's address is not checked, its object is: a parameter
    passed as an argument and swapped for another between steps served by pieces is seen, and the
    pieces captured again, never replayed on the old one's memory."""
    from torch import nn

    from examples.llama import build
    from tests.test_direct_soundness import CFG, Headed
    from tests.test_failed_steps import assert_close

    model, reference = Headed(build(CFG)), Headed(build(CFG))
    reference.load_state_dict(model.state_dict())
    heads = [nn.Parameter(torch.randn(CFG.vocab_size, 8, generator=torch.Generator().manual_seed(i)))
             for i in range(2)]
    fn, artifacts = _compile(model, runtime="sim", frozen_parameters=True)
    batch = PagedBatch(CFG, seed=1)
    for head in (heads[0], heads[0], heads[1], heads[1], heads[0]):
        step = dict(batch.step([40, 30], [20, 15]), head=head)  # 35 tokens: above the largest bucket
        assert_close(fn(**step), reference(**step))
    assert sum(a.stats["piecewise_steps"] for a in artifacts) == 5, [a.stats for a in artifacts]


def test_piece_copies_pad_each_copied_input_past_the_steps_rows_by_its_role(p64):
    """The 50-token step on p64: the first piece's buffers take the step's rows, and past them the
    padding of each input's role (the slot mapping's -1, which the pieces' cache-write views skip; 0
    for ids and positions), whatever an earlier, longer step left there."""
    _, graph, (step, _) = p64
    first = graph.pieces[0]
    saved = [b.clone() for _, b in first.copied]
    try:
        for _, buffer in first.copied:
            buffer.fill_(7)
        dests, padding = graph.piece_copies(first, step.symbols)
        assert [tuple(d.shape) for d in dests] == [(50,)] * 3
        for dest, constant in padding:
            dest.copy_(constant)
        for node, buffer in first.copied:
            pad = -1 if node.name == "l_slot_mapping_" else 0
            assert buffer[:50].eq(7).all() and buffer[50:].eq(pad).all(), node.name
    finally:
        for (_, buffer), old in zip(first.copied, saved, strict=True):
            buffer.copy_(old)


def test_a_value_found_from_the_query_start_loc_runs_between_pieces_and_is_copied_into_the_next():
    """Each token's sequence, found from `query_start_loc` (a `searchsorted` over the starts) on steps
    above the buckets: a node reading an input sized by the sequence count runs between the pieces, on
    the step's own tensors (no piece copies `query_start_loc`), and its token-sized result is copied
    into the piece reading it, its real rows only; every output equal to eager."""
    from tests.test_audit_survivors import per_sequence_steps

    body = ("starts = query_start_loc.to(torch.int64)\n"
            "seq = torch.searchsorted(starts, torch.arange(n, dtype=torch.int64), right=True) - 1\n"
            "return logits + seq[:, None].to(logits.dtype)")  # each token's sequence
    steps = [([40, 30, 20], [20, 15, 10]), ([50, 9], [30, 2]), ([40, 31, 21], [20, 15, 10])]
    artifacts = per_sequence_steps(body, steps)
    assert sum(a.stats["piecewise_steps"] for a in artifacts) == 3, [a.stats for a in artifacts]
    copied = [n.name for a in artifacts for g in a.piecewise.values() for c in g.pieces for n, _ in c.copied]
    assert "searchsorted" in copied and not any("query_start_loc" in name for name in copied), copied


def test_piece_copies_give_each_copied_value_its_region_in_order_padding_only_the_signatures_inputs(p64):
    """A piece's copy-in: one region per copied value, in order. An eager node's result, and a value at
    a placeholder past the signature's inputs (the host lists' come there), is copied as it is, unpadded;
    the signature's inputs after it still get their regions and their role's padding."""
    import types

    _, graph, (step, _) = p64
    first = graph.pieces[0]
    eager = next(s.node for s in graph.segments if isinstance(s, EagerNode))
    past = next(n for n, i in graph.index.items() if i == len(graph.signature.inputs))
    made, listed = torch.zeros(64), torch.zeros(2, dtype=torch.int64)
    piece = types.SimpleNamespace(copied=[(eager, made), (past, listed), *first.copied])
    dests, padding = graph.piece_copies(piece, step.symbols)
    assert [(d.data_ptr(), tuple(d.shape)) for d in dests] == \
        [(made.data_ptr(), (64,)), (listed.data_ptr(), (2,))] + [(b.data_ptr(), (50,)) for _, b in first.copied]
    assert len(padding) == 3 and all(tuple(d.shape) == (14,) for d, _ in padding)


def test_last_uses_count_what_an_attention_fallback_reads(p64):
    """A value the attention op run instead of a kernel reads (`fallbacks`) is in use until that kernel's
    segment, though no node reads it there: it must stay allocated for a step the kernel is refused."""
    _, graph, _ = p64
    where = {n: i for i, s in enumerate(graph.segments) for n in (s.nodes if isinstance(s, Piece) else [s.node])}
    uses = graph.last_uses()
    kernel = max(graph.fallbacks, key=where.__getitem__)
    early = next(n for n in graph.produced if uses[n] < where[kernel])
    saved = graph.fallbacks
    call, nodes = saved[kernel]
    graph.fallbacks = {**saved, kernel: (call, [*nodes, early])}
    try:
        assert graph.last_uses()[early] == where[kernel] and uses[early] < where[kernel]
    finally:
        graph.fallbacks = saved


def test_narrow_leaves_a_sequence_with_no_sequence_example_and_a_value_with_one_as_they_are():
    padded = torch.zeros(8, 3)
    pair = (padded, [padded])
    assert _narrow(pair, None, {}) is pair and _narrow(pair, torch.empty(2, 3), {}) is pair
    assert _narrow(7, (torch.empty(2),), {}) == 7
    s0 = sympy.Symbol("s0")
    s = ShapeEnv().create_symintnode(s0, hint=5)
    assert _narrow((64, [64]), (s + 1, [s * 2]), {s0: 6}) == (7, [12])  # each element at the step's sizes


@torch.no_grad()
def test_a_step_whose_kernels_are_refused_runs_the_layers_attention_ops_as_the_model_called_them(monkeypatch):
    """On pieces, a step whose lengths the target refuses the kernels (here every step after the
    capture's) runs each layer's attention op in their place, with the model's own arguments, keywords
    included (a sliding layer's `window=`), and the other nodes between pieces as they are; every step
    equal to eager."""
    from ascend_compile.runtime.sim import SimRuntime
    from examples.llama import LlamaConfig, build
    from tests.test_failed_steps import assert_close

    cfg = LlamaConfig(num_layers=2, num_blocks=512, block_size=16, sliding_window=8, layer_types=("sliding", "full"))
    model, reference = build(cfg), build(cfg)
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    inputs = batch.step([40], [40])
    assert_close(fn(**inputs), reference(**inputs))
    (graph,) = artifacts[-1].piecewise.values()
    graph.step_guard = lambda host, args: "these lengths are refused"
    ran = []
    kernel = SimRuntime.kernel
    monkeypatch.setattr(SimRuntime, "kernel", lambda self, target: ran.append(str(target)) or kernel(self, target))
    for lens in ([50], [45]):
        inputs = batch.step(lens, lens)
        assert_close(fn(**inputs), reference(**inputs))
    assert dict(graph.refusals) == {"these lengths are refused": 2} and graph.replays == 3
    assert not [t for t in ran if "fused_infer_attention" in t], ran  # the kernels the target refused: never run
    assert [call[2].get("window") for call, _ in graph.fallbacks.values()] == [8, None]  # the layers' own


def test_run_eager_gives_a_method_its_keyword_arguments(p64):
    art, graph, _ = p64
    g = fx.Graph()
    x = g.placeholder("x")
    method = g.call_method("to", (x,), {"dtype": torch.float64})
    got = graph.run_eager(art.runtime, method, {x: torch.ones(2, dtype=torch.int32)}.get, None, True)
    assert got.dtype == torch.float64 and torch.equal(got, torch.ones(2, dtype=torch.float64))


def test_a_kernel_with_no_attention_op_to_run_instead_makes_a_refused_graph_serve_nothing(p64):
    """A piecewise graph whose kernel has no attention op behind it (`unbacked`, the first such kernel
    named), where the target refuses the kernels every step: its reason says so, and it serves no step;
    with every kernel backed, none is named and the graph serves."""
    from ascend_compile.lowering.piecewise import PiecewiseGraph
    from ascend_compile.passes.kernel_call import KernelCall

    art, graph, _ = p64
    attention = graph.variant.attention
    make = lambda refused: PiecewiseGraph(graph.key, graph.specialization, graph.variant, graph.gm,  # noqa: E731
                                          graph.signature, graph.padded, set(), None, refused)
    backed = make("the kernels are refused")
    assert backed.unbacked is None and backed.eager_reason is None
    first_node, second_node = [n for n in graph.gm.graph.nodes if n in graph.fallbacks]
    graph.variant.attention = {}
    try:
        bare, served = make("the kernels are refused"), make(None)
        graph.variant.attention = {k: v for k, v in attention.items() if k != KernelCall.of(first_node).meta.attention}
        partial = make("the kernels are refused")  # the first kernel alone unbacked: the second keeps its op
    finally:
        graph.variant.attention = attention
    first = next(n.name for n in graph.gm.graph.nodes if n in graph.fallbacks)
    assert partial.unbacked == first and list(partial.fallbacks) == [second_node]
    assert bare.unbacked == first and served.unbacked == first and served.eager_reason is None
    assert bare.eager_reason == f"{graph.key}: the kernels are refused, and {first} has no attention op to run instead"


def test_a_graph_traced_at_a_static_token_count_that_is_a_piecewise_size_is_served_on_its_pieces(monkeypatch):
    """`dynamic=False`: a first step of 16 tokens traces a graph whose token count is static (no free
    symbols); with an op no graph can capture in each layer (tests/test_uncapturable.py) and no bucket
    of 16 tokens, it is served on the pieces of its own size, equal to eager."""
    from ascend_compile.backend import backend
    from ascend_compile.config import CompileConfig
    from examples import llama
    from tests import test_uncapturable as uncapturable
    from tests.test_failed_steps import assert_close

    monkeypatch.setattr(llama.Attention, "attend", uncapturable._attend)
    cfg = llama.LlamaConfig(num_layers=2, num_blocks=128, block_size=128)
    model, reference = llama.build(cfg), llama.build(cfg)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=512, capture_sizes=(4, 8), piecewise_sizes=(16, 64))
    fn = torch.compile(model, backend=backend(config, on_compiled=artifacts.append), dynamic=False)
    inputs = llama.PagedBatch(cfg, seed=4).step([16], [16])
    try:
        with torch.no_grad():
            uncapturable._CALLER[0] = "compiled"
            got = fn(**inputs)
            uncapturable._CALLER[0] = "eager"
            assert_close(got, reference(**inputs))
    finally:
        uncapturable._CALLER[0] = "compiled"
    art = artifacts[-1]
    assert isinstance(art.signature.tokens, int) and art.stats["piecewise_steps"] == 1, art.stats
    assert [str(k) for k, _ in art.piecewise] == ["p16"]


def test_the_mla_attention_run_between_pieces_reads_what_its_op_reads(monkeypatch, caplog):
    """tests/test_piecewise.py's MLA prefill chunks on npu, run here: the layers' MLA attention op, run
    between the pieces where the target refuses the kernel, reads values the kernel does not (kept as
    the pieces' outputs), and the kernel runs only on the steps it takes."""
    from tests import test_piecewise

    test_piecewise.test_mla_prefill_chunks_on_npu_are_served_piecewise(monkeypatch, caplog)
