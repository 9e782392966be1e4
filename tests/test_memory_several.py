"""Memory figures with more than one of anything (issue 46, area 4), without vLLM: several graphs handed
over to the KV budget (`integrations/vllm/kv_budget.py`: their figures summed, each graph's own share
noted), several piecewise sizes' static buffers (`integrations/vllm/memory.py: _piece_buffers`, against
what the pieces of each size allocate when served), and a view outliving its base in a graph's
allocation trace (`passes/memory_estimate.py`: the base's block held while the view lives)."""
from __future__ import annotations

import logging

import pytest
import torch

import ascend_compile
from ascend_compile.backend import backend
from ascend_compile.config import CompileConfig
from ascend_compile.integrations.vllm import kv_budget, memory
from ascend_compile.passes.memory_estimate import pool_reserved, trace_allocations
from ascend_compile.runtime.pool_model import sim_pool_model
from examples.llama import LlamaConfig, PagedBatch, build
from tests.test_memory_estimate import _dynamo_graph

GIB = 1 << 30


class _Graph:
    """A handed-over vLLM graph as the budget sees it (`deferred.DeferredCompile`): not compiled yet,
    its `reserved` share noted by the budget; `figure` is what its estimate answers here."""

    def __init__(self, figure, compiled=None):
        self.figure, self.compiled, self.reserved = figure, compiled, None
        memory.track(self)


class _Config:
    kv_cache_memory_bytes = None


class _Worker:
    """vLLM's worker as far as `determine_available_memory` goes: its profiling run hands over the
    graphs `during` names (dynamo compiling the model's graphs) and, with `compiled_during`, one
    compiled at once (served already: its memory is the captures', not the budget's)."""

    requested, non_kv, peak = 72 * GIB, 3 * GIB, 1 * GIB
    during: list = []
    compiled_during = False

    def __init__(self):
        self.cache_config, self.vllm_config = _Config(), object()

    def determine_available_memory(self) -> int:
        self.handed = [_Graph(figure) for figure in self.during]
        self.compiled = _Graph(7 * GIB, compiled=object()) if self.compiled_during else None
        self.peak_activation_memory = self.peak
        self.available_kv_cache_memory_bytes = self.requested - self.non_kv
        return int(self.available_kv_cache_memory_bytes)


