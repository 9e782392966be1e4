"""`lowering/undo.py` at the level of its functions: which inputs a graph's plan saves by rows (a cache
whose every write is a cache write at a slot mapping) and which whole, the note a failed step gets on
the default path, what `save` reads (and the device ops it issues, counted for the statistics), and
`restore`. Fast: no model is compiled (tests/test_failed_steps.py checks the same end to end; the
cache layouts of vLLM: tests/test_undo_layouts.py)."""
from __future__ import annotations

import pytest
import torch
from torch import fx

import ascend_compile.ops  # noqa: F401  (registers torch.ops.ascend)
from ascend_compile.lowering.inputs import Step
from ascend_compile.lowering.undo import NOTHING_SAVED, Undo, UndoPlan, _halves
from ascend_compile.passes.mutations import InputWrite, MutationFacts

NB, BS, H, D = 8, 4, 2, 3


def _graph(*writes: tuple, inputs: int = 6) -> fx.GraphModule:
    """A graph of `inputs` placeholders calling each of `writes` ((op, arg, ...), an int arg naming a
    placeholder, "view" a view of placeholder 0)."""
    graph = fx.Graph()
    nodes = [graph.placeholder(f"in{i}") for i in range(inputs)]
    view = graph.call_function(torch.ops.aten.view.default, (nodes[0], [-1]))
    for op, *args in writes:
        graph.call_function(op, tuple(view if a == "view" else nodes[a] if isinstance(a, int) else a for a in args))
    graph.output(None)
    return fx.GraphModule(torch.nn.Module(), graph)


def _facts(*unsafe: int) -> MutationFacts:
    return MutationFacts(tuple(InputWrite(i, f"w{i}", False, None) for i in unsafe) +
                         (InputWrite(0, "cache_write", True, None),), frozenset(), ())


CACHE = torch.ops.ascend.reshape_and_cache.default
MLA = torch.ops.ascend.mla_cache_write.default


def test_caches_written_only_by_cache_writes_are_saved_by_rows_at_their_slot_mapping():
    gm = _graph((CACHE, 4, 4, 0, 1, 5), (MLA, 4, 4, 2, 3, 5))
    plan = UndoPlan.of(gm, _facts(), {0, 1, 2, 3})
    assert plan == UndoPlan(rows=((0, 5), (1, 5), (2, 5), (3, 5)), whole=())


def test_the_packet_of_a_cache_write_counts_too():
    gm = _graph((torch.ops.ascend.reshape_and_cache, 4, 4, 0, 1, 5))
    assert UndoPlan.of(gm, _facts(), {0, 1}).rows == ((0, 5), (1, 5))


def test_a_cache_a_plain_op_writes_too_is_saved_whole():
    gm = _graph((CACHE, 4, 4, 0, 1, 5))
    plan = UndoPlan.of(gm, _facts(1), {0, 1, 2})  # input 1 also written by an op unsafe under padding
    assert plan == UndoPlan(rows=((0, 5),), whole=(1, 2))


def test_only_the_inputs_written_in_place_are_in_the_plan():
    gm = _graph((CACHE, 4, 4, 0, 1, 5))
    assert UndoPlan.of(gm, _facts(), {1}) == UndoPlan(rows=((1, 5),), whole=())
    assert UndoPlan.of(gm, _facts(), set()) == UndoPlan(rows=(), whole=())


def test_a_cache_write_into_a_view_or_at_computed_slots_saves_the_input_whole():
    gm = _graph((CACHE, 4, 4, "view", 1, 5))  # the key cache is a view of input 0, not the input itself
    assert UndoPlan.of(gm, _facts(), {0, 1}) == UndoPlan(rows=((1, 5),), whole=(0,))
    graph = fx.Graph()
    p = [graph.placeholder(f"in{i}") for i in range(6)]
    slots = graph.call_function(torch.ops.aten.clone.default, (p[5],))
    graph.call_function(CACHE, (p[4], p[4], p[0], p[1], slots))
    graph.output(None)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert UndoPlan.of(gm, _facts(), {0, 1}) == UndoPlan(rows=(), whole=(0, 1))


# --- failure_note ---------------------------------------------------------------------------------

def _step(seqs: int, starts: list[int] | None = None) -> Step:
    return Step([], {}, seqs, seqs, starts is None, {}, {"qsl": starts} if starts is not None else {})


