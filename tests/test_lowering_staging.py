"""A captured graph's static buffers and its input checks, by plain calls: `lowering/staging.py` (a buffer per
copied input at the padded sizes, the graph's arguments, padding, the step's copies in and the graph's writes
back) and `lowering/input_checks.py` (what a graph holds of its inputs, checked every step: addresses, host
scalars, the identity of frozen parameters, a direct route's verified positions; the change log's WARNING).
mutmut's tests for these modules (the compile-level use of each is the runner's tests')."""
from __future__ import annotations

import logging
import types

import pytest
import sympy
import torch
from torch import fx

from ascend_compile.lowering import staging as staging_mod
from ascend_compile.lowering.input_checks import CapturedInputs, ChangeLog, change_summary
from ascend_compile.lowering.inputs import Geometry, Step
from ascend_compile.lowering.staging import Staging, per_step_shape
from ascend_compile.passes.roles import GraphSignature, InputSpec, Role
from ascend_compile.passes.size_symbols import SymbolKind, SymbolSource
from ascend_compile.passes.write_back import WriteBack

T, B, W, L = sympy.symbols("t b w l")
DTYPES = [torch.int32, torch.int64, torch.int64, torch.int32, torch.float32, None, torch.float16]


def _signature() -> GraphSignature:
    """seq_lens (B), query_start_loc (B + 1), slot_mapping (T), block_table (B, W, its row stride L), a KV cache
    (in place), a SymInt (T) and a batch input (T, 2)."""
    specs = (InputSpec(0, "seq_lens", Role.SEQ_LENS, (B,)),
             InputSpec(1, "query_start_loc", Role.QUERY_START_LOC, (B + 1,)),
             InputSpec(2, "slot_mapping", Role.SLOT_MAPPING, (T,)),
             InputSpec(3, "block_table", Role.BLOCK_TABLE, (B, W)),
             InputSpec(4, "kv_cache", Role.KV_CACHE, (16, 4)), InputSpec(5, "t", Role.SYMINT, None, expr=T),
             InputSpec(6, "embeds", Role.BATCH, (T, 2)))
    sources = {T: SymbolSource(2, "size", 0), B: SymbolSource(0, "size", 0), W: SymbolSource(3, "size", 1),
               L: SymbolSource(3, "stride", 0)}
    kinds = {T: SymbolKind.TOKENS, B: SymbolKind.TOKENS, W: SymbolKind.BLOCKS, L: SymbolKind.LAYOUT}
    return GraphSignature(specs, T, B, sources, kinds, ())


def _gm() -> fx.GraphModule:
    graph = fx.Graph()
    for i, dtype in enumerate(DTYPES):
        node = graph.placeholder(f"in{i}")
        node.meta["example_value"] = torch.zeros(1, dtype=dtype) if dtype is not None else 3
    graph.output(None)
    return fx.GraphModule(torch.nn.Module(), graph)


class _Runtime:
    def __init__(self):
        self.asked = []

    def empty(self, shape, dtype):
        self.asked.append((shape, dtype))
        return torch.full(shape, 77, dtype=dtype)


def _staging(write_back=WriteBack(None, (), (), ()), padded=None):
    padded = {T: 8, B: 4, W: 3} if padded is None else padded
    return Staging(_signature(), write_back, _Runtime(), _gm(), padded)


def _step(lens, loc, slots, table, embeds=None, symbols=None):
    tokens = loc[-1]
    args = [torch.tensor(lens, dtype=torch.int32), torch.tensor(loc), torch.tensor(slots),
            torch.tensor(table, dtype=torch.int32),
            torch.zeros(16, 4), tokens, torch.ones(tokens, 2, dtype=torch.float16) if embeds is None else embeds]
    symbols = {T: tokens, B: len(lens), W: len(table[0])} if symbols is None else symbols
    return Step(args, symbols, tokens, len(lens), False, {}, {})


# --- staging.py ---------------------------------------------------------------------------------------------

