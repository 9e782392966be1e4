"""One step's inputs (`lowering/inputs.py`), by plain calls: what a step reads of its lengths and what it
refuses, the bucket it picks, the padded host lists its kernels take (decode: a padding sequence per padded
token; mixed: dummies of at most the graph's limit, each its query length as KV length), the padding copies
into a graph's static buffers by role, inputs overlapping a written one, and the KV length a PA graph is
captured at. mutmut's tests for the module (its compile-level use is the runner's tests')."""
from __future__ import annotations

import pytest
import sympy
import torch

from ascend_compile.lowering import inputs
from ascend_compile.lowering.inputs import (Geometry, Step, StepPlan, capture_plan, capture_seq_len, choose_bucket,
                                            gather, host_value, overlapping_inputs, padded_copies, padded_shape,
                                            padded_start_loc, plan_step, read_step, step_kind)
from ascend_compile.ops.tiling import PA
from ascend_compile.passes.kernel_call import Conversion, HostSource
from ascend_compile.passes.roles import GraphSignature, InputSpec, Role
from ascend_compile.passes.size_symbols import SymbolKind, SymbolSource
from ascend_compile.passes.workspaces import GraphKey

T, B, Q, W = sympy.symbols("t b q w")
LENS, ENDS = HostSource("seq_lens", Conversion.LIST), HostSource("query_start_loc", Conversion.ENDS)


def _signature(*extra: InputSpec) -> GraphSignature:
    """seq_lens (B), query_start_loc (Q), slot_mapping (T), block_table (B, W), then `extra`."""
    specs = (InputSpec(0, "seq_lens", Role.SEQ_LENS, (B,)), InputSpec(1, "query_start_loc", Role.QUERY_START_LOC, (Q,)),
             InputSpec(2, "slot_mapping", Role.SLOT_MAPPING, (T,)),
             InputSpec(3, "block_table", Role.BLOCK_TABLE, (B, W)), *extra)
    sources = {T: SymbolSource(2, "size", 0), B: SymbolSource(0, "size", 0), Q: SymbolSource(1, "size", 0),
               W: SymbolSource(3, "size", 1)}
    kinds = {T: SymbolKind.TOKENS, B: SymbolKind.TOKENS, Q: SymbolKind.QUERY_START_LOC, W: SymbolKind.BLOCKS}
    return GraphSignature(specs, T, B, sources, kinds, ())


def _args(lens, loc, tokens=None):
    tokens = loc[-1] if tokens is None else tokens
    return [torch.tensor(lens), torch.tensor(loc), torch.zeros(tokens, dtype=torch.long),
            torch.zeros(len(lens), 2, dtype=torch.int32)]


# --- read_step ----------------------------------------------------------------------------------------------

def test_a_step_reads_its_sizes_and_lengths_and_is_decode_with_one_token_per_sequence():
    args = _args([5, 6, 7], [0, 1, 2, 3])
    step = read_step(_signature(), args, 8)
    assert step.args is args and (step.tokens, step.seqs, step.decode) == (3, 3, True)
    assert step.symbols == {T: 3, B: 3, Q: 4, W: 2}
    assert step.seq_lens == {"seq_lens": [5, 6, 7]} and step.query_start_loc == {"query_start_loc": [0, 1, 2, 3]}
    assert (step.reads, step.copies) == (2, 0)
    step = read_step(_signature(), _args([5, 6], [0, 2, 5]), 8)
    assert (step.tokens, step.seqs, step.decode) == (5, 2, False)


def test_a_step_is_decode_only_where_every_query_start_loc_is():
    extra = InputSpec(4, "query_start_loc_2", Role.QUERY_START_LOC, (Q,))
    assert not read_step(_signature(extra), [*_args([5, 6], [0, 1, 2]), torch.tensor([0, 1, 3])], 8).decode
    assert not read_step(_signature(extra), [*_args([5, 6], [0, 1, 3]), torch.tensor([0, 1, 2])], 8).decode
    assert read_step(_signature(extra), [*_args([5, 6], [0, 1, 2]), torch.tensor([0, 1, 2])], 8).decode


