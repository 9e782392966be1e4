"""The ACL-graph simulator's own rules (runtime/sim/).

Each test pins one way the simulator must behave like a device graph rather than like eager PyTorch.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_compile.errors import CaptureError, ReplayError, StreamRace, TaskUpdateMismatch, WorkspaceTooSmall
from ascend_compile.runtime import sim as sim_package
from ascend_compile.runtime.sim import SIM_KERNELS, SimRuntime
from ascend_compile.runtime.sim.pool import ALIGNMENT, SimPool
from tests.helpers import make_problem


@torch.library.custom_op("simtest::scale_rows", mutates_args=("out",))
def scale_rows(x: torch.Tensor, factors: list[int], out: torch.Tensor) -> None:
    """out[i] = x[i] * factors[i]; `factors` is a host list, like the kernels' sequence lengths."""
    out.copy_(x * torch.tensor(factors, dtype=x.dtype).unsqueeze(1))


@scale_rows.register_fake
def _(x: torch.Tensor, factors: list[int], out: torch.Tensor) -> None:
    return None


@torch.library.custom_op("simtest::ws_fill", mutates_args=("workspace", "out"))
def ws_fill(x: torch.Tensor, needed: int, workspace: torch.Tensor, out: torch.Tensor) -> None:
    """Needs `needed` bytes of workspace, checked before writing (as the reference kernels do)."""
    given = workspace.numel() * workspace.element_size()
    if given < needed:
        raise WorkspaceTooSmall("simtest.ws_fill", needed, given, "workspace")
    workspace.view(torch.uint8)[:needed].fill_(7)
    out.copy_(x)


@ws_fill.register_fake
def _(x: torch.Tensor, needed: int, workspace: torch.Tensor, out: torch.Tensor) -> None:
    return None


#: The simulated device's kernels in these tests: the simtest ops stand for kernels too.
KERNELS = SIM_KERNELS | {"simtest"}


def _rt(**kwargs) -> SimRuntime:
    return SimRuntime(segment_bytes=1 << 16, device_kernels=KERNELS, **kwargs)


def _static(rt: SimRuntime, values: torch.Tensor) -> torch.Tensor:
    buf = rt.empty(tuple(values.shape), values.dtype)
    buf.copy_(values)
    return buf


# ---------------------------------------------------------------- memory pool


def test_block_freed_during_capture_is_reused_by_the_same_capture() -> None:
    rt = _rt()
    x = _static(rt, torch.randn(256))
    g = rt.graph()
    with g.capture():
        tmp = x + 1
        addr = rt.address_of(tmp)
        y = tmp * 2
        del tmp
        later = y - 1
        assert rt.address_of(later) == addr, "the graph must not keep its intermediates alive"
        held = x - 1
        assert rt.address_of(held) != rt.address_of(later)
    g.replay()
    rt.synchronize()
    torch.testing.assert_close(later, (x + 1) * 2 - 1)


def test_block_freed_during_capture_goes_only_to_later_captures() -> None:
    rt = _rt()
    x = _static(rt, torch.randn(256))
    with rt.graph().capture():
        tmp = x + 1
        addr = rt.address_of(tmp)
        del tmp
    outside = rt.empty((256,), torch.float32)
    assert rt.address_of(outside)[0] == "general"
    with rt.graph().capture():
        inside = x * 2
    assert rt.address_of(inside) == addr
    assert addr[0] == "graph"


def test_an_empty_operand_of_a_recorded_task_does_not_keep_its_storages_block() -> None:
    """A task records its operands as addresses; an empty view (no element, so no address: its
    `data_ptr()` is 0) is no exception: the recorded graph must not hold the block of the tensor it
    is a view of. Before, the task kept the view itself, and with it the whole block, for the graph's
    life (vLLM's rotary `query[..., rotary_dim:]` when the rotary dim is the head dim: every layer's
    qkv projection pinned in the graph pool, which grew with every capture)."""
    rt = _rt()
    x = _static(rt, torch.randn(4, 64))
    g = rt.graph()
    with g.capture():
        y = x * 2
        out = torch.cat((x, y[:, :0]), dim=-1)
        del y
    assert rt.memory_stats()["graph"]["allocated_bytes"] == 1024  # `out` alone
    g.replay()
    rt.synchronize()
    torch.testing.assert_close(out, x)


def test_general_pool_reuses_and_coalesces_free_blocks() -> None:
    rt = _rt()
    a, b, c = (rt.empty((128,), torch.float32) for _ in range(3))
    assert [rt.address_of(t)[2] for t in (a, b, c)] == [0, 512, 1024]
    assert rt.memory_stats()["general"]["allocated_bytes"] == 3 * 512
    del a
    d = rt.empty((64,), torch.float64)
    assert rt.address_of(d)[2] == 0
    del d, b
    assert rt.memory_stats()["general"]["allocated_bytes"] == 512
    e = rt.empty((256,), torch.float32)
    assert rt.address_of(e)[2] == 0, "the two freed 512-byte neighbours were not merged"
    del c, e
    stats = rt.memory_stats()["general"]
    assert stats["allocated_bytes"] == 0 and stats["free_blocks"] == 1