def test_the_note_of_a_step_whose_writes_were_put_back():
    plan = UndoPlan(rows=((0, 2),), whole=())
    args = [None, None, torch.tensor([3, 4])]
    saved = plan.save(args_with_cache(args), rows_wanted=True)
    assert plan.failure_note(saved, args, _step(2)) == "what it wrote in place is put back"
    no_rows = UndoPlan(rows=(), whole=(1,))
    assert no_rows.failure_note(NOTHING_SAVED, args, _step(2)) == "what it wrote in place is put back"


def args_with_cache(args: list) -> list:
    return [torch.zeros(NB, BS, H, D), *args[1:]]


def test_the_note_of_a_decode_step_names_its_caches_slots_and_sequences():
    plan = UndoPlan(rows=((0, 4), (1, 4), (2, 5), (3, 5)), whole=())
    args = [None] * 4 + [torch.tensor([[9, -1], [3, 7]]), torch.tensor([7, 12])]
    note = plan.failure_note(NOTHING_SAVED, args, _step(3))
    assert note == ("it may have written 4 KV caches at its own slots 3..12 (4 slots), for its 3 sequences "
                    "(query tokens 1, 1, 1), and no other row; run the same step again to write them anew")


def test_the_note_of_a_mixed_step_gives_each_sequences_query_tokens_sixteen_at_most():
    plan = UndoPlan(rows=((0, 1), (0, 2)), whole=())
    args = [None, torch.tensor([-1, -1]), torch.tensor([-1])]
    starts = list(range(0, 2 * 17 + 1, 2))  # 17 sequences of 2 tokens
    note = plan.failure_note(NOTHING_SAVED, args, _step(17, starts))
    assert note.startswith("it may have written 1 KV caches at its own no slot, for its 17 sequences (query tokens ")
    assert "(query tokens " + ", ".join(["2"] * 16) + ", ...)" in note
    note = plan.failure_note(NOTHING_SAVED, args, _step(3, [0, 1, 4, 6]))
    assert "(query tokens 1, 3, 2)" in note and "..." not in note
    note = plan.failure_note(NOTHING_SAVED, args, _step(16, list(range(17))))
    assert "(query tokens " + ", ".join(["1"] * 16) + ")" in note


def test_slot_zero_is_a_slot():
    plan = UndoPlan(rows=((0, 1),), whole=())
    note = plan.failure_note(NOTHING_SAVED, [None, torch.tensor([0, -1])], _step(1))
    assert "at its own slots 0..0 (1 slots)" in note


# --- save, restore, nbytes ------------------------------------------------------------------------

def test_nothing_to_save_is_the_shared_empty_log():
    plan = UndoPlan(rows=((0, 1),), whole=())
    args = [torch.zeros(NB, BS, H, D), torch.tensor([1])]
    assert plan.save(args, rows_wanted=False) is NOTHING_SAVED
    assert UndoPlan(rows=(), whole=()).save(args, rows_wanted=True) is NOTHING_SAVED
    assert NOTHING_SAVED.nbytes == 0 and NOTHING_SAVED.launches == 0


def test_inputs_written_whole_are_saved_whole_and_put_back():
    counter, buffer = torch.tensor([5]), torch.arange(6.0)
    plan = UndoPlan(rows=((0, 3),), whole=(1, 2, 4))
    args = [torch.zeros(NB, BS, H, D), counter, buffer, torch.tensor([1]), 7]  # 7: not a tensor, not saved
    undo = plan.save(args, rows_wanted=False)  # the caches' rows are not wanted: only the whole inputs
    assert undo.rows == [] and undo.launches == 2 and undo.nbytes == 8 + 6 * 4
    counter.add_(1)
    buffer.zero_()
    undo.restore()
    assert counter.tolist() == [5] and buffer.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_separate_caches_are_saved_at_their_slots_one_index_for_all():
    torch.manual_seed(0)
    caches = [torch.randn(NB, BS, H, D) for _ in range(3)]
    slots = torch.tensor([5, -1, 31])  # padding (-1) is read as slot 0
    plan = UndoPlan(rows=((0, 3), (1, 3), (2, 3)), whole=())
    args = [*caches, slots]
    before = [c.clone() for c in caches]
    undo = plan.save(args, rows_wanted=True)
    assert undo.launches == 2 + 3  # the index (a clamp, a cast) once, a gather per cache
    assert undo.nbytes == 3 * 3 * H * D * 4
    assert [where.tolist() for _, where, _ in undo.rows] == [[5, 0, 31]] * 3
    for c in caches:
        c.fill_(9.0)
    undo.restore()
    for c, b in zip(caches, before):
        rows, want = c.flatten(0, 1), b.flatten(0, 1)
        for slot in range(NB * BS):
            expected = want[slot] if slot in (0, 5, 31) else torch.full((H, D), 9.0)
            assert torch.equal(rows[slot], expected), slot