def _estimate(graph, vllm_config):
    """Each graph's own figure, in parts that differ, so that a part dropped or one graph's figure
    taken for all shows."""
    if graph.figure is None:
        return None
    return memory.GraphMemoryEstimate(graph.figure // 2, graph.figure // 4, graph.figure - 3 * (graph.figure // 4), 1)


@pytest.fixture
def worker_cls(monkeypatch):
    """A fresh worker class, wrapped by the KV budget; this process's reservation flag put back after."""
    monkeypatch.setattr(memory, "estimate", _estimate)
    monkeypatch.setattr(memory, "_RESERVED", [False])
    monkeypatch.delenv(memory.ENV, raising=False)
    cls = type("Worker", (_Worker,), {"during": [], "compiled_during": False})
    kv_budget.wrap(cls)
    return cls


MIB = 1 << 20
FIGURES = [300 * MIB, 700 * MIB, 200 * MIB]  # the largest not the first, none the sum of others


def test_every_graph_the_profiling_run_hands_over_is_summed_into_the_kv_budget(worker_cls, caplog):
    """Three graphs handed over by one profiling run (a model compiled as several graphs: a drafter, an
    encoder): the answer takes out the sum of their figures, not the largest, not the first; vLLM's
    `available_kv_cache_memory_bytes` and `peak_activation_memory` move by that sum; each graph keeps its
    own share (compared with what its captures take later). A graph handed over before the profiling run
    (an earlier compile's) and one compiled already are not in it."""
    before = _Graph(5 * GIB)  # handed over before this profiling run
    worker_cls.during, worker_cls.compiled_during = FIGURES, True
    worker = worker_cls()
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        answer = worker.determine_available_memory()
    total = sum(FIGURES)
    assert answer == worker_cls.requested - worker_cls.non_kv - total
    assert worker.available_kv_cache_memory_bytes == answer
    assert worker.peak_activation_memory == worker_cls.peak + total
    assert [g.reserved for g in worker.handed] == FIGURES
    assert before.reserved is None and worker.compiled.reserved is None
    assert f"{total / MIB:.1f} MiB taken out of vLLM's KV-cache budget" in caplog.text
    assert caplog.text.count("over 1 graphs") == len(FIGURES)  # each graph's figure described


def test_one_graph_without_an_estimate_among_several_reserves_nothing_and_says_so(worker_cls, caplog):
    """An estimate of one graph of three failing (None: its allocations not traced) leaves vLLM's answer
    as it was, with the warning naming the override: a figure of the other two only would be short."""
    worker_cls.during = [FIGURES[0], None, FIGURES[2]]
    worker = worker_cls()
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        assert worker.determine_available_memory() == worker_cls.requested - worker_cls.non_kv
    assert worker.peak_activation_memory == worker_cls.peak
    assert all(g.reserved is None for g in worker.handed)
    assert "graph memory not reserved in vLLM's KV-cache budget" in caplog.text and memory.ENV in caplog.text


def test_the_override_is_the_total_for_every_graph_handed_over(worker_cls, monkeypatch):
    """`ASCEND_COMPILE_GRAPH_MEMORY` is the bytes to reserve for all the graphs of the profiling run (the
    warning after a recompile asks for "the total of every graph's figure"): taken out once, not once a
    graph; each graph's share is bounded by it."""
    monkeypatch.setenv(memory.ENV, str(GIB))
    worker_cls.during = FIGURES
    worker = worker_cls()
    assert worker.determine_available_memory() == worker_cls.requested - worker_cls.non_kv - GIB
    assert worker.peak_activation_memory == worker_cls.peak + GIB
    assert [g.reserved for g in worker.handed] == [GIB] * len(FIGURES)


def test_several_piecewise_sizes_buffers_are_each_counted_once_as_the_pieces_make_them():
    """The figure's piecewise static buffers (`memory._piece_buffers`) are every piecewise size's, each
    at its own padded sizes: equal to the bytes the pieces of each size hold once steps of that size
    were served (three sizes captured, not only the largest, not the largest times three); and the
    artifact's own report (`memory.graph_memory`, what is logged after each capture) sums every full
    graph's and every size's buffers. No vLLM: the example Llama under `ascend_compile.compile`."""
    cfg = LlamaConfig(num_layers=2, num_blocks=128, block_size=16)
    model = build(cfg)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=256, capture_sizes=(4, 8), piecewise_sizes=(32, 64, 128), runtime="sim")
    fn = ascend_compile.compile(model, backend=backend(config, on_compiled=artifacts.append))
    batch = PagedBatch(cfg, seed=2)
    with torch.no_grad():
        for lens, qlens in (([5, 9], None), ([7, 3, 11, 2, 6], None), ([20], [20]), ([50], [50]), ([100], [100])):
            fn(**batch.step(lens, qlens))
    art = artifacts[-1]
    sizes = {str(k): g.memory()["static_inputs_bytes"] for (k, _), g in art.piecewise.items()}
    assert sorted(sizes) == ["p128", "p32", "p64"] and len(set(sizes.values())) == 3
    assert memory._piece_buffers(art.rewritten) == sum(sizes.values())
    full = [g.memory()["static_inputs_bytes"] for g in art.graphs.values() if g.graph is not None]
    assert len(full) == 2 and all(full)
    assert memory.graph_memory(art.memory_report())["buffers"] == sum(full) + sum(sizes.values())


def _block(n):
    return n * 64 * 4  # a float32 [n, 64] tensor


def test_a_view_outliving_its_base_keeps_the_bases_block_while_later_ops_allocate():
    """`a` is dead as a node once `v = a[2:]` is made, but `v` still holds `a`'s storage: `a`'s block
    stays allocated while `c` is made (freed after `v`'s last reader), so the pool's peak holds three
    blocks, not two (freeing it with its node would let `c` reuse it and undercount the pool)."""
    def f(x):
        a = x * 2
        v = a[2:]
        c = x[2:] * 3
        return v + c

    trace = trace_allocations(_dynamo_graph(f, torch.randn(8, 64)))
    assert [(kind, ident) for kind, ident, _ in trace.events] == [
        ("alloc", 0), ("alloc", 1), ("alloc", 2), ("free", 0), ("free", 1)]
    (tokens,) = {s for kind, _, n in trace.events if kind == "alloc" for s in n.free_symbols}
    # segments of one block's size: what the pool reserves is its peak of live blocks
    assert pool_reserved(sim_pool_model(_block(40)), [(trace, {tokens: 40})]) == 3 * _block(40)