def test_a_view_keeps_its_block_allocated() -> None:
    rt = _rt()
    a = rt.empty((128,), torch.float32)
    view = a[64:]
    del a
    assert rt.memory_stats()["general"]["allocated_bytes"] == 512
    b = rt.empty((128,), torch.float32)
    assert rt.address_of(b)[2] == 512
    del view
    assert rt.memory_stats()["general"]["allocated_bytes"] == 512


def test_a_request_larger_than_a_segment_gets_its_own_segment() -> None:
    rt = _rt()
    small = rt.empty((16,), torch.float32)
    big = rt.empty((1 << 15,), torch.float32)
    assert rt.address_of(small)[1] == 0
    assert rt.address_of(big) == ("general", 1, 0)
    assert rt.memory_stats()["general"]["reserved_bytes"] == (1 << 16) + (1 << 17)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), max_size=40))
def test_pool_blocks_never_overlap_and_fully_coalesce(steps: list[tuple[bool, int]]) -> None:
    pool = SimPool("general", 1 << 14)
    live = []
    for free_one, nbytes in steps:
        if free_one and live:
            pool.release(live.pop(nbytes % len(live)))
        else:
            live.append(pool.allocate(nbytes))
            assert live[-1].offset % ALIGNMENT == 0 and live[-1].size >= nbytes
        spans = sorted((b.segment.index, b.offset, b.offset + b.size) for b in live)
        assert all(p[0] != q[0] or p[2] <= q[1] for p, q in zip(spans, spans[1:]))
        assert pool.stats()["allocated_bytes"] == sum(b.size for b in live)
    for block in live:
        pool.release(block)
    assert pool.stats()["free_blocks"] == pool.stats()["segments"]


# ---------------------------------------------------------------- capture and replay


def _chain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = torch.relu(x @ w + b)
    v = y.view(8, 4)
    v.mul_(2)
    return v.sum(0)


def test_replay_reads_new_input_values_from_the_same_address() -> None:
    rt = _rt()
    w, b = torch.randn(8, 8), torch.randn(8)
    x = _static(rt, torch.randn(4, 8))
    g = rt.graph()
    with g.capture():
        out = _chain(x, w, b)
    assert g.tasks == (
        "aten.mm.default", "aten.add.Tensor", "aten.relu.default", "aten.mul_.Tensor", "aten.sum.dim_IntList"
    ), "a view is not a task"
    for _ in range(3):
        new = torch.randn(4, 8)
        x.copy_(new)
        g.replay()
        rt.synchronize()
        torch.testing.assert_close(out, _chain(new, w, b))


def test_replay_may_write_inference_mode_tensors_outside_inference_mode() -> None:
    rt = _rt()
    x = _static(rt, torch.ones(4))
    with torch.inference_mode():
        cache = torch.zeros(4)
        g = rt.graph()
        with g.capture():
            cache.add_(x)
    g.replay()
    rt.synchronize()
    assert torch.equal(cache, torch.full((4,), 2.0))


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_maybe_view_ops_that_copy_are_recorded(grad_mode) -> None:
    """reshape/contiguous of a non-contiguous tensor copy; under inference mode the simulator sees
    them whole, with an aliasing schema, and must still record them as tasks."""
    rt = SimRuntime()
    with grad_mode():
        x = rt.empty((4, 6), torch.float32)
        x.copy_(torch.randn(4, 6))
        graph = rt.graph()
        with graph.capture():
            y = x.t().reshape(24) * 2
            z = x.t().contiguous() + 1
        x.copy_(torch.randn(4, 6))
        graph.replay()
        rt.synchronize()
        torch.testing.assert_close(y, x.t().reshape(24) * 2)
        torch.testing.assert_close(z, x.t() + 1)


def test_replay_runs_at_synchronize() -> None:
    rt = _rt()
    x = _static(rt, torch.ones(4))
    g = rt.graph()
    with g.capture():
        y = x + 1
    g.replay()
    assert torch.isnan(y).all()
    rt.synchronize()
    assert torch.equal(y, torch.full((4,), 2.0))


def test_capture_poisons_what_it_allocated_until_a_replay() -> None:
    rt = _rt()
    x = _static(rt, torch.randn(16))
    g = rt.graph()
    with g.capture():
        tmp = x * 3
        freed = rt.weak_alias(tmp)
        y = torch.relu(tmp)
        del tmp
        flags = (x > 0).to(torch.int32)
    assert torch.isnan(y).all() and torch.isnan(freed).all()
    assert (flags == -1).all()
    assert not torch.isnan(x).any(), "static inputs are not the capture's memory"
    g.replay()
    rt.synchronize()
    torch.testing.assert_close(y, torch.relu(x * 3))
    assert torch.equal(flags, (x > 0).to(torch.int32))


def test_empty_in_capture_comes_from_the_graph_pool_and_records_no_task() -> None:
    rt = _rt()
    g = rt.graph()
    with g.capture():
        a = torch.empty(8)
        b = rt.empty((8,), torch.float32)
        a.fill_(1.0)
    assert rt.address_of(a)[0] == rt.address_of(b)[0] == "graph"
    assert g.tasks == ("aten.fill_.Scalar",)