def test_each_copied_input_gets_a_buffer_of_its_padded_shape_and_graph_dtype_the_rest_none():
    padded = {T: 8, B: 4, W: 3}
    staging = _staging(padded=padded)
    assert sorted(staging.buffers) == [0, 1, 2, 3, 6]
    assert {i: (tuple(b.shape), b.dtype) for i, b in staging.buffers.items()} == {
        0: ((4,), torch.int32), 1: ((5,), torch.int64), 2: ((8,), torch.int64), 3: ((4, 3), torch.int32),
        6: ((8, 2), torch.float16)}
    assert [s.index for s in staging.copied] == [0, 1, 2, 3, 6]
    assert staging.geometry == Geometry(8, 4, 128)
    assert staging.padded == {T: 8, B: 4, W: 3, L: 3}  # a layout symbol is the buffer's own stride
    assert padded == {T: 8, B: 4, W: 3}  # the caller's dict untouched
    assert staging.nbytes() == 4 * 4 + 5 * 8 + 8 * 8 + 12 * 4 + 16 * 2
    assert staging.written_views == []


def test_a_mixed_steps_dummy_limit_is_asked_at_the_graphs_padded_sizes(monkeypatch):
    """A dummy sequence's keys lie in one block-table row: the limit depends on the padded width."""
    asked = []
    monkeypatch.setattr(staging_mod, "dummy_limit", lambda gm, padded=None: asked.append(dict(padded or {})) or (
        128 if padded is None else min(128, padded[W] * 16)))
    assert _staging(padded={T: 8, B: 4, W: 3}).geometry == Geometry(8, 4, 48) and asked == [{T: 8, B: 4, W: 3}]


def test_the_graphs_arguments_are_the_buffers_the_padded_symints_and_the_in_place_inputs_as_given():
    staging = _staging()
    step = _step([5, 6], [0, 1, 2], [3, 4], [[1, 2], [3, 4]])
    graph_args = staging.graph_args(step.args)
    assert [graph_args[i] is staging.buffers[i] for i in (0, 1, 2, 3, 6)] == [True] * 5
    assert graph_args[4] is step.args[4] and graph_args[5] == 8 and len(graph_args) == 7


def test_padding_fills_every_buffer_by_role_query_start_loc_all_padding_sequences():
    staging = _staging()
    staging.fill_padding()
    assert staging.buffers[0].tolist() == [0] * 4 and staging.buffers[2].tolist() == [-1] * 8
    assert staging.buffers[1].tolist() == [0, 1, 2, 3, 8] and staging.buffers[1].dtype == torch.int64
    assert staging.buffers[3].tolist() == [[0] * 3] * 4 and staging.buffers[6].tolist() == [[0, 0]] * 8


def test_a_step_is_copied_in_padded_by_role_each_step_shape_planned_once(monkeypatch):
    staging = _staging()
    planned = []
    plan = staging._plan_copies
    monkeypatch.setattr(staging, "_plan_copies", lambda step: planned.append(step) or plan(step))
    staging.copy_in(_step([5, 6], [0, 1, 3], [3, 4, 5], [[1, 2], [3, 4]]))
    assert staging.buffers[0].tolist() == [5, 6, 0, 0] and staging.buffers[1].tolist() == [0, 1, 3, 4, 8]
    assert staging.buffers[2].tolist() == [3, 4, 5, -1, -1, -1, -1, -1]
    assert staging.buffers[3].tolist() == [[1, 2, 0], [3, 4, 0], [0, 0, 0], [0, 0, 0]]
    assert staging.buffers[6].tolist() == [[1, 1]] * 3 + [[0, 0]] * 5
    staging.copy_in(_step([7, 8], [0, 2, 3], [9, 9, 9], [[5, 6], [7, 8]]))  # same shape, new values
    assert staging.buffers[0].tolist() == [7, 8, 0, 0] and staging.buffers[1].tolist() == [0, 2, 3, 4, 8]
    assert staging.buffers[3].tolist() == [[5, 6, 0], [7, 8, 0], [0, 0, 0], [0, 0, 0]] and len(planned) == 1
    staging.copy_in(_step([1, 2, 3], [0, 1, 2, 3], [1, 1, 1], [[9], [9], [9]]))  # another shape
    assert staging.buffers[0].tolist() == [1, 2, 3, 0] and staging.buffers[1].tolist() == [0, 1, 2, 3, 8]
    assert staging.buffers[3].tolist() == [[9, 0, 0]] * 3 + [[0, 0, 0]] and len(planned) == 2


