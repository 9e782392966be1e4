"""`lowering/verify.py` at the level of its functions: the tolerance of a row per dtype and depth, where
a step writes (a KV cache at its slots' rows, anything else whole), what `compare` calls equal, and the
first-replay check's contract (both runs start from the same state; agreeing, the replay's outputs
serve; differing, eager's outputs and writes stand, logged and recorded). Fast: no model is compiled
(tests/test_verify.py checks the same end to end, on compiled models)."""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import pytest
import torch

from ascend_compile.lowering import verify
from ascend_compile.lowering.verify import Mismatch, Region, compare, first_replay_check, row_tolerance, written_regions
from ascend_compile.passes.roles import GraphSignature, InputSpec, Role

INF = float("inf")


# --- row_tolerance -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, base", [(torch.float64, (1e-6, 1e-9)), (torch.float32, (2e-3, 1e-5)),
                                         (torch.float16, (5e-3, 1e-3)), (torch.bfloat16, (5e-2, 1e-2))])
def test_row_tolerance_scales_rtol_with_the_root_of_the_depth_and_keeps_atol(dtype, base):
    assert row_tolerance(dtype, 1) == base
    assert row_tolerance(dtype, 0) == base  # no layer counts as one
    rtol, atol = row_tolerance(dtype, 9)
    assert rtol == pytest.approx(3 * base[0]) and atol == base[1]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_row_tolerance_of_other_dtypes_is_none_compared_exactly(dtype):
    assert row_tolerance(dtype, 4) is None


# --- Mismatch, Region ----------------------------------------------------------------------------

def test_a_mismatch_says_what_differed_and_by_how_much():
    assert str(Mismatch("output 0", 2.0, None)) == "output 0: max |diff| 2 (exact)"
    assert str(Mismatch("cache", 0.25, (2e-3, 1e-5))) == (
        "cache: worst row's error 0.25 of its norm (per row: rtol=0.002, atol=1e-05 an element)")


def test_a_whole_region_reads_a_copy_and_writes_in_place():
    t = torch.arange(6.0).reshape(2, 3)
    region = Region(1, None)
    args = [None, t]
    saved = region.read(args)
    t.add_(10)
    assert torch.equal(saved, torch.arange(6.0).reshape(2, 3))  # a copy, not the tensor itself
    region.write(args, saved)
    assert torch.equal(t, torch.arange(6.0).reshape(2, 3)) and args[1] is t


def test_a_rows_region_reads_and_writes_those_rows_only():
    cache = torch.arange(24.0).reshape(3, 2, 4)
    region = Region(0, (torch.tensor([0, 2]), torch.tensor([1, 0])))
    args = [cache]
    saved = region.read(args)
    assert torch.equal(saved, torch.stack([cache[0, 1], cache[2, 0]]))
    region.write(args, torch.zeros(2, 4))
    assert cache[0, 1].eq(0).all() and cache[2, 0].eq(0).all()
    untouched = torch.arange(24.0).reshape(3, 2, 4)
    untouched[0, 1] = 0
    untouched[2, 0] = 0
    assert torch.equal(cache, untouched)


# --- written_regions -----------------------------------------------------------------------------

def _signature(roles: list[Role]) -> GraphSignature:
    inputs = tuple(InputSpec(i, f"in{i}", role, None) for i, role in enumerate(roles))
    return GraphSignature(inputs, 1, 1, {}, {}, ())