@pytest.mark.parametrize(
    "sync",
    [
        lambda t: t.sum().item(),
        lambda t: t.tolist(),
        lambda t: bool(t[0] > 0),
        lambda t: torch.nonzero(t),
        lambda t: t[t > 0],
        lambda t: t[(t > 0).to(torch.uint8)],  # a uint8 index is a mask too (torch warns it is deprecated)
    ],
    ids=["item", "tolist", "bool", "nonzero", "bool mask", "uint8 mask"],
)
def test_host_sync_during_capture_is_refused(sync) -> None:
    rt = _rt()
    x = _static(rt, torch.randn(4))
    g = rt.graph()
    with pytest.raises(CaptureError, match="capture"):
        with g.capture():
            sync(x + 1)
    with pytest.raises(ReplayError, match="never captured"):
        g.replay()
    with rt.graph().capture():
        x + 1


def test_custom_op_is_one_task() -> None:
    rt = _rt()
    x = _static(rt, torch.ones(2, 3))
    out = rt.empty((2, 3), torch.float32)
    g = rt.graph()
    with g.capture():
        torch.ops.simtest.scale_rows(x + 1, [1, 2], out)
    assert g.tasks == ("aten.add.Tensor", "simtest.scale_rows.default")


def test_replaying_an_uncaptured_graph_is_an_error() -> None:
    with pytest.raises(ReplayError, match="never captured"):
        _rt().graph().replay()


def test_capture_protocol_errors() -> None:
    rt = _rt()
    g = rt.graph()
    with pytest.raises(CaptureError, match="outside capture"):
        rt.task_group_begin()
    with pytest.raises(CaptureError, match="do not nest"):
        with g.capture():
            rt.task_group_begin()
            rt.task_group_begin()
    with pytest.raises(CaptureError, match="task_group_end"):
        with rt.graph().capture():
            rt.task_group_begin()
    g2 = rt.graph()
    with g2.capture():
        with pytest.raises(CaptureError, match="being captured"):
            with rt.graph().capture():
                pass
        with pytest.raises(CaptureError, match="synchronize"):
            rt.synchronize()
    with pytest.raises(CaptureError, match="already captured"):
        with g2.capture():
            pass


# ---------------------------------------------------------------- task groups and updates


def _capture_scale_rows(rt: SimRuntime, factors: list[int]):
    x = _static(rt, torch.ones(2, 3))
    out = rt.empty((2, 3), torch.float32)
    g = rt.graph()
    with g.capture():
        rt.task_group_begin()
        torch.ops.simtest.scale_rows(x, factors, out)
        handle = rt.task_group_end()
    return g, handle, x, out


def _rows(out: torch.Tensor) -> list[float]:
    return out[:, 0].tolist()


def test_host_args_are_frozen_at_capture_and_changed_by_an_update() -> None:
    rt = _rt()
    factors = [1, 2]
    g, handle, x, out = _capture_scale_rows(rt, factors)
    assert handle.tasks == ("simtest.scale_rows.default",)
    factors[:] = [5, 5]
    g.replay()
    rt.synchronize()
    assert _rows(out) == [1.0, 2.0]
    with rt.task_update(handle):
        torch.ops.simtest.scale_rows(x, [3, 4], out)
    rt.synchronize()  # the update lands on the device; nothing orders it before a replay otherwise
    assert _rows(out) == [1.0, 2.0], "an update records, it does not run"
    g.replay()
    rt.synchronize()
    assert _rows(out) == [3.0, 4.0]


def _capture_scale_rows_after_wait(rt: SimRuntime, name: str = "scale_rows_node"):
    """`scale_rows` captured as the runtime captures a kernel: wait on its event, reset it, the group."""
    x, out, ev = _static(rt, torch.ones(2, 3)), rt.empty((2, 3), torch.float32), rt.event(name)
    g = rt.graph()
    with g.capture():
        ev.wait()
        ev.reset()
        rt.task_group_begin()
        torch.ops.simtest.scale_rows(x, [1, 2], out)
        handle = rt.task_group_end()
    return g, handle, x, out, ev


def _update_rows(rt: SimRuntime, handle, x, out, factors: list[int]) -> None:
    with rt.task_update(handle):
        torch.ops.simtest.scale_rows(x, factors, out)


def test_an_update_ordered_by_the_graphs_event_reaches_the_pending_replay() -> None:
    rt = _rt()
    g, handle, x, out, ev = _capture_scale_rows_after_wait(rt)
    g.replay()
    _update_rows(rt, handle, x, out, [7, 8])
    ev.record()  # on the update stream, after the update: releases the replay's wait
    rt.synchronize()
    assert _rows(out) == [7.0, 8.0]


def test_an_update_no_event_orders_before_the_replay_is_a_race() -> None:
    rt = _rt()
    g, handle, x, out = _capture_scale_rows(rt, [1, 2])
    g.replay()
    _update_rows(rt, handle, x, out, [7, 8])
    with pytest.raises(StreamRace, match="graph1 group 0") as err:
        rt.synchronize()
    assert "task update of graph1 group 0" in str(err.value)