def test_slots_past_the_cache_are_clamped_into_it():
    cache = torch.arange(float(NB * BS)).reshape(NB, BS, 1, 1)
    plan = UndoPlan(rows=((0, 1),), whole=())
    undo = plan.save([cache, torch.tensor([NB * BS + 5, NB * BS - 1, -3])], rows_wanted=True)
    (_, where, saved), = undo.rows
    assert where.tolist() == [NB * BS - 1, NB * BS - 1, 0] and where.dtype == torch.int64
    assert saved.flatten().tolist() == [NB * BS - 1, NB * BS - 1, 0]


def test_caches_of_other_capacities_get_their_own_index():
    big, small = torch.zeros(NB, BS, 1, 1), torch.zeros(2, BS, 1, 1)
    plan = UndoPlan(rows=((0, 2), (1, 2)), whole=())
    undo = plan.save([big, small, torch.tensor([20, 3])], rows_wanted=True)
    assert [where.tolist() for _, where, _ in undo.rows] == [[20, 3], [7, 3]]
    assert undo.launches == 2 * 2 + 2


def test_two_slot_mappings_each_get_their_index():
    a, b = torch.zeros(NB, BS, 1, 1), torch.zeros(NB, BS, 1, 1)
    plan = UndoPlan(rows=((0, 2), (1, 3)), whole=())
    undo = plan.save([a, b, torch.tensor([1]), torch.tensor([2])], rows_wanted=True)
    assert [where.tolist() for _, where, _ in undo.rows] == [[1], [2]] and undo.launches == 6


def test_a_cache_of_one_dimension_is_saved_whole():
    flat = torch.arange(5.0)
    plan = UndoPlan(rows=((0, 1),), whole=())
    undo = plan.save([flat, torch.tensor([2])], rows_wanted=True)
    assert undo.rows == [] and undo.launches == 1 and undo.nbytes == 20
    flat.zero_()
    undo.restore()
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    # after an input saved whole, and before a cache saved by rows: each counted, the later cache still read
    cache, other = torch.arange(float(NB * BS)).reshape(NB, BS), torch.ones(2)
    plan = UndoPlan(rows=((0, 1), (3, 1)), whole=(2,))
    undo = plan.save([flat, torch.tensor([2]), other, cache], rows_wanted=True)
    assert [t is other for t, _ in undo.whole] == [True, False] and len(undo.rows) == 1
    assert undo.launches == 1 + 1 + 2 + 1  # the input, the flat cache, the slots clamped and cast, the gather


def test_two_dimensional_caches_are_saved_by_rows():
    cache = torch.arange(float(NB * BS)).reshape(NB, BS)
    undo = UndoPlan(rows=((0, 1),), whole=()).save([cache, torch.tensor([6])], rows_wanted=True)
    (_, where, saved), = undo.rows
    assert where.tolist() == [6] and saved.tolist() == [6.0]


def test_halves_of_one_allocation_are_read_in_one_gather_by_block_and_offset():
    torch.manual_seed(1)
    cache = torch.randn(NB, 2, BS, H, D)  # vLLM 0.23: [num_blocks, 2, ...]
    other = torch.randn(NB, 2, BS, H, D)
    slots = torch.tensor([6, 17])
    args = [cache[:, 0], cache[:, 1], other[:, 0], other[:, 1], slots]
    plan = UndoPlan(rows=((0, 4), (1, 4), (2, 4), (3, 4)), whole=())
    before, other_before = cache.clone(), other.clone()
    undo = plan.save(args, rows_wanted=True)
    assert len(undo.rows) == 2  # one gather per layer
    assert undo.launches == 2 + 2 + 1 + 1  # index; blocks and offsets (shared); a gather per layer
    (target, where, saved), _ = undo.rows
    assert isinstance(where, tuple) and [w.tolist() for w in where] == [[1, 4], [2, 1]]
    assert target.shape == (NB, BS, 2, H, D) and torch.equal(saved[:, 0], cache[[1, 4], 0, [2, 1]])
    assert torch.equal(saved[:, 1], cache[[1, 4], 1, [2, 1]])
    cache.fill_(3.0)
    other.fill_(3.0)
    undo.restore()
    for c, b in ((cache, before), (other, other_before)):
        for block, offset in ((1, 2), (4, 1)):
            assert torch.equal(c[block, :, offset], b[block, :, offset])
        c[[1, 4], :, [2, 1]] = 3.0
        assert c.eq(3.0).all()  # nothing else written