def test_a_steps_copy_in_is_one_batched_copy_that_does_not_wait_for_the_device(monkeypatch):
    staging, calls = _staging(), []
    copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dests, sources, **kw: calls.append(kw) or copy(dests, sources))
    staging.copy_in(_step([5, 6], [0, 1, 3], [3, 4, 5], [[1, 2], [3, 4]]))
    assert calls == [{"non_blocking": True}] and staging.buffers[0].tolist() == [5, 6, 0, 0]


def test_a_per_step_shape_cache_makes_each_value_once_and_starts_again_empty_when_full(monkeypatch):
    monkeypatch.setattr(staging_mod, "MAX_STEP_SHAPES", 2)
    cache, made = {}, []

    def make(value):
        return lambda: made.append(value) or value

    assert per_step_shape(cache, ("a",), make(0)) == 0 and per_step_shape(cache, ("a",), make(1)) == 0
    assert per_step_shape(cache, ("b",), make(2)) == 2 and made == [0, 2] and len(cache) == 2
    assert per_step_shape(cache, ("c",), make(3)) == 3 and cache == {("c",): 3}
    assert per_step_shape(cache, ("a",), make(4)) == 4 and cache == {("c",): 3, ("a",): 4}


def test_the_step_shapes_kept_are_4096():
    assert staging_mod.MAX_STEP_SHAPES == 4096


def _write_back(located=(2,), whole=(), outputs=(0,), views=lambda a: (a[2],), aliased=lambda a: (a[0],)):
    return WriteBack(lambda *a: (*views(a), *aliased(a)), located, whole, outputs)


def test_the_graphs_writes_are_located_in_the_buffers_and_copied_back_into_the_callers_tensors_real_rows_only():
    staging = _staging(_write_back())
    step = _step([5, 6], [0, 1, 3], [3, 4, 5], [[1, 2], [3, 4]])
    assert staging.locate_writes(staging.graph_args(step.args)) == []
    assert len(staging.written_views) == 1 and staging.written_views[0] is staging.buffers[2]
    staging.copy_in(step)
    staging.buffers[2].copy_(torch.arange(10, 18))  # the graph writes slot_mapping, padding rows too
    aliased = staging.copy_back(step)
    assert step.args[2].tolist() == [10, 11, 12] and list(aliased) == [0] and aliased[0] is step.args[0]


def test_an_input_written_twice_at_overlapping_places_is_named():
    twice = _write_back(located=(2, 2, 3), outputs=(), aliased=lambda a: (),
                        views=lambda a: (a[2][:4], a[2][2:6], a[3][0]))
    assert _staging(twice).locate_writes(_staging(twice).graph_args(_step([5], [0, 1], [3], [[1]]).args)) == [
        "slot_mapping"]
    apart = _write_back(located=(2, 2), outputs=(), aliased=lambda a: (), views=lambda a: (a[2][:4], a[2][4:]))
    staging = _staging(apart)
    assert staging.locate_writes(staging.graph_args(_step([5], [0, 1], [3], [[1]]).args)) == []


def test_inputs_written_whole_are_copied_back_whole_and_nothing_written_copies_nothing():
    staging = _staging(WriteBack(None, (), (0, 6), ()))
    step = _step([5, 6], [0, 1, 3], [3, 4, 5], [[1, 2], [3, 4]])
    staging.copy_in(step)
    staging.buffers[0].copy_(torch.tensor([50, 60, 70, 80]))
    staging.buffers[6].fill_(2.0)
    assert staging.copy_back(step) == {}
    assert step.args[0].tolist() == [50, 60] and step.args[6].tolist() == [[2.0, 2.0]] * 3
    nothing = _staging()
    step = _step([5, 6], [0, 1, 3], [3, 4, 5], [[1, 2], [3, 4]])
    nothing.copy_in(step)
    nothing.buffers[0].fill_(9)
    assert nothing.copy_back(step) == {} and step.args[0].tolist() == [5, 6]
    aliased_only = _staging(_write_back(located=(), views=lambda a: ()))
    step = _step([5, 6], [0, 1, 3], [3, 4, 5], [[1, 2], [3, 4]])
    aliased_only.locate_writes(aliased_only.graph_args(step.args))
    assert aliased_only.copy_back(step) == {0: step.args[0]}