def test_the_update_of_the_next_step_while_a_replay_is_pending_is_a_race() -> None:
    # The graph's event orders each update before its own replay's kernel, but nothing orders step
    # 2's update after replay 1's kernel: on the device it could land before replay 1 reads.
    rt = _rt()
    g, handle, x, out, ev = _capture_scale_rows_after_wait(rt)
    for factors in ([3, 4], [5, 6]):
        g.replay()
        _update_rows(rt, handle, x, out, factors)
        ev.record()
    with pytest.raises(StreamRace, match=r"node scale_rows_node"):
        rt.synchronize()
    rt = _rt()  # the failed drain left the event set: start from a fresh device
    g, handle, x, out, ev = _capture_scale_rows_after_wait(rt)
    for factors in ([3, 4], [5, 6]):  # with the host (or an event) between the steps, each gets its own
        g.replay()
        _update_rows(rt, handle, x, out, factors)
        ev.record()
        rt.synchronize()
        assert _rows(out) == [float(f) for f in factors]


def test_an_event_recorded_before_the_update_races_with_it() -> None:
    rt = _rt()
    g, handle, x, out, ev = _capture_scale_rows_after_wait(rt)
    g.replay()
    ev.record()
    _update_rows(rt, handle, x, out, [7, 8])
    with pytest.raises(StreamRace, match="scale_rows_node"):
        rt.synchronize()


def test_without_the_reset_the_next_step_waits_on_a_stale_record_and_races() -> None:
    # The graph waits but never resets: step 2's wait passes on step 1's record, before step 2's update.
    rt = _rt()
    x, out, ev = _static(rt, torch.ones(2, 3)), rt.empty((2, 3), torch.float32), rt.event("no_reset_node")
    g = rt.graph()
    with g.capture():
        ev.wait()
        rt.task_group_begin()
        torch.ops.simtest.scale_rows(x, [1, 2], out)
        handle = rt.task_group_end()
    g.replay()
    _update_rows(rt, handle, x, out, [3, 4])
    ev.record()
    rt.synchronize()
    g.replay()
    _update_rows(rt, handle, x, out, [5, 6])
    ev.record()
    with pytest.raises(StreamRace, match="node no_reset_node"):
        rt.synchronize()


def test_a_stream_runs_in_order_and_streams_meet_only_at_events() -> None:
    # A high-priority side stream is drained first: a replay issued there after one on the default
    # stream runs before it, unless it waits on an event recorded after the first.
    rt = _rt()
    x, side = _static(rt, torch.ones(4)), rt.new_stream("side", priority=-2)
    producer, consumer = rt.graph(), rt.graph()
    with producer.capture():
        y = x * 2
    with consumer.capture():
        z = y + 1
    for ordered, want in ((False, float("nan")), (True, 3.0)):
        producer.replay()
        consumer.replay()  # same stream: in issue order
        rt.synchronize()
        assert torch.equal(z, torch.full((4,), 3.0))
        y.fill_(float("nan"))
        done = rt.event("producer_done", external=False)
        producer.replay()
        done.record(rt.default_stream)
        if ordered:
            done.wait(side)
        consumer.replay(side)
        rt.synchronize()
        torch.testing.assert_close(z, torch.full((4,), want), equal_nan=True)


def test_a_wait_queued_behind_its_own_record_is_a_hang_naming_the_node() -> None:
    rt = _rt()
    g, handle, x, out, ev = _capture_scale_rows_after_wait(rt, "attn_layer_7")
    g.replay(rt.update_stream)  # the record below queues behind the replay that waits for it
    _update_rows(rt, handle, x, out, [7, 8])
    ev.record(rt.update_stream)
    with pytest.raises(ReplayError, match="attn_layer_7.*would hang"):
        rt.synchronize()
    assert rt.device_queue.idle


def test_a_host_write_into_a_static_input_of_a_pending_replay_is_an_error() -> None:
    rt = _rt()
    x = _static(rt, torch.ones(4))
    g = rt.graph()
    with g.capture():
        y = x * 2
    g.replay()
    x.fill_(5.0)  # the replay, launched, has not run: on the device it would read 5s
    with pytest.raises(ReplayError, match="host wrote after replay"):
        rt.synchronize()
    g.replay()
    rt.synchronize()
    x.fill_(3.0)  # after the replay ran: the next replay reads it
    g.replay()
    rt.synchronize()
    assert torch.equal(y, torch.full((4,), 6.0))


def test_the_device_clock_runs_queued_work_without_a_host_synchronize() -> None:
    rt = _rt()
    g, handle, x, out, ev = _capture_scale_rows_after_wait(rt)
    g.replay()
    assert rt.advance(10) == 1  # the launch check; then the replay waits for its event, not a hang yet
    _update_rows(rt, handle, x, out, [4, 4])
    ev.record()
    assert rt.advance(10) > 0 and rt.device_queue.idle
    assert _rows(out) == [4.0, 4.0]


def test_an_update_can_move_tensor_operands() -> None:
    rt = _rt()
    g, handle, x, out = _capture_scale_rows(rt, [1, 1])
    other = _static(rt, torch.full((2, 3), 10.0))
    with rt.task_update(handle):
        torch.ops.simtest.scale_rows(other, [1, 2], out)
    rt.synchronize()
    g.replay()
    rt.synchronize()
    assert _rows(out) == [10.0, 20.0]