def test_a_sequence_longer_than_max_model_len_is_refused_naming_both():
    assert read_step(_signature(), _args([5, 8], [0, 1, 2]), 8).seq_lens == {"seq_lens": [5, 8]}
    with pytest.raises(ValueError) as error:
        read_step(_signature(), _args([9, 5], [0, 1, 2]), 8)
    assert str(error.value) == ("seq_lens: a sequence of length 9 exceeds max_model_len=8, the longest the graphs' "
                                "workspaces were sized for; compile with a larger max_model_len")
    extra = InputSpec(4, "seq_lens_2", Role.SEQ_LENS, (B,))
    with pytest.raises(ValueError, match="length 12 exceeds"):  # every seq_lens input checked
        read_step(_signature(extra), [*_args([5, 6], [0, 1, 2]), torch.tensor([1, 12])], 8)


def test_a_step_of_no_sequences_reads_empty_lengths():
    step = read_step(_signature(), _args([], [0]), 0)
    assert step.seq_lens == {"seq_lens": []} and step.decode and (step.tokens, step.seqs) == (0, 0)


def test_host_copies_stand_for_their_tensors_and_one_of_another_length_is_refused():
    args = _args([5, 6], [0, 1, 2])
    step = read_step(_signature(), args, 60, host_copies={"seq_lens": [50, 60]})
    assert step.seq_lens == {"seq_lens": [50, 60]} and step.query_start_loc == {"query_start_loc": [0, 1, 2]}
    assert (step.reads, step.copies) == (1, 1)
    step = read_step(_signature(), args, 100, host_copies={"seq_lens": [50, 60], "query_start_loc": [0, 2, 3]})
    assert (step.reads, step.copies, step.decode) == (0, 2, False)
    assert read_step(_signature(), args, 8, host_copies={}).reads == 2
    step = read_step(_signature(), args, 8, host_copies={"query_start_loc": [0, 1, 2]})
    assert (step.reads, step.copies) == (1, 1)  # seq_lens read, query_start_loc copied
    extra = InputSpec(4, "seq_lens_2", Role.SEQ_LENS, (B,))
    step = read_step(_signature(extra), [*args, torch.tensor([1, 2])], 8)
    assert (step.reads, step.copies) == (3, 0)  # every length input read counted
    with pytest.raises(ValueError) as error:
        read_step(_signature(), args, 8, host_copies={"query_start_loc": [0, 1]})
    assert str(error.value) == ("query_start_loc: its host copy has 2 entries and the tensor 3: a provider's host "
                                "copy stands for the tensor's values")
    with pytest.raises(ValueError, match="exceeds max_model_len=8"):  # a copy is checked as the tensor is
        read_step(_signature(), args, 8, host_copies={"seq_lens": [50, 60]})


def test_without_host_lengths_nothing_is_read_decode_is_tokens_equal_sequences_and_the_device_checks():
    args = _args([5, 6], [0, 1, 2])
    step = read_step(_signature(), args, 8, host_lengths=False)
    assert step.args is args and step.symbols == {T: 2, B: 2, Q: 3, W: 2}
    assert (step.tokens, step.seqs, step.decode, step.seq_lens, step.query_start_loc, step.reads) == (
        2, 2, True, {}, {}, 0)
    assert not read_step(_signature(), _args([5, 6], [0, 2, 3]), 8, host_lengths=False).decode
    assert read_step(_signature(), _args([5, 8], [0, 2, 3]), 8, host_lengths=False).tokens == 3
    with pytest.raises(RuntimeError, match=r"seq_lens: a sequence exceeds max_model_len=8, the longest the graphs' "
                                           r"workspaces were sized for; compile with a larger max_model_len"):
        read_step(_signature(), _args([5, 9], [0, 1, 2]), 8, host_lengths=False)
    for loc in ([0, 2, 2], [0, 0, 2], [0, 0]):
        with pytest.raises(RuntimeError) as error:
            read_step(_signature(), _args([5, 6][:len(loc) - 1], loc), 8, host_lengths=False)
        assert str(error.value) == "query_start_loc: every sequence needs at least one query token"
    empty = read_step(_signature(), _args([], [0]), 8, host_lengths=False)  # nothing to check
    assert (empty.tokens, empty.seqs) == (0, 0)
    extra = InputSpec(4, "seq_lens_2", Role.SEQ_LENS, (B,))
    with pytest.raises(RuntimeError, match="exceeds"):
        read_step(_signature(extra), [*_args([5, 6], [0, 1, 2]), torch.tensor([1, 12])], 8, host_lengths=False)


# --- choose_bucket ------------------------------------------------------------------------------------------