def test_a_cache_is_written_at_its_slots_rows_of_every_slot_mapping_and_other_inputs_whole():
    big = torch.zeros(4, 3, 2)  # 12 slots, block size 3
    small = torch.zeros(2, 3)  # a two-dimensional cache of 6 slots
    flat = torch.zeros(5)  # a cache of one dimension: written whole
    buffer = torch.zeros(7)
    signature = _signature([Role.KV_CACHE, Role.SLOT_MAPPING, Role.KV_CACHE, Role.SLOT_MAPPING, Role.STATIC,
                            Role.KV_CACHE, Role.BATCH, Role.STATIC])
    args = [big, torch.tensor([[0, -1], [7, 5]]), small, torch.tensor([5, 6, 11, -1]), buffer, flat, 3, torch.ones(2)]
    regions = written_regions(signature, {6, 5, 4, 2, 0}, args)
    assert [r.index for r in regions] == [0, 2, 4, 5]  # the int (6) is no region; 7 is not written
    by_index = {r.index: r for r in regions}
    blocks, offsets = by_index[0].rows
    assert (blocks * 3 + offsets).tolist() == [0, 5, 6, 7, 11]  # both mappings' valid slots, once each
    assert (blocks.tolist(), offsets.tolist()) == ([0, 1, 2, 2, 3], [0, 2, 0, 1, 2])
    blocks, offsets = by_index[2].rows
    assert (blocks.tolist(), offsets.tolist()) == ([0, 1], [0, 2])  # slots 0 and 5: those within the cache
    assert by_index[4].rows is None and by_index[5].rows is None


def test_without_a_slot_mapping_a_cache_is_written_whole():
    cache = torch.zeros(4, 3, 2)
    regions = written_regions(_signature([Role.KV_CACHE]), {0}, [cache])
    assert [(r.index, r.rows) for r in regions] == [(0, None)]


def test_a_cache_at_the_last_slot_of_its_capacity():
    cache = torch.zeros(2, 4)  # 8 slots
    signature = _signature([Role.KV_CACHE, Role.SLOT_MAPPING])
    (region,) = written_regions(signature, {0}, [cache, torch.tensor([7, 8, 3])])
    assert (region.rows[0].tolist(), region.rows[1].tolist()) == ([0, 1], [3, 3])


# --- compare -------------------------------------------------------------------------------------

def test_compare_of_non_tensors_is_equality():
    assert compare("n", 3, 3) is None
    m = compare("n", 3, 4)
    assert (m.what, m.error, m.tolerance) == ("n", INF, None)


def test_compare_refuses_another_shape_dtype_or_a_non_tensor():
    m = compare("out", torch.zeros(2, 3), torch.zeros(3, 2))
    assert (m.what, m.error, m.tolerance) == ("out (shape (2, 3), expected (3, 2))", INF, None)
    m = compare("out", torch.zeros(2, dtype=torch.float64), torch.zeros(2))
    assert (m.what, m.error) == ("out (shape (2,), expected (2,))", INF)
    m = compare("out", 5, torch.zeros(2))
    assert (m.what, m.error) == ("out (shape int, expected (2,))", INF)


def test_compare_of_integers_is_exact_and_reports_the_largest_difference():
    assert compare("i", torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])) is None
    m = compare("i", torch.tensor([1, 7, 3]), torch.tensor([1, 2, 5]))
    assert (m.what, m.error, m.tolerance) == ("i", 5.0, None)
    assert compare("b", torch.tensor([True]), torch.tensor([False])).error == 1.0


def test_compare_of_empty_tensors_and_of_one_element():
    assert compare("e", torch.zeros(0, 4), torch.zeros(0, 4)) is None
    assert compare("s", torch.tensor([1.5]), torch.tensor([1.5])) is None
    assert compare("s", torch.tensor([2.0]), torch.tensor([1.0])) is not None
    assert compare("0d", torch.tensor(2.0), torch.tensor(1.0)).error == pytest.approx(1.0)
    assert compare("0d", torch.tensor(1.0), torch.tensor(1.0)) is None


def test_compare_wants_nans_and_infinities_where_eager_has_them():
    tol = row_tolerance(torch.float32, 1)
    nan, inf = float("nan"), INF
    assert compare("x", torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0])) is None
    assert compare("x", torch.tensor([inf, 1.0, -inf]), torch.tensor([inf, 1.0, -inf])) is None
    m = compare("x", torch.tensor([inf, 1.0]), torch.tensor([2.0, 1.0]))  # an infinite error of its row
    assert (m.what, m.error) == ("x", INF)
    for got, want in [([nan, 1.0], [0.0, 1.0]), ([0.0, 1.0], [nan, 1.0]), ([2.0, 1.0], [inf, 1.0]),
                      ([-inf, 1.0], [inf, 1.0])]:
        m = compare("x", torch.tensor(got), torch.tensor(want))
        assert m is not None, (got, want)
        assert (m.what, m.error, m.tolerance) == ("x (NaN or infinity where eager has none, or none where it has)",
                                                  INF, tol)
    # the finite elements beside an infinity are still compared
    assert compare("x", torch.tensor([inf, 2.0]), torch.tensor([inf, 1.0])) is not None