def test_an_update_moving_a_tensor_operand_moves_the_static_input_the_launch_checks() -> None:
    """After an update rebinds a task to another tensor, the graph's static inputs are that tensor's
    memory: a host write into it between replay() and the replay running is an error, and one into
    the tensor the task no longer reads is not."""
    rt = _rt()
    g, handle, x, out = _capture_scale_rows(rt, [1, 1])
    g.replay()
    rt.synchronize()  # the static inputs of the capture (x) are known now
    other = _static(rt, torch.full((2, 3), 10.0))
    with rt.task_update(handle):
        torch.ops.simtest.scale_rows(other, [1, 2], out)
    rt.synchronize()
    g.replay()
    x.fill_(5.0)  # no task reads x any more
    rt.synchronize()
    assert _rows(out) == [10.0, 20.0]
    g.replay()
    other.fill_(3.0)  # the launched replay, not run yet, reads it: on the device it would read 3s
    with pytest.raises(ReplayError, match="host wrote after replay"):
        rt.synchronize()


def test_an_update_of_an_op_with_a_fresh_output_keeps_its_address() -> None:
    rt = _rt()
    x = _static(rt, torch.ones(4))
    g = rt.graph()
    with g.capture():
        rt.task_group_begin()
        y = torch.mul(x, 2.0)
        handle = rt.task_group_end()
    with rt.task_update(handle):
        dummy = torch.mul(x, 3.0)
    rt.synchronize()
    assert dummy.shape == (4,)
    g.replay()
    rt.synchronize()
    assert torch.equal(y, torch.full((4,), 3.0))


@pytest.mark.parametrize(
    "issue, got",
    [
        (lambda x, out: None, r"got 0 \[\]"),
        (lambda x, out: [torch.ops.simtest.scale_rows(x, [1, 1], out) for _ in range(2)], "got 2"),
        (lambda x, out: out.copy_(x), r"got 1 \['aten.copy_.default'\]"),
    ],
    ids=["too-few", "too-many", "other-kind"],
)
def test_an_update_must_issue_the_same_ops_as_its_group(issue, got) -> None:
    rt = _rt()
    g, handle, x, out = _capture_scale_rows(rt, [1, 2])
    with pytest.raises(TaskUpdateMismatch, match=r"expected 1 \['simtest.scale_rows.default'\], " + got):
        with rt.task_update(handle):
            issue(x, out)
    g.replay()
    rt.synchronize()
    assert _rows(out) == [1.0, 2.0], "a refused update must leave the tasks as they were"


def test_update_protocol_errors() -> None:
    rt = _rt()
    g, handle, x, out = _capture_scale_rows(rt, [1, 2])
    with pytest.raises(Exception, match="without task_update_begin"):
        rt.task_update_end()
    with pytest.raises(CaptureError, match="during capture"):
        with rt.graph().capture():
            rt.task_update_begin(handle)
    with pytest.raises(Exception, match="not a task group of this runtime"):
        _rt().task_update_begin(handle)


# ---------------------------------------------------------------- external events


def test_a_wait_on_an_unrecorded_event_fails_and_reset_needs_a_fresh_record() -> None:
    rt = _rt()
    x = _static(rt, torch.ones(4))
    ev = rt.event("attn_layer_3")
    g = rt.graph()
    with g.capture():
        ev.wait()
        ev.reset()
        y = x + 1
    assert g.tasks == ("event.wait:attn_layer_3", "event.reset:attn_layer_3", "aten.add.Tensor")
    g.replay()
    with pytest.raises(ReplayError, match="attn_layer_3"):
        rt.synchronize()
    ev.record()
    g.replay()
    rt.synchronize()
    assert torch.equal(y, torch.full((4,), 2.0))
    assert not ev.recorded
    g.replay()
    with pytest.raises(ReplayError, match="never recorded"):
        rt.synchronize()


# ---------------------------------------------------------------- workspace overrun


def _neighbours(rt: SimRuntime):
    ws = rt.empty((512,), torch.uint8)
    neighbour = rt.empty((128,), torch.float32)
    assert rt.address_of(neighbour)[2] == rt.address_of(ws)[2] + 512
    neighbour.fill_(1.0)
    return ws, neighbour, _static(rt, torch.arange(4.0)), rt.empty((4,), torch.float32)


def test_workspace_overrun_writes_into_the_neighbouring_block() -> None:
    rt = _rt()
    ws, neighbour, x, out = _neighbours(rt)
    g = rt.graph()
    with g.capture():
        torch.ops.simtest.ws_fill(x, 1024, ws, out)
    assert (neighbour.view(torch.uint8) == 7).all()
    neighbour.fill_(1.0)
    g.replay()
    rt.synchronize()
    assert (neighbour.view(torch.uint8) == 7).all()
    assert torch.equal(out, x)


def test_workspace_overrun_raises_with_overflow_raise() -> None:
    rt = _rt(overflow="raise")
    ws, neighbour, x, out = _neighbours(rt)
    with pytest.raises(WorkspaceTooSmall, match=r"needs 1024 .*\[in graph1 task 0 \(simtest.ws_fill.default\)\]"):
        with rt.graph().capture():
            torch.ops.simtest.ws_fill(x, 1024, ws, out)
    g = rt.graph()
    with g.capture():
        rt.task_group_begin()
        torch.ops.simtest.ws_fill(x, 512, ws, out)
        handle = rt.task_group_end()
    with rt.task_update(handle):
        torch.ops.simtest.ws_fill(x, 2048, ws, out)
    rt.synchronize()
    g.replay()
    with pytest.raises(WorkspaceTooSmall, match="graph2 task 0"):
        rt.synchronize()
    assert torch.equal(neighbour, torch.ones(128))