# --- input_checks.py ----------------------------------------------------------------------------------------

def _inputs():
    """A KV cache (0) and a parameter (1), address-checked; a host scalar (2); a frozen parameter (3)
    identified; a plain int at a checked position (4)."""
    return [torch.zeros(4), torch.zeros(2), torch.tensor(0.5), torch.zeros(3), 7]


def test_an_unchanged_step_changes_nothing_and_each_change_is_named_addresses_then_scalars_then_objects():
    args = _inputs()
    captured = CapturedInputs(args, [0, 1, 4], [2], [3])
    assert captured.addresses == {0: args[0].data_ptr(), 1: args[1].data_ptr()}
    assert captured.scalars == {2: 0.5} and captured.objects == {3: args[3]}
    assert captured.changed(list(args)) == []
    moved = [torch.zeros(4), args[1], torch.tensor(0.25), torch.zeros(3), 7]
    assert captured.changed(moved) == [0, 2, 3]
    assert captured.changed([args[0], torch.zeros(2), args[2], args[3], 7]) == [1]
    assert captured.changed([args[0], args[1], torch.tensor(0.5), args[3], 7]) == []  # a scalar by value
    assert captured.changed([args[0], args[1], args[2], torch.zeros(3), 7]) == [3]  # an object by identity
    assert captured.changed([args[0], args[1][:], args[2], args[3], 7]) == []  # a view at the same address
    assert captured.event(moved, [0, 2]) == ((0, moved[0].data_ptr()), (2, 0.25))


def test_nothing_checked_changes_nothing():
    captured = CapturedInputs(_inputs(), [], [])
    assert captured.changed([torch.zeros(1)] * 5) == [] and captured.event(_inputs(), []) == ()


def test_a_direct_routes_fixed_positions_once_verified_skip_the_identity_check_and_read_the_kept_tensors():
    args = _inputs()
    captured = CapturedInputs(args, [0, 1], [2], [3])
    fixed = frozenset({0, 1, 3})
    assert captured.changed(list(args), fixed) == []
    other = [torch.zeros(4), torch.zeros(2), args[2], torch.zeros(3), 7]
    assert captured.changed(other, fixed) == []  # the route's positions hold its own objects: not read
    assert captured.changed([*args[:2], torch.tensor(1.0), *args[3:]], fixed) == [2]  # scalars always
    assert captured.changed(other, frozenset({0, 1, 3})) == [0, 1, 3]  # another route: checked again
    assert captured.changed(other) == [0, 1, 3]


def test_a_route_whose_address_checked_inputs_are_not_all_fixed_reads_them_from_the_arguments():
    args = _inputs()
    captured = CapturedInputs(args, [0, 1], [2], [3])
    fixed = frozenset({0, 3})
    assert captured.changed(list(args), fixed) == []
    other = [args[0], torch.zeros(2), args[2], torch.zeros(3), 7]
    assert captured.changed(other, fixed) == [1]  # verified: the identity skipped, the addresses read


def test_a_route_verified_on_a_call_that_moved_reads_the_arguments_after():
    args = _inputs()
    captured = CapturedInputs(args, [0, 1], [], [3])
    fixed = frozenset({0, 1, 3})
    first = [torch.zeros(4), args[1], args[2], args[3], 7]
    assert captured.changed(first, fixed) == [0]
    assert captured.changed(list(args), fixed) == []  # not the moved tensor kept: the arguments read
    assert captured.changed(first, fixed) == [0]