def test_the_bucket_is_the_smallest_holding_the_tokens_and_the_sequences_with_a_padding_sequence_where_padded():
    buckets = (4, 8, 16)
    assert [choose_bucket(buckets, t) for t in (0, 1, 4, 5, 8, 9, 16, 17)] == [4, 4, 4, 8, 8, 16, 16, None]
    assert choose_bucket(buckets, 4, 4) == 4  # as many sequences as tokens, nothing padded
    assert choose_bucket(buckets, 3, 4) == 8  # 4 sequences of 3 tokens: a padded token needs a 5th sequence
    assert choose_bucket(buckets, 3, 5) == 8 and choose_bucket(buckets, 8, 9) == 16
    assert choose_bucket(buckets, 15, 16) is None and choose_bucket(buckets, 16, 16) == 16
    assert choose_bucket(buckets, 2, 3) == 4 and choose_bucket((), 1) is None
    assert choose_bucket((1, 2, 4), 0) == 1 and choose_bucket((1, 2, 4), 1) == 1  # no sequences asked by default


# --- overlapping_inputs -------------------------------------------------------------------------------------

def _overlap_signature(n):
    return GraphSignature(tuple(InputSpec(i, f"in{i}", Role.BATCH, (4,)) for i in range(n)), 1, 1, {}, {}, ())


def test_inputs_overlapping_a_written_one_where_either_is_staged_are_named_the_written_first():
    flat = torch.zeros(16)
    args = [flat[0:8], flat[4:12], flat[8:16], torch.zeros(4)]
    sig, group = _overlap_signature(4), [frozenset({0, 1, 2})]
    assert overlapping_inputs(sig, group, {1}, {1}, args) == ["in1", "in0", "in2"]
    assert overlapping_inputs(sig, group, {0}, {0}, args) == ["in0", "in1"]  # in2 starts where in0 ends
    assert overlapping_inputs(sig, group, {0}, {1}, args) == ["in0", "in1"]  # the other one staged
    assert overlapping_inputs(sig, group, {0}, {2}, args) == []  # the staged one is not overlapping
    assert overlapping_inputs(sig, group, {0}, set(), args) == []  # both in place: as in eager
    assert overlapping_inputs(sig, group, {3}, {0, 1, 2, 3}, args) == []  # the written one in no group
    assert overlapping_inputs(sig, [frozenset({0, 2}), frozenset({0, 1})], {0}, {0}, args) == ["in0", "in1"]
    assert overlapping_inputs(sig, group, {2}, {2}, args) == ["in2", "in1"]  # in0 ends where in2 starts
    # a group written nowhere, or staged nowhere, is passed over for the next
    assert overlapping_inputs(sig, [frozenset({2, 3}), frozenset({0, 1})], {0}, {0}, args) == ["in0", "in1"]
    assert overlapping_inputs(sig, [frozenset({0, 3}), frozenset({1, 2})], {0, 1}, {1}, args) == ["in1", "in2"]


def test_overlap_is_by_the_bytes_a_strided_view_spans():
    base = torch.zeros(4, 6)
    every_other, last_column = base[:, ::2], base[:, 5]
    empty = base[2, 2:2]
    args = [every_other, last_column, base[3, 5:], empty]
    sig = _overlap_signature(4)
    # rows 0..3, columns 0, 2, 4: the span reaches (3, 4), so row 3's column 5 lies past it, row 2's within
    assert overlapping_inputs(sig, [frozenset({0, 1})], {0}, {0}, args) == ["in0", "in1"]
    assert overlapping_inputs(sig, [frozenset({0, 2})], {0}, {0}, args) == []
    assert overlapping_inputs(sig, [frozenset({0, 3})], {0}, {0}, args) == []  # an empty view spans nothing
    assert inputs._extent(every_other) == (base.data_ptr(), base.data_ptr() + (3 * 6 + 4 + 1) * 4)
    assert inputs._extent(empty) == (empty.data_ptr(), empty.data_ptr())
    assert inputs._extent(base[0, :1]) == (base.data_ptr(), base.data_ptr() + 4)  # one element: its 4 bytes


def test_a_one_element_input_at_the_start_of_a_written_one_overlaps_it():
    flat = torch.zeros(16)
    sig = _overlap_signature(2)
    assert overlapping_inputs(sig, [frozenset({0, 1})], {0}, {0}, [flat[0:8], flat[0:1]]) == ["in0", "in1"]
    assert overlapping_inputs(sig, [frozenset({0, 1})], {0}, {0}, [flat[0:8], flat[8:9]]) == []