def test_workspace_overrun_past_the_segment_end_is_a_fault() -> None:
    rt = SimRuntime(segment_bytes=4096, device_kernels=KERNELS)
    filler = rt.empty((4096 - 512,), torch.uint8)
    ws = rt.empty((512,), torch.uint8)
    x, out = _static(rt, torch.arange(4.0)), rt.empty((4,), torch.float32)
    assert rt.address_of(ws) == ("general", 0, 4096 - 512) and rt.address_of(filler)[1] == 0
    g = rt.graph()
    with g.capture():
        rt.task_group_begin()
        torch.ops.simtest.ws_fill(x, 512, ws, out)
        handle = rt.task_group_end()
    with rt.task_update(handle):
        torch.ops.simtest.ws_fill(x, 1024, ws, out)
    rt.synchronize()
    g.replay()
    with pytest.raises(ReplayError, match="past its end"):
        rt.synchronize()


# ---------------------------------------------------------------- weak alias (DESIGN.md §7 case 3)


def test_a_weak_alias_does_not_keep_its_block() -> None:
    rt = _rt()
    x = _static(rt, torch.randn(256))
    g = rt.graph()
    with g.capture():
        ws = rt.empty((256,), torch.float32)
        alias = rt.weak_alias(ws)
        addr = rt.address_of(ws)
        del ws
        activation = x + 1
        assert rt.address_of(activation) == rt.address_of(alias) == addr
        alias.fill_(0.0)
    g.replay()
    rt.synchronize()
    assert torch.equal(activation, torch.zeros(256)), "scratch written through the alias lands on the activation"


def test_a_held_workspace_is_not_reused() -> None:
    rt = _rt()
    x = _static(rt, torch.randn(256))
    g = rt.graph()
    with g.capture():
        ws = rt.empty((256,), torch.float32)
        activation = x + 1
        assert rt.address_of(activation) != rt.address_of(ws)
        ws.fill_(0.0)
    g.replay()
    rt.synchronize()
    torch.testing.assert_close(activation, x + 1)


# ---------------------------------------------------------------- functional collectives


@pytest.fixture
def one_rank_group() -> Iterator[str]:
    """A one-rank gloo process group in this process; its name, as the functional collectives take it."""
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.mark.parametrize("waited", [True, False])
def test_a_functional_collective_is_issued_by_every_replay_and_read_once_complete(one_rank_group, waited) -> None:
    """Its output reaches its captured address when the graph waits on it (unwaited, when the graph
    ends), never while its work is in flight; every replay issues it again and leaves no work unwaited."""
    c10d = torch.ops._c10d_functional
    rt = _rt()
    x = _static(rt, torch.ones(4))
    g = rt.graph()
    with g.capture():
        y = c10d.all_reduce(x * 2, "sum", one_rank_group)
        out = c10d.wait_tensor(y) + 1 if waited else y
    assert g.tasks[:2] == ("aten.mul.Tensor", "_c10d_functional.all_reduce.default")
    for value in (3.0, 5.0):
        x.fill_(value)
        g.replay()
        rt.synchronize()
        assert torch.equal(out, torch.full((4,), 2 * value + waited))
        assert torch._C._distributed_c10d._get_work_registry_size() == 0


def test_a_collectives_output_read_before_its_wait_is_poison(one_rank_group) -> None:
    """On gloo the result exists at once; on the device an asynchronous collective's output is not
    written before its work completes, so a graph that reads it before the wait reads garbage."""
    c10d = torch.ops._c10d_functional
    rt = _rt()
    x = _static(rt, torch.ones(4))
    g = rt.graph()
    with g.capture():
        y = c10d.all_reduce(x * 2, "sum", one_rank_group)
        early = y + 0
        late = c10d.wait_tensor(y) + 0
    for value in (3.0, 5.0):
        x.fill_(value)
        g.replay()
        rt.synchronize()
        assert bool(early.isnan().all()), early
        assert torch.equal(late, torch.full((4,), 2 * value))


# ----------------------------------------------------------------------------- device rules of the Ascend path


def _capture_pa(rt: SimRuntime, lens: list[int]):
    """One PA call captured in a task group over a 2-sequence problem; (graph, handle, problem, out, ws)."""
    prob = make_problem([5, 9])
    ws = _static(rt, torch.zeros(1 << 16, dtype=torch.uint8))
    out = _static(rt, torch.zeros_like(prob.query))
    graph = rt.graph()
    with graph.capture():
        rt.task_group_begin()
        torch.ops.ascend.paged_attention(prob.query, prob.key_cache, prob.value_cache, prob.block_table, lens,
                                         prob.scale, ws, out)
        handle = rt.task_group_end()
    return graph, handle, prob, out, ws