def test_compare_checks_each_row_against_its_own_norm():
    want = torch.tensor([[1000.0, 1000.0], [1.0, 1.0]])
    got = want.clone()
    got[1, 0] += 0.05  # 3.5% of its row: far within the first row's norm, not within its own
    m = compare("o", got, want)
    assert m is not None and m.error == pytest.approx(0.05 / 2 ** 0.5, rel=1e-4)
    assert m.tolerance == row_tolerance(torch.float32, 1)
    got = want.clone()
    got[0, 0] += 1.0  # 0.07% of its row
    assert compare("o", got, want) is None


def test_compare_reports_the_worst_row_relative_to_its_norm():
    want = torch.tensor([[3.0, 4.0], [6.0, 8.0], [0.0, 0.0]], dtype=torch.float64)
    got = torch.tensor([[3.0, 5.0], [6.0, 8.5], [0.0, 0.0]], dtype=torch.float64)
    assert compare("o", got, want).error == pytest.approx(0.2)  # 1/5 beats 0.5/10
    got = torch.tensor([[3.0, 4.0], [6.0, 8.0], [0.0, 2.0]], dtype=torch.float64)
    assert compare("o", got, want).error == pytest.approx(2.0 / 1e-9)  # a zero row: its error over atol


def test_compare_rows_near_zero_within_atol_an_element():
    n = 4  # atol an element: atol * sqrt(4) of a row's error
    atol = row_tolerance(torch.float32, 1)[1]
    want = torch.zeros(3, n)
    assert compare("z", torch.full((3, n), 0.9 * atol), want) is None  # error 1.8 atol: within 2 atol
    assert compare("z", torch.full((3, n), 1.2 * atol), want) is not None  # error 2.4 atol


def test_compare_bound_is_inclusive():
    want = torch.zeros(1, 1, dtype=torch.float64)
    assert compare("z", torch.full((1, 1), 1e-9, dtype=torch.float64), want) is None  # error == atol exactly
    assert compare("z", torch.full((1, 1), 1.01e-9, dtype=torch.float64), want) is not None


def test_compare_tolerance_grows_with_depth():
    want = torch.tensor([[1.0, 0.0]])
    got = torch.tensor([[1.003, 0.0]])  # 3e-3 of its row: over float32's 2e-3, within 4e-3 at four layers
    assert compare("d", got, want) is not None
    assert compare("d", got, want, layers=4) is None
    assert compare("d", got, want, layers=4 * 4 * 4) is None
    assert compare("d", torch.tensor([[1.005, 0.0]]), want, layers=4) is not None


def test_compare_flattens_leading_dimensions_into_rows():
    want = torch.ones(2, 3, 4)
    got = want.clone()
    got[1, 2, 0] = 1.01  # 0.5% of its row of four: over float32's 2e-3
    assert compare("o", got, want) is not None
    got[1, 2, 0] = 1.0 + 1e-4
    assert compare("o", got, want) is None


# --- first_replay_check --------------------------------------------------------------------------

class Step:
    """A stand-in step over a cache (written at rows) and a counter (written whole): each run adds
    `delta` to the cache's rows and 1 to the counter, and returns the counter and the rows' sum."""

    def __init__(self) -> None:
        self.cache = torch.zeros(4, 2, 3)
        self.counter = torch.zeros(1)
        self.args = [self.cache, self.counter]
        self.regions = [Region(0, (torch.tensor([1, 3]), torch.tensor([0, 1]))), Region(1, None)]
        self.names = {0: "cache", 1: "counter"}
        self.generators: list[str] = []
        self.seen: list[tuple[float, float]] = []

    def run(self, delta: float, as_tuple: bool = True):
        self.seen.append((float(self.counter), float(self.cache.sum())))
        self.cache[1, 0] += delta
        self.cache[3, 1] += delta
        self.counter += 1
        out = (self.counter.clone(), self.cache[1, 0].sum().reshape(1))
        return out if as_tuple else out[1]

    @contextlib.contextmanager
    def kept(self):
        self.generators.append("in")
        yield
        self.generators.append("out")

    def eager(self, delta: float = 1.0, as_tuple: bool = True):
        def run():
            assert self.generators == ["in"], "eager runs inside generators_kept"
            return self.run(delta, as_tuple)
        return run

    def check(self, replay_delta: float = 1.0, as_tuple: bool = True, layers: int = 1, replay=None):
        replay = replay or (lambda: self.run(replay_delta, as_tuple))
        return first_replay_check("b4.decode", self.regions, self.args, self.eager(1.0, as_tuple), replay,
                                  self.names, self.kept, layers)