# --- padded lists -------------------------------------------------------------------------------------------

def test_padded_start_loc_gives_padded_sequences_one_token_each_the_last_the_rest():
    assert padded_start_loc([0, 2, 5], 5, 8, 4) == [0, 2, 5, 6, 8]
    assert padded_start_loc([0, 2, 5], 5, 12, 6) == [0, 2, 5, 6, 7, 8, 12]
    assert padded_start_loc([0, 7], 7, 8, 4) == [0, 7, 8, 8, 8]
    loc = [0, 1, 2]
    assert padded_start_loc(loc, 2, 2, 2) == [0, 1, 2] and padded_start_loc(loc, 2, 2, 2) is not loc
    assert padded_start_loc((0, 1), 1, 4, 1) == [0, 1]


def _decode_step(lens, tokens=None, loc=True):
    tokens = len(lens) if tokens is None else tokens
    starts = {"query_start_loc": list(range(len(lens) + 1))} if loc else {}
    return Step((), {}, tokens, len(lens), True, {"seq_lens": list(lens)}, starts)


def test_a_decode_step_pads_a_sequence_per_padded_token_each_kv_length_its_query_length():
    step = _decode_step([5, 6, 7])
    assert host_value(step, LENS, Geometry(8, 8)) == [5, 6, 7, 1, 1, 1, 1, 1]
    assert host_value(step, ENDS, Geometry(8, 8)) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert host_value(step, LENS, Geometry(8, 4)) == [5, 6, 7, 5]  # the last padding sequence takes the rest
    assert host_value(step, ENDS, Geometry(8, 4)) == [1, 2, 3, 8]
    assert host_value(step, LENS, Geometry(3, 3)) == [5, 6, 7] and host_value(step, ENDS, Geometry(3, 3)) == [1, 2, 3]
    no_loc = _decode_step([5, 6, 7], loc=False)
    assert host_value(no_loc, LENS, Geometry(8, 6)) == [5, 6, 7, 1, 1, 1]


def test_a_mixed_step_pads_dummies_of_at_most_the_graphs_limit_each_kv_length_its_query_length():
    step = Step((), {}, 5, 2, False, {"seq_lens": [10, 20]}, {"query_start_loc": [0, 2, 5]})
    assert host_value(step, LENS, Geometry(8, 4, 2)) == [10, 20, 2, 1]
    assert host_value(step, ENDS, Geometry(8, 4, 2)) == [2, 5, 7, 8]
    assert host_value(step, LENS, Geometry(8, 4)) == [10, 20, 3]  # one dummy holds the 3
    assert host_value(step, ENDS, Geometry(8, 4)) == [2, 5, 8]
    assert host_value(step, LENS, Geometry(9, 3, 1)) == [10, 20, 4]  # room for one dummy only
    assert host_value(step, LENS, Geometry(5, 2)) == [10, 20] and host_value(step, ENDS, Geometry(5, 2)) == [2, 5]


def test_a_plan_holds_each_sources_padded_list():
    step = _decode_step([5, 6])
    plan = plan_step(step, [LENS, ENDS], Geometry(4, 4))
    assert plan == StepPlan(step, {LENS: [5, 6, 1, 1], ENDS: [1, 2, 3, 4]}) and plan.step is step


def test_a_graph_is_captured_with_no_real_tokens_every_sequence_at_seq_len_or_all_padding():
    plan = capture_plan([LENS, ENDS], Geometry(4, 4), 128)
    assert plan.host == {LENS: [128] * 4, ENDS: [1, 2, 3, 4]}
    assert (plan.step.tokens, plan.step.seqs, plan.step.decode, plan.step.args, plan.step.symbols) == (
        0, 0, True, (), {})
    assert capture_plan([LENS, ENDS], Geometry(8, 4), None).host == {LENS: [1, 1, 1, 5], ENDS: [1, 2, 3, 8]}
    packed = capture_plan([LENS, ENDS], Geometry(8, 4, 3), None, packed=True)
    assert not packed.step.decode and packed.host == {LENS: [3, 3, 2], ENDS: [3, 6, 8]}
    assert capture_plan([], Geometry(4, 2), 7).host == {}