def test_a_graph_returning_a_view_of_a_temporary_keeps_the_base_until_the_caller_lets_go():
    """A graph output that is a view of an op's result (`a[1:]`) holds its base's block: the base is an
    output's storage (`outputs`), never freed inside the capture; over several captures each output is
    let go before the next (the runner keeps weak aliases), so the pool reuses it."""
    def f(x):
        return (x * 2)[1:], x + 1

    trace = trace_allocations(_dynamo_graph(f, torch.randn(8, 64)))
    assert [kind for kind, _, _ in trace.events] == ["alloc", "alloc"]
    assert trace.outputs == ((0,), (1,))
    (tokens,) = {s for kind, _, n in trace.events if kind == "alloc" for s in n.free_symbols}
    model = sim_pool_model(_block(40))  # a segment a block: what is reserved counts the live blocks
    held = trace.replay_held(model, {tokens: 40})
    assert model.large.stats()["allocated_bytes"] == 2 * _block(40)
    for handle in held.values():
        model.release(handle)
    three = pool_reserved(sim_pool_model(_block(40)), [(trace, {tokens: 40})] * 3)
    assert three == model.reserved_bytes() == 2 * _block(40)


def test_three_models_on_one_runtime_share_its_graph_budget_each_given_what_the_others_left(request):
    """Several models in one workspace group share the runtime's graph budget (`budget.fit`'s `taken`,
    `WorkspaceGroup.planned_graphs`): each is given the budget less the graphs of every member planned
    before it (their sum, not the largest), each member's count being its full graphs plus its pieces
    for every piecewise size it keeps (not for one size); together they fit."""
    from ascend_compile.runtime.sim import SimRuntime
    from ascend_compile.targets import Target

    torch._dynamo.reset()
    group, sim = f"three-{request.node.name}", SimRuntime(stream_budget=30)
    cfg = LlamaConfig(num_layers=2, num_blocks=64)
    budgets = []
    for name in ("target", "drafter", "encoder"):
        artifacts: list = []
        config = CompileConfig(capture_sizes=(4,), max_model_len=256, piecewise_sizes=(16, 32, 64), kernel_policy="pa",
                               workspace_group=group, model_name=name)
        fn = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append,
                                                                target=lambda device, config: Target(sim)))
        with torch.no_grad():
            fn(**PagedBatch(cfg).step([5]))
        budgets.append(artifacts[0].startup.budget)
    first, second, third = budgets
    assert (first.full, first.pieces, first.sizes) == (2, 3, [16, 32, 64])  # b4's decode and mixed graphs; 2 layers + 1
    assert first.graphs == second.graphs == 2 + 3 * 3
    assert (first.budget, second.budget, third.budget) == (30, 30 - 11, 30 - 22)
    assert third.sizes == [16, 64] and third.graphs == 8  # 2 full graphs and 2 sizes of 3 pieces fit in 8
    assert first.graphs + second.graphs + third.graphs <= 30


@pytest.mark.parametrize("order, exact", [((20, 40, 100), True), ((100, 20, 40), False)])
def test_the_pieces_pool_figure_bounds_what_the_simulators_captures_of_every_size_reserve_in_any_order(order, exact):
    """The figure's pieces pool (`memory._piece_pool`): the pieces traced, each piece's outputs held until
    the last piece reading them is captured, every size replayed smallest first on a pool of their own.
    On the simulator (segments of 4 KiB, so each held block shows), the sizes captured smallest first
    reserve the figure to the byte; the largest first, less (the smaller sizes fit in what it freed;
    every other order of the three was measured between the two). No vLLM."""
    from ascend_compile.runtime.sim import SimRuntime
    from ascend_compile.targets import Target

    cfg = LlamaConfig(num_layers=2, num_blocks=128, block_size=16)
    sim = SimRuntime(segment_bytes=1 << 12)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=256, capture_sizes=(4, 8), piecewise_sizes=(32, 64, 128))
    fn = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append,
                                                            target=lambda device, config: Target(sim)))
    batch = PagedBatch(cfg, seed=2)
    with torch.no_grad():
        for tokens in order:
            fn(**batch.step([tokens], [tokens]))
    art = artifacts[-1]
    assert sorted(str(k) for k, _ in art.piecewise) == ["p128", "p32", "p64"] and art.stats["captures"] == 0
    reserved = art.memory_report()["pool"]["graph"]["reserved_bytes"]
    figure = memory._piece_pool(art.rewritten, sim)
    assert (reserved == figure) if exact else (32 * (1 << 12) < reserved < figure), (reserved, figure)