def test_a_strided_cache_alone_is_read_by_block_and_offset():
    cache = torch.randn(NB, 2, BS, H, D)
    plan = UndoPlan(rows=((0, 1),), whole=())
    undo = plan.save([cache[:, 1], torch.tensor([9])], rows_wanted=True)
    (_, where, saved), = undo.rows
    assert [w.tolist() for w in where] == [[2], [1]] and torch.equal(saved[0], cache[2, 1, 1])
    assert undo.launches == 5


def test_halves_are_paired_only_at_the_same_slot_mapping():
    cache = torch.randn(NB, 2, BS, H, D)
    plan = UndoPlan(rows=((0, 2), (1, 3)), whole=())
    undo = plan.save([cache[:, 0], cache[:, 1], torch.tensor([1]), torch.tensor([1])], rows_wanted=True)
    assert len(undo.rows) == 2 and all(t.shape == (NB, BS, H, D) for t, _, _ in undo.rows)


def test_halves_of_a_key_and_value_page():
    page = torch.randn(NB, H, BS, 2 * D)  # vLLM 0.33: a page, split on its last dimension
    key, value = page.transpose(1, 2).split(D, dim=-1)
    pair = _halves(key, value)
    assert pair is not None and pair.shape == (NB, BS, 2, H, D)
    assert torch.equal(pair[:, :, 0], key) and torch.equal(pair[:, :, 1], value)


def test_halves_refuses_what_is_not_one_allocation_of_one_layout():
    cache = torch.randn(NB, 2, BS, H, D)
    key, value = cache[:, 0], cache[:, 1]
    pair = _halves(key, value)
    assert pair is not None and torch.equal(pair[:, :, 1], value) and pair.storage_offset() == key.storage_offset()
    assert _halves(value, key) is None  # the value before the key
    assert _halves(key, key) is None  # no distance
    assert _halves(key, torch.randn(NB, BS, H, D)) is None  # another allocation
    assert _halves(key, value.to(torch.float64)) is None
    assert _halves(key, 1) is None and _halves(1, value) is None
    assert _halves(cache[:, 0, :, 0], cache[:, 0, :, 1]) is not None  # three dimensions
    flat = torch.randn(NB, 2, BS)
    assert _halves(flat[:, 0], flat[:, 1]) is None  # two dimensions: a cache of rows of one element
    assert _halves(key, cache[:, 1, :, :, :2]) is None  # another shape
    wide = torch.randn(NB, 2, BS, H, 2 * D)
    assert _halves(key, wide[:, 1, :, :, :D]) is None  # another allocation, same shape
    assert _halves(key, torch.randn(NB, 2, BS, H, D)[:, 1]) is None  # another allocation, same layout, further on
    interleaved = torch.randn(NB, BS, H, 2)  # the two halves one element apart
    pair = _halves(interleaved[..., 0], interleaved[..., 1])
    assert pair is not None and torch.equal(pair, interleaved.movedim(-1, 2))
    other_strides = torch.randn(NB, 2, BS, D, H).transpose(-1, -2)
    assert _halves(other_strides[:, 0], other_strides[:, 1]) is not None
    assert _halves(key, other_strides[:, 1]) is None  # other strides
    int_cache = torch.zeros(NB, 2, BS, H, D, dtype=torch.int32)
    assert _halves(int_cache[:, 0], int_cache[:, 1].view(torch.float32)) is None  # another dtype, same bytes


def test_restore_puts_back_whole_inputs_and_rows():
    whole = torch.arange(3.0)
    cache = torch.zeros(4, 2)
    undo = Undo([(cache, torch.tensor([2, 0]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))],
                [(whole, torch.tensor([7.0, 8.0, 9.0]))], launches=3)
    assert undo.nbytes == 4 * 4 + 3 * 4
    undo.restore()
    assert whole.tolist() == [7.0, 8.0, 9.0]
    assert cache.tolist() == [[3.0, 4.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]


@pytest.mark.parametrize("rows_wanted", [True, False])
def test_save_and_restore_run_in_inference_mode_on_tensors_that_require_no_grad(rows_wanted):
    cache = torch.zeros(NB, BS, 1, 1)
    counter = torch.zeros(1)
    undo = UndoPlan(rows=((0, 2),), whole=(1,)).save([cache, counter, torch.tensor([3])], rows_wanted=rows_wanted)
    assert all(c.is_inference() for _, c in undo.whole)
    assert len(undo.rows) == (1 if rows_wanted else 0)