def _update_pa(rt: SimRuntime, handle, prob, out, ws, lens: list[int]) -> None:
    with rt.task_update(handle):
        torch.ops.ascend.paged_attention(prob.query, prob.key_cache, prob.value_cache, prob.block_table, lens,
                                         prob.scale, ws, out)


def test_a_kernel_captured_on_its_zero_length_fast_path_cannot_be_updated_to_real_lengths() -> None:
    rt = _rt()
    graph, handle, prob, out, ws = _capture_pa(rt, [0, 0])
    assert handle.tasks == ("ascend.paged_attention.default[all lengths 0]",)
    with pytest.raises(TaskUpdateMismatch, match=r"paged_attention.default\[all lengths 0\]"):
        _update_pa(rt, handle, prob, out, ws, [5, 9])
    graph, handle, prob, out, ws = _capture_pa(rt, [1, 1])  # captured with lengths it really runs
    _update_pa(rt, handle, prob, out, ws, [5, 9])
    rt.synchronize()
    graph.replay()
    rt.synchronize()
    torch.testing.assert_close(out, prob.dense(), atol=2e-5, rtol=1e-4)


def _fia(prob, ends: list[int], kv: list[int], ws, out) -> None:
    torch.ops.ascend.fused_infer_attention(prob.query, prob.key_cache, prob.value_cache, prob.block_table, ends, kv,
                                           prob.scale, ws, out)


def test_an_update_moving_fia_between_its_one_token_and_prompt_branches_is_refused() -> None:
    # FIA takes its IncreFlashAttention branch when every sequence has one query token, its
    # PromptFlashAttention one otherwise (torch_npu 2.14 `_op_plugin_docs.py` L8056): a task captured
    # in one is not updated into the other; within a branch the lengths may change.
    rt = _rt()
    decode = make_problem([5, 9, 3, 7])  # 4 sequences of one query token
    ws = _static(rt, torch.zeros(1 << 16, dtype=torch.uint8))
    out = _static(rt, torch.zeros_like(decode.query))
    graph = rt.graph()
    with graph.capture():
        rt.task_group_begin()
        _fia(decode, [1, 2, 3, 4], [1, 1, 1, 1], ws, out)
        handle = rt.task_group_end()
    assert handle.tasks == ("ascend.fused_infer_attention.default[S=1]",)
    with pytest.raises(TaskUpdateMismatch, match=r"fused_infer_attention.default\[S=1\]"):
        with rt.task_update(handle):
            _fia(decode, [2, 3, 3, 4], [5, 9, 3, 7], ws, out)  # query lengths 2, 1, 0, 1: the prompt branch
    with rt.task_update(handle):
        _fia(decode, [1, 2, 3, 4], decode.seq_lens, ws, out)
    rt.synchronize()
    graph.replay()
    rt.synchronize()
    torch.testing.assert_close(out, decode.dense(), atol=2e-5, rtol=1e-4)


@torch.library.custom_op("simtest::host_rows", mutates_args=("out",))
def host_rows(x: torch.Tensor, lens: torch.Tensor, out: torch.Tensor) -> None:
    """Scales row i of x by host tensor lens[i] (a kernel that reads a host tensor when it runs)."""
    out.copy_(x * lens.to(x.dtype).view(-1, 1))


def test_a_host_tensor_input_is_copied_when_the_call_is_issued_so_it_may_be_freed_at_once() -> None:
    # torch_npu's ATB binding clones CPU tensor inputs and its launch holds the clone (op-plugin
    # AtbCommon.cpp, ParamSetter::Input): a host tensor freed or overwritten after the call is no error.
    rt = _rt()
    rt.copies_host_inputs(torch.ops.simtest.host_rows, "lens")
    x, out = _static(rt, torch.ones(2, 3)), _static(rt, torch.zeros(2, 3))
    graph = rt.graph()
    kept = torch.tensor([2, 3])
    with graph.capture():
        rt.task_group_begin()
        torch.ops.simtest.host_rows(x, kept, out)
        handle = rt.task_group_end()
    with rt.task_update(handle):
        torch.ops.simtest.host_rows(x, torch.tensor([4, 5]), out)  # dropped when the call returns
    rt.synchronize()
    graph.replay()
    rt.synchronize()
    assert out[:, 0].tolist() == [4.0, 5.0]
    overwritten = torch.tensor([6, 7])
    with rt.task_update(handle):
        torch.ops.simtest.host_rows(x, overwritten, out)
    overwritten.fill_(0)  # after the call: the task holds the copy made when it was issued
    rt.synchronize()
    graph.replay()
    rt.synchronize()
    assert out[:, 0].tolist() == [6.0, 7.0]


def test_an_op_may_not_set_itself_up_inside_a_capture() -> None:
    rt = _rt()
    graph = rt.graph()
    with pytest.raises(CaptureError, match="kernel_x: first call inside the capture"):
        with graph.capture():
            rt.first_call("kernel_x")
    rt.first_call("kernel_x")  # eagerly, before capturing: set up
    with rt.graph().capture():
        rt.first_call("kernel_x")


# ----------------------------------------------------------------------------- the package's structure

#: The simulator's modules, each importing only public names of those before it.
SIM_MODULES = ("faults", "pool", "streams", "classify", "memory", "collectives", "overrun", "launch", "kernels",
               "tasks", "inputs", "updates", "events", "dispatch", "runtime")