def test_an_agreeing_replay_serves_its_own_outputs_and_writes(caplog):
    step = Step()
    replayed = []

    def replay():
        replayed.append(step.run(1.0))
        return replayed[-1]
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        outputs, record = step.check(replay=replay)
    assert outputs is replayed[0]
    assert step.seen == [(0.0, 0.0), (0.0, 0.0)]  # the replay starts from the state eager started from
    assert step.generators == ["in", "out"]
    assert record["ok"] is True and record["mismatches"] == []
    assert isinstance(record["seconds"], float) and 0 <= record["seconds"] < 5
    assert float(step.counter) == 1.0 and float(step.cache.sum()) == 6.0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("first replay equals eager" in r.getMessage() for r in caplog.records)


def test_a_differing_replay_is_recorded_and_eagers_outputs_and_writes_stand(caplog):
    step = Step()
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        outputs, record = step.check(replay_delta=5.0)
    assert isinstance(outputs, tuple) and len(outputs) == 2
    assert float(outputs[0]) == 1.0 and float(outputs[1]) == 3.0  # eager's
    assert float(step.counter) == 1.0 and step.cache[1, 0].tolist() == [1.0, 1.0, 1.0]
    assert step.cache[3, 1].tolist() == [1.0, 1.0, 1.0] and float(step.cache.sum()) == 6.0
    assert record["ok"] is False
    assert [m.split(":")[0] for m in record["mismatches"]] == ["output 1", "cache (the step's rows)"]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("ascend_compile: b4.decode: first replay differs from eager: output 1: ")
    assert warning.endswith("; its steps run eagerly") and "cache (the step's rows)" in warning


def test_a_warning_names_three_mismatches_at_most(caplog):
    step = Step()
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        _, record = step.check(replay=lambda: (step.counter.add_(3), step.run(5.0))[1])
    assert len(record["mismatches"]) == 4  # two outputs, the cache's rows, the counter
    assert record["mismatches"][3].startswith("counter: ")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "cache (the step's rows)" in warning and "counter:" not in warning


def test_a_single_output_is_returned_as_one():
    step = Step()
    outputs, record = step.check(replay_delta=5.0, as_tuple=False)
    assert isinstance(outputs, torch.Tensor) and float(outputs) == 3.0 and not record["ok"]
    step = Step()
    outputs, record = step.check(as_tuple=False)
    assert isinstance(outputs, torch.Tensor) and float(outputs) == 3.0 and record["ok"]


def test_a_list_of_outputs_comes_back_as_a_sequence():
    step = Step()
    outputs, record = step.check(replay=lambda: [step.run(3.0)[0]])
    assert not record["ok"] and isinstance(outputs, tuple) and len(outputs) == 2
    assert "1 outputs, expected 2: max |diff| inf (exact)" in record["mismatches"]


def test_more_outputs_than_eager_is_a_mismatch():
    step = Step()
    _, record = step.check(replay=lambda: (*step.run(1.0), torch.zeros(1)))
    assert record["mismatches"] == ["3 outputs, expected 2: max |diff| inf (exact)"]


def _drifting_step() -> tuple[Step, Any]:
    """A step and a replay of it whose cache row drifts by 0.3%: past one layer's tolerance, within four's."""
    step = Step()
    step.cache += 1.0

    def replay():
        out = step.run(1.0)
        step.cache[1, 0] *= 1.003
        return out
    return step, replay