def test_a_route_fixing_exactly_the_identified_and_checked_positions_is_verified():
    args = _inputs()
    captured, fixed = CapturedInputs(args, [0, 1], [], []), frozenset({0, 1})
    assert captured.changed(list(args), fixed) == []
    assert captured.changed([torch.zeros(4), torch.zeros(2), *args[2:]], fixed) == []  # the kept ones read
    captured, fixed = CapturedInputs(args, [], [], [3]), frozenset({3})
    assert captured.changed(list(args), fixed) == []
    assert captured.changed([*args[:3], torch.zeros(3), 7], fixed) == []


def test_a_route_not_holding_every_identified_position_is_never_verified():
    args = _inputs()
    captured = CapturedInputs(args, [0], [], [3])
    fixed = frozenset({0})
    assert captured.changed(list(args), fixed) == []
    assert captured.changed([*args[:3], torch.zeros(3), 7], fixed) == [3]


def test_a_failed_identity_check_does_not_verify_the_route():
    args = _inputs()
    captured = CapturedInputs(args, [0], [], [3])
    fixed = frozenset({0, 3})
    assert captured.changed([*args[:3], torch.zeros(3), 7], fixed) == [3]
    assert captured.changed([*args[:3], torch.zeros(3), 7], fixed) == [3]


def _spec(i, role, parameter=False):
    return InputSpec(i, f"in{i}", role, (1,), parameter=parameter)


def test_a_change_is_summed_up_by_kind_in_the_order_seen():
    specs = [_spec(0, Role.KV_CACHE)] * 8
    assert change_summary(specs) == "8 KV cache inputs moved"
    assert change_summary([_spec(1, Role.STATIC, True), _spec(2, Role.SCALAR)]) == (
        "1 parameter moved, 1 host scalar changed")
    specs = [_spec(2, Role.SCALAR)] * 2 + [_spec(3, Role.STATIC)] * 2 + [_spec(1, Role.STATIC, True)]
    assert change_summary(specs) == "2 host scalars changed, 2 buffers moved, 1 parameter moved"
    assert change_summary([]) == ""


class _Graph:
    def __init__(self, name, captured):
        self.name, self.key, self.captured_inputs = name, f"key-{name}", captured


def test_a_change_logs_one_warning_naming_its_kind_the_graph_and_how_many_others_will_recapture(caplog):
    args = _inputs()
    signature = GraphSignature((_spec(0, Role.KV_CACHE), _spec(1, Role.STATIC, True), _spec(2, Role.SCALAR)),
                               1, 1, {}, {}, ())
    a, b, c = (_Graph(n, CapturedInputs(args, [0], [2])) for n in "abc")
    d, e = _Graph("d", None), _Graph("e", CapturedInputs(args, [1], []))
    changes = ChangeLog(signature, {0: "cache_0", 1: "w", 2: "eps"})
    new = [torch.zeros(4), *args[1:]]
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        changes.log(a, [0], new, [a, b, c, d, e])
        changes.log(b, [0], new, [a, b, c, d, e])  # the same change: said once
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert messages == [
        (logging.DEBUG, "ascend_compile: a: inputs changed since its capture: ['cache_0']"),
        (logging.WARNING, "ascend_compile: 1 KV cache input moved since key-a was captured: re-capturing it; 2 more "
                          "captured graphs will re-capture on next use"),
        (logging.DEBUG, "ascend_compile: b: inputs changed since its capture: ['cache_0']"),
        (logging.DEBUG, "ascend_compile: re-capturing b for the same change")]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        changes.log(a, [0, 2], [new[0], new[1], torch.tensor(2.0), *new[3:]], [a, b])
        changes.log(e, [1], [args[0], torch.zeros(2), *args[2:]], [e])
    assert [r.getMessage() for r in caplog.records] == [
        "ascend_compile: 1 KV cache input moved, 1 host scalar changed since key-a was captured: re-capturing it; "
        "1 more captured graph will re-capture on next use",
        "ascend_compile: 1 parameter moved since key-e was captured: re-capturing it"]