def test_step_kind_is_decode_prefill_with_every_sequence_above_one_token_else_mixed():
    assert step_kind(_decode_step([5, 6])) == "decode"
    mixed = Step((), {}, 5, 2, False, {}, {"query_start_loc": [0, 2, 5]})
    assert step_kind(mixed) == "prefill"
    mixed.query_start_loc = {"query_start_loc": [0, 1, 3]}
    assert step_kind(mixed) == "mixed"
    mixed.query_start_loc = {"query_start_loc": [0, 2, 3]}  # the one-token sequence last
    assert step_kind(mixed) == "mixed"
    mixed.query_start_loc = {}
    assert step_kind(mixed) == "mixed"


# --- staging copies -----------------------------------------------------------------------------------------

def _staged(spec, value, dest, tokens=0, padded_tokens=0):
    """`value` staged into `dest` by `padded_copies`' copies, which split `dest` into regions, none empty."""
    copies = padded_copies(spec, value.shape, dest, tokens, padded_tokens)
    assert all(region.numel() for region, _ in copies) and sum(r.numel() for r, _ in copies) == dest.numel()
    for region, source in copies:
        region.copy_(value[tuple(slice(0, n) for n in region.shape)] if source is None else source)
    return copies


def test_an_input_goes_into_the_leading_region_and_the_rest_is_padded_by_its_role():
    table = InputSpec(0, "block_table", Role.BLOCK_TABLE, (B, W))
    dest = torch.full((4, 5), 99, dtype=torch.int32)
    copies = _staged(table, torch.arange(1, 7, dtype=torch.int32).reshape(2, 3), dest)
    assert dest.tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert len(copies) == 3 and all(r.data_ptr() >= dest.data_ptr() for r, _ in copies)
    slots = InputSpec(0, "slot_mapping", Role.SLOT_MAPPING, (T,))
    dest = torch.full((6,), 99)
    _staged(slots, torch.tensor([7, 8]), dest)
    assert dest.tolist() == [7, 8, -1, -1, -1, -1]
    dest = torch.full((3,), 99)
    copies = padded_copies(slots, (3,), dest, 3, 3)
    assert len(copies) == 1 and copies[0][0] is dest and copies[0][1] is None
    dest = torch.full((4, 5), 99)
    _staged(table, torch.ones(4, 2, dtype=torch.long), dest)  # only the width padded
    assert dest.tolist() == [[1, 1, 0, 0, 0]] * 4


def test_an_input_of_a_role_with_no_padding_value_is_padded_with_zeros():
    """A piece's copied input may be of any role not used in place (`piecewise.py` fills its buffer with
    `PAD_VALUE.get(role, 0)` at capture): a step pads it the same."""
    dest = torch.full((6,), 99)
    _staged(InputSpec(0, "metadata", Role.UNUSED, (T,)), torch.tensor([7, 8]), dest)
    assert dest.tolist() == [7, 8, 0, 0, 0, 0]


def test_padding_is_a_constant_of_the_buffers_dtype_on_its_device():
    for spec, shape in ((InputSpec(0, "block_table", Role.BLOCK_TABLE, (B, W)), (2, 3)),
                        (InputSpec(0, "query_start_loc", Role.QUERY_START_LOC, (Q,)), (3,))):
        dest = torch.empty((4, 5) if len(shape) == 2 else (5,), dtype=torch.int32, device="meta")
        padding = [source for _, source in padded_copies(spec, shape, dest, 5, 8) if source is not None]
        assert padding and all(p.dtype == torch.int32 and p.device.type == "meta" for p in padding)


def test_query_start_loc_is_padded_with_the_padded_sequences_ends_on_the_buffers_device_and_dtype():
    loc = InputSpec(0, "query_start_loc", Role.QUERY_START_LOC, (Q,))
    dest = torch.full((5,), 99, dtype=torch.int32)
    copies = _staged(loc, torch.tensor([0, 2, 5], dtype=torch.int32), dest, 5, 8)
    assert dest.tolist() == [0, 2, 5, 6, 8] and copies[1][1].dtype == torch.int32
    dest = torch.full((7,), 99, dtype=torch.int64)
    _staged(loc, torch.tensor([0, 2, 5]), dest, 5, 12)
    assert dest.tolist() == [0, 2, 5, 6, 7, 8, 12]
    dest = torch.full((3,), 99)
    assert len(_staged(loc, torch.tensor([0, 2, 5]), dest, 5, 5)) == 1 and dest.tolist() == [0, 2, 5]


