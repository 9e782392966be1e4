"""Tensor parallelism: 2 CPU ranks (gloo) compile their shard of the example decoder; every step on
every rank must match the unsplit model, computed eagerly in the same rank process.

One spawned pair of ranks runs every case in sequence (spawning costs seconds); a hang fails the
module's tests after `TIMEOUT` seconds instead of blocking. The model and the step schedule are
`examples/tensor_parallel.py`'s (`python -m examples.tensor_parallel` runs one case by hand).
"""
from __future__ import annotations

import pytest
import torch

from examples.tensor_parallel import ATOL, STEPS, Case, spawn_ranks

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo"
)

WORLD = 2
TIMEOUT = 600.0  # a hang guard, not a speed check: CI installs the torch 2.14 venv beside this suite
CASES = (
    Case("sim", runtime="sim"),
    Case("sim_dynamic", runtime="sim", dynamic=True),
    Case("eager", runtime="eager"),
    Case("eager_dynamic", runtime="eager", dynamic=True),
    Case("sim_new_group", runtime="sim", new_group=True),
    Case("sim_dynamic_plain_tensors", runtime="sim", dynamic=True, plain_tensors=True),
    # vLLM's shape on CUDA: a custom op whose body calls dist.all_reduce in place (c10d.allreduce_);
    # a replay that does not reduce again returns each rank's partial sums
    Case("sim_custom_op", runtime="sim", custom_op=True),
    # the device refuses, on rank 0 only, a bucket's decode graph and a piecewise size (issue 48)
    Case("sim_capture_fault", runtime="sim", capture_faults=("b4.decode", "p16 piece 0")),
    # rank 0's device out of streams (207008) at its first capture: no rank tries another graph
    Case("sim_streams_out", runtime="sim", capture_faults=("b4.decode",), streams_out=True),
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every rank's results of every case: one spawned group of ranks for the whole module."""
    return spawn_ranks(CASES, world=WORLD, timeout=TIMEOUT, workdir=str(tmp_path_factory.mktemp("tp")))


def _results(ranks: list[dict], name: str) -> list[dict]:
    out = []
    for rank, results in enumerate(ranks):
        res = results[name]
        if "failure" in res:
            pytest.fail(f"case {name}, rank {rank} raised:\n{res['failure']}")
        out.append(res)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_step_on_every_rank_matches_the_unsplit_model(ranks, case) -> None:
    per_rank = _results(ranks, case.name)
    for rank, res in enumerate(per_rank):
        assert len(res["errors"]) == len(STEPS)
        wrong = {res["steps"][i]: e for i, e in enumerate(res["errors"]) if not e <= ATOL}
        assert not wrong, f"case {case.name}, rank {rank}: steps off the unsplit model: {wrong}"
    # Same shapes on every rank: same buckets, so the same captures, replays and eager fallbacks.
    assert all(res["stats"] == per_rank[0]["stats"] for res in per_rank), [r["stats"] for r in per_rank]
    stats = per_rank[0]["stats"]
    assert stats["steps"] == len(STEPS)
    # the 9- and 12-token steps are above the largest bucket (8): piecewise where graphs are captured
    assert stats.get("eager_fallbacks", 0) + stats.get("piecewise_steps", 0) >= 2
    if case.runtime == "sim" and not case.streams_out:
        assert stats["captures"] >= 4 and stats["replays"] >= 4, stats


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_sim_steps_match_eager_runtime_steps(ranks, dynamic) -> None:
    """Regression: the simulator delivered a functional all_reduce's output before its work was done
    (a partial sum, silently), and the graph's wait_tensor did not wait (fixed in c6308bb)."""
    suffix = "_dynamic" if dynamic else ""
    for rank, (sim, eager) in enumerate(zip(_results(ranks, "sim" + suffix), _results(ranks, "eager" + suffix))):
        for i, (a, b) in enumerate(zip(sim["outputs"], eager["outputs"])):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m: f"rank {rank}, step {i}: {m}")


def test_a_capture_refused_on_one_rank_is_given_up_on_every_rank(ranks) -> None:
    """Rank 0's device refuses b4.decode and p16 (an error at `capture_begin`); rank 1's captures them,
    then gives them up too (their collectives' ranks agree): both serve those steps piecewise or
    eagerly, equal to the unsplit model (the parametrized test above), and every other graph is
    captured and replayed on both."""
    per_rank = _results(ranks, "sim_capture_fault")
    assert set(per_rank[0]["failed_captures"]) == set(per_rank[1]["failed_captures"]) == {"b4.decode", "p16"}
    assert all("error code is 507000" in why for why in per_rank[0]["failed_captures"].values())
    assert all("another rank" in why for why in per_rank[1]["failed_captures"].values())
    stats = per_rank[0]["stats"]
    assert stats["failed_captures"] == 2 and stats["captures"] >= 3 and stats["replays"] >= 3, stats
    plain = _results(ranks, "sim")[0]["stats"]
    assert stats["captures"] == plain["captures"] - 1, (stats, plain)  # b4.decode only


def test_a_device_out_of_streams_on_one_rank_stops_the_captures_of_every_rank(ranks) -> None:
    """Rank 0's device out of streams (207008) at b4.decode, its first capture: both ranks learn it in
    their agreement on that graph, and that artifact begins no other capture on either rank (rank 1's own
    device had streams left); every step equal to the unsplit model (the parametrized test above, which
    also finds the ranks' counters equal). (A later artifact, dynamo's recompile, tries again once: each
    artifact learns the device's streams ran out at its own first refusal.)"""
    per_rank = _results(ranks, "sim_streams_out")
    assert "207008" in per_rank[0]["failed_captures"]["b4.decode"]
    assert "another rank" in per_rank[1]["failed_captures"]["b4.decode"]
    stats, plain = per_rank[0]["stats"], _results(ranks, "sim")[0]["stats"]
    assert per_rank[1]["stats"] == stats, [r["stats"] for r in per_rank]
    assert stats["captures_not_tried"] >= 2 and stats["captures"] < plain["captures"] - 1, (stats, plain)


def test_two_tp_groups_of_two_in_a_world_of_four(tmp_path) -> None:
    """Each all_reduce stays within its own TP group (ranks 0-1 and 2-3), not the world; the first
    steps of the schedule only (decode and mixed, within and between the buckets), to stay cheap."""
    case = Case("tp2_of_4", runtime="sim", tp_size=2, steps=7)
    per_rank = _results(spawn_ranks([case], world=4, timeout=TIMEOUT, workdir=str(tmp_path)), case.name)
    for rank, res in enumerate(per_rank):
        wrong = {res["steps"][i]: e for i, e in enumerate(res["errors"]) if not e <= ATOL}
        assert len(res["errors"]) == 7 and not wrong, f"rank {rank}: steps off the unsplit model: {wrong}"
        assert res["stats"] == per_rank[0]["stats"] and res["stats"]["replays"] >= 1, res["stats"]