def test_the_check_compares_within_the_depths_tolerance():
    step, replay = _drifting_step()
    assert not step.check(replay=replay)[1]["ok"]
    step, replay = _drifting_step()
    assert step.check(replay=replay, layers=4)[1]["ok"]


def test_the_module_logs_to_the_packages_logger():
    assert verify.log.name == "ascend_compile"


class Clock:
    """`time` for verify: perf_counter reads 1.0, then 1.0 + `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.readings = [1.0, 1.0 + seconds]

    def perf_counter(self) -> float:
        return self.readings.pop(0)


def test_the_record_and_the_log_give_the_checks_seconds(monkeypatch, caplog):
    monkeypatch.setattr(verify, "time", Clock(0.123456))
    step = Step()
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        _, record = step.check()
    assert record["seconds"] == 0.1235  # to a tenth of a millisecond
    assert [r.getMessage() for r in caplog.records] == ["ascend_compile: b4.decode: first replay equals eager (0.123 s)"]


def test_the_warning_joins_the_mismatches(caplog):
    step = Step()
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        _, record = step.check(replay_delta=5.0)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert len(record["mismatches"]) == 2
    assert warning == ("ascend_compile: b4.decode: first replay differs from eager: "
                       f"{'; '.join(record['mismatches'])}; its steps run eagerly")


def test_eagers_outputs_are_taken_as_they_were_when_it_returned():
    """An output eager leaves in a scratch buffer that the replay's run overwrites (not a written input,
    not an output of the replay) is compared, and returned, as eager returned it."""
    step = Step()
    scratch = torch.zeros(3)

    def eager():
        step.run(1.0)
        scratch.fill_(4.0)
        return scratch, 7  # a tensor and a host value
    def replay(garbage: float):
        def run():
            step.run(1.0)
            scratch.fill_(garbage)
            return torch.full((3,), 4.0), 7
        return run
    outputs, record = first_replay_check("b4", step.regions, step.args, eager, replay(-1.0), step.names, step.kept)
    assert record["ok"] and outputs[0].tolist() == [4.0] * 3 and outputs[1] == 7
    step = Step()
    outputs, record = first_replay_check("b4", step.regions, step.args, eager, lambda: (torch.zeros(3), 8),
                                         step.names, step.kept)
    assert not record["ok"] and record["mismatches"][1] == "output 1: max |diff| inf (exact)"
    assert outputs[0].tolist() == [4.0] * 3 and outputs[1] == 7  # eager's, as it returned them


def test_outputs_are_compared_within_the_depths_tolerance():
    for layers, ok in ((1, False), (4, True)):
        step = Step()
        eager = lambda: torch.tensor([[1.0, 0.0]])  # noqa: E731
        replay = lambda: torch.tensor([[1.003, 0.0]])  # noqa: E731
        _, record = first_replay_check("b4", [], step.args, eager, replay, step.names, step.kept, layers)
        assert record["ok"] is ok, layers


def test_by_default_a_graph_is_one_layer_deep():
    step = Step()
    eager = lambda: torch.tensor([[1.0, 0.0]])  # noqa: E731
    replay = lambda: torch.tensor([[1.0025, 0.0]])  # noqa: E731  (within 2e-3 sqrt(2), not 2e-3)
    _, record = first_replay_check("b4", [], step.args, eager, replay, step.names, step.kept)
    assert not record["ok"]


def test_a_single_output_keeps_its_shape():
    step = Step()
    outputs, record = step.check(replay_delta=5.0, as_tuple=False)
    assert outputs.shape == (1,) and not record["ok"]
    outputs, record = first_replay_check("b4", [], [], lambda: torch.ones(2, 3), lambda: torch.zeros(2, 3), {},
                                         step.kept)
    assert not record["ok"] and outputs.shape == (2, 3) and outputs.eq(1).all()


def test_an_infinity_beside_a_finite_element_adds_nothing_to_its_rows_norm():
    want = torch.tensor([[INF, 1.0]])
    got = torch.tensor([[INF, 1.0025]])  # 2.5e-3 of the row's finite norm (1): over float32's 2e-3
    m = compare("x", got, want)
    assert m is not None and m.error == pytest.approx(2.5e-3, rel=1e-3)
    assert compare("x", torch.tensor([[INF, 1.0015]]), want) is None