def test_an_input_larger_than_its_buffer_is_refused_saying_what_of_a_block_table_is_too_large():
    table = InputSpec(0, "block_table", Role.BLOCK_TABLE, (B, W))
    dest = torch.zeros(4, 5)
    with pytest.raises(ValueError) as error:
        padded_copies(table, (6, 3), dest, 0, 0)
    assert str(error.value) == ("block_table: shape (6, 3) does not fit the graph's padded shape (4, 5) (block_table "
                                "has 6 rows, more than the graph's 4 sequences: it takes one row per sequence of the "
                                "step, as many as seq_lens has)")
    with pytest.raises(ValueError) as error:
        padded_copies(table, (5, 5), dest, 0, 0)  # as wide as the graph's: only the rows said
    assert str(error.value).endswith("(4, 5) (block_table has 5 rows, more than the graph's 4 sequences: it takes "
                                     "one row per sequence of the step, as many as seq_lens has)")
    with pytest.raises(ValueError) as error:
        padded_copies(table, (4, 6), dest, 0, 0)
    assert str(error.value).endswith("(4, 5) (block_table is wider than max_model_len / block_size)")
    with pytest.raises(ValueError) as error:
        padded_copies(table, (5, 6), dest, 0, 0)
    assert str(error.value).endswith("(4, 5) (block_table has 5 rows, more than the graph's 4 sequences: it takes "
                                     "one row per sequence of the step, as many as seq_lens has; block_table is "
                                     "wider than max_model_len / block_size)")
    with pytest.raises(ValueError) as error:
        padded_copies(InputSpec(0, "slot_mapping", Role.SLOT_MAPPING, (T,)), (7,), torch.zeros(6), 0, 0)
    assert str(error.value) == "slot_mapping: shape (7,) does not fit the graph's padded shape (6,)"
    with pytest.raises(ValueError) as error:
        padded_copies(InputSpec(0, "batch", Role.BATCH, (T, W)), (7, 2), torch.zeros(6, 2), 0, 0)
    assert str(error.value) == "batch: shape (7, 2) does not fit the graph's padded shape (6, 2)"
    assert inputs._too_large(table, (5,), (4,)) == ""


def test_padded_shape_evaluates_the_inputs_shape_at_the_padded_sizes():
    assert padded_shape(InputSpec(0, "block_table", Role.BLOCK_TABLE, (B, W + 1, 3)), {B: 4, W: 2}) == (4, 3, 3)


def test_gather_picks_the_positions_as_a_tuple():
    args = ["a", "b", "c"]
    assert gather([])(args) == () and gather([1])(args) == ("b",) and gather([2, 0])(args) == ("c", "a")


# --- capture_seq_len ----------------------------------------------------------------------------------------

class _Call:
    def __init__(self, kernel, block_size=128):
        self.meta = type("Meta", (), {"kernel": kernel, "shape": type("Shape", (), {"block_size": block_size})})


@pytest.fixture
def kernels(monkeypatch):
    """The graph's kernel calls, as `kernel_calls(gm)` would find them (`gm` is the list itself here)."""
    monkeypatch.setattr(inputs, "kernel_calls", lambda gm: gm)


def test_a_pa_decode_graph_is_captured_at_vllm_ascends_pinned_length_within_its_block_table_and_max_model_len(
        kernels):
    sig = _signature(InputSpec(4, "block_table_2", Role.BLOCK_TABLE, (B, W)))
    decode, mixed = GraphKey(4, True), GraphKey(4, False)
    pa = [_Call("fia"), _Call(PA, 128)]
    wide = {3: torch.zeros(4, 100), 4: torch.zeros(4, 100)}
    assert inputs.PA_CAPTURE_SEQ_LEN == 6144
    assert capture_seq_len(pa, decode, sig, wide, 100000) == 6144
    assert capture_seq_len(pa, decode, sig, wide, None) == 6144
    assert capture_seq_len(pa, decode, sig, wide, 1000) == 1000
    assert capture_seq_len(pa, decode, sig, {3: torch.zeros(4, 8), 4: torch.zeros(4, 6)}, None) == 768
    assert capture_seq_len([_Call(PA, 16)], decode, sig, {3: torch.zeros(4, 8)}, None) == 128
    assert capture_seq_len(pa, decode, sig, {}, 100000) == 6144  # no block table staged
    assert capture_seq_len(pa, mixed, sig, wide, None) is None
    assert capture_seq_len([_Call("fia")], decode, sig, wide, None) is None