def test_simulator_modules_import_public_names_of_the_modules_below_them_only() -> None:
    package = Path(sim_package.__file__).parent
    assert sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__") == sorted(SIM_MODULES)
    for index, module in enumerate(SIM_MODULES):
        tree = ast.parse((package / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                assert node.module in SIM_MODULES[:index], f"{module} imports {node.module}"
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{module} imports private names {private} from {node.module}"
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                raise AssertionError(f"{module} imports under TYPE_CHECKING (a cycle)")


# ----------------------------------------------------------------------------- ops that are not device kernels

#: Calls of each `stricttest` op's Python body.
BODY_CALLS: dict[str, int] = {}


@torch.library.custom_op("stricttest::reads_max", mutates_args=("out",))
def reads_max(x: torch.Tensor, out: torch.Tensor) -> None:
    """A Python custom op with host logic: it reads the maximum of device data back to the host."""
    out.copy_(x / int(x.max()))


@torch.library.custom_op("stricttest::reads_list", mutates_args=("out",))
def reads_list(x: torch.Tensor, out: torch.Tensor) -> None:
    """A Python custom op that converts device data to a host list."""
    out.copy_(x * len([v for v in x.tolist() if v > 0]))


@torch.library.custom_op("stricttest::masks", mutates_args=("out",))
def masks(x: torch.Tensor, out: torch.Tensor) -> None:
    """A Python custom op whose intermediate has a data-dependent shape (a boolean-mask index)."""
    out.copy_(x * x[x > 0].sum())


@torch.library.custom_op("stricttest::axpy", mutates_args=("out",))
def axpy(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
    """out = 2 x + y, counting its calls: a Python custom op without host logic."""
    BODY_CALLS["axpy"] = BODY_CALLS.get("axpy", 0) + 1
    out.copy_(2 * x + y)


@pytest.mark.parametrize("op, read", [
    (torch.ops.stricttest.reads_max, r"aten\.item\.default"),
    (torch.ops.stricttest.reads_list, r"Tensor\.tolist\(\)"),
    (torch.ops.stricttest.masks, r"aten\.index\.Tensor"),
])
def test_a_host_read_inside_a_custom_op_fails_the_capture_naming_the_op_and_the_read(op, read) -> None:
    rt = _rt()
    x, out = _static(rt, torch.tensor([1.0, -2.0, 4.0])), _static(rt, torch.zeros(3))
    name = str(op.default).replace(".", r"\.")
    with pytest.raises(CaptureError, match=rf"{read} inside {name} \(not a kernel of this device"):
        with rt.graph().capture():
            op(x, out)


def test_a_custom_op_is_recorded_as_the_ops_its_body_issues_and_replays_run_none_of_its_python() -> None:
    rt = _rt()
    x, y, out = (_static(rt, torch.full((4,), v)) for v in (1.0, 10.0, 0.0))
    BODY_CALLS.clear()
    graph = rt.graph()
    with graph.capture():
        torch.ops.stricttest.axpy(x, y, out)
    assert "stricttest.axpy.default" not in graph.tasks and "aten.copy_.default" in graph.tasks
    for value in (2.0, 3.0, 5.0):
        x.fill_(value)
        graph.replay()
        rt.synchronize()
        assert torch.equal(out, torch.full((4,), 2 * value + 10))
    assert BODY_CALLS == {"axpy": 1}  # the capture's run; no replay ran the body


def test_an_op_the_runtime_declares_a_kernel_is_one_task_run_as_it_is() -> None:
    rt = SimRuntime(segment_bytes=1 << 16, device_kernels=KERNELS | {"stricttest::axpy"})
    x, y, out = (_static(rt, torch.full((4,), v)) for v in (1.0, 10.0, 0.0))
    BODY_CALLS.clear()
    graph = rt.graph()
    with graph.capture():
        torch.ops.stricttest.axpy(x, y, out)
    assert graph.tasks == ("stricttest.axpy.default",)
    graph.replay()
    rt.synchronize()
    assert BODY_CALLS == {"axpy": 2} and torch.equal(out, torch.full((4,), 12.0))


@torch.library.custom_op("stricttest::scale_into", mutates_args=("out",))
def scale_into(x: torch.Tensor, factors: list[int], out: torch.Tensor) -> None:
    """out[i] = x[i] * factors[i], written by one kernel (`out=`): a Python op over a host list."""
    torch.mul(x, torch.tensor(factors, dtype=x.dtype).unsqueeze(1), out=out)


def test_a_task_update_of_a_custom_op_issues_the_ops_its_body_issues_again() -> None:
    rt = _rt()
    x, out = _static(rt, torch.ones(2, 3)), _static(rt, torch.zeros(2, 3))
    graph = rt.graph()
    with graph.capture():
        rt.task_group_begin()
        torch.ops.stricttest.scale_into(x, [2, 3], out)
        handle = rt.task_group_end()
    assert handle.tasks == ("aten.mul.out",)
    with rt.task_update(handle):
        torch.ops.stricttest.scale_into(x, [4, 5], out)
    rt.synchronize()
    graph.replay()
    rt.synchronize()
    assert out[:, 0].tolist() == [4.0, 5.0]
