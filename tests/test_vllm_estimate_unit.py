"""The graph memory estimate made at vLLM's profiling run (`integrations/vllm/memory.py: estimate`), on the
stand-in vLLM (`tests/vllm_standin.py`, no vLLM): the graph the profiling run hands over (no metadata,
no KV cache, nothing compiled) is estimated against the planning context, then served, and the figure
compared with what the artifact's captures take: the workspaces and static buffers are the compile's
own to the byte, the graph pool bounds what the simulator's captures reserve and is at least 0.8x of
it; the kernels "auto" may pick are each sized and the larger taken; what cannot be estimated says so."""
from __future__ import annotations

import dataclasses
import logging
import random
import types

import pytest
import torch

from ascend_compile.config import CompileConfig
from ascend_compile.integrations import vllm as integration
from ascend_compile.integrations.vllm import memory
from tests import vllm_standin as v

NS = types.SimpleNamespace
BLOCK, MAX_LEN, BUCKETS = 16, 500, (4, 8)  # 500 tokens: 31.25 blocks, a table 32 wide


@pytest.fixture
def small_segments(monkeypatch):
    """The simulator's pools in 4 KiB segments (not 64 MiB): the pool follows what the captures allocate."""
    import ascend_compile.runtime.sim as sim

    class SmallSegments(sim.SimRuntime):
        def __init__(self, **kwargs):
            super().__init__(segment_bytes=1 << 12, **kwargs)

    monkeypatch.setattr(sim, "SimRuntime", SmallSegments)  # where create_runtime looks it up


class Served:
    """The stand-in model compiled with the integration's backend, its profiling run's graph handed over."""

    def __init__(self, **options):
        self.artifacts: list = []
        self.config = v.VllmConfig()
        self.model = v.StandInModel(self.config, backend="FLASH_ATTN", seed=3, head_size=8)
        self.num_blocks = 64
        v.bind_kv_cache(self.model, self.num_blocks, BLOCK)
        for layer in self.model.attention_layers().values():  # one KV-cache group, as `build_metadata` makes
            layer.get_kv_cache_spec = lambda vllm_config: "full attention"
        self.config.cache_config = NS(block_size=BLOCK)  # what the estimate reads of vLLM's config
        self.config.model_config = NS(dtype=torch.float32)
        config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=BUCKETS, runtime="sim", **options)
        torch._dynamo.reset()
        compile_fn = integration.backend(config, on_compiled=self.artifacts.append,
                                         get_forward_context=v.get_forward_context)
        self.compiled = torch.compile(self.model, backend=compile_fn, dynamic=True)
        since = memory.handed_over()
        with torch.no_grad(), v.set_forward_context(None, self.config):
            self.compiled(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
        (self.graph,) = memory.tracked(since)

    def serve(self, seq_lens, query_lens):
        width = -(-MAX_LEN // BLOCK)
        blocks = torch.randint(0, self.num_blocks, (len(seq_lens) * width,), generator=torch.Generator().manual_seed(1))
        step = v.Step(seq_lens, query_lens, blocks.view(len(seq_lens), width).to(torch.int32), BLOCK)
        attn_metadata, slot_mapping = v.build_metadata(self.model, step)
        ids = torch.randint(0, 64, (step.num_tokens,), generator=torch.Generator().manual_seed(2))
        with torch.no_grad(), v.set_forward_context(attn_metadata, self.config, slot_mapping=slot_mapping):
            return self.compiled(ids, torch.tensor(step.positions()))

    def measured(self):
        return memory.graph_memory(self.artifacts[0].memory_report())


def _serve_every_graph(served, sizes=()):
    """A decode step (with `capture_all`: every bucket's decode graph), a mixed step of each bucket, a
    prefill of each piecewise size."""
    served.serve([20, 30, 400], [1, 1, 1])
    for bucket in BUCKETS:
        served.serve([20] * (bucket - 2) + [300], [2] + [1] * (bucket - 2))
    for size in sizes:
        served.serve([size], [size])


def test_the_figure_is_the_compiles_own_workspaces_and_buffers_and_bounds_its_pool(small_segments):
    served = Served(capture_all=True, piecewise_sizes=(), kernel_policy="pa", pa_max_batch=4)
    figure = memory.estimate(served.graph, served.config)
    assert figure.graphs == 2 * len(BUCKETS)  # each bucket's decode graph and its mixed one (PA's)
    assert served.artifacts == []  # nothing compiled by the estimate
    _serve_every_graph(served)
    assert served.artifacts[0].stats["captures"] == 2 * len(BUCKETS)
    parts = served.measured()
    assert parts["workspaces"] == figure.workspaces > 0 and parts["buffers"] == figure.buffers > 0
    assert 0.8 * figure.pool <= parts["pool"] <= figure.pool
    assert figure.total == figure.workspaces + figure.buffers + figure.pool


def test_auto_is_sized_for_both_kernels_it_may_pick_the_larger_figure_taken(small_segments, monkeypatch):
    served = Served(piecewise_sizes=(), kernel_policy="auto", pa_max_batch=4)
    auto = memory.estimate(served.graph, served.config)
    figures = {}
    for kind in ("pa", "fia"):
        monkeypatch.setattr(served.graph, "config", dataclasses.replace(served.graph.config, kernel_policy=kind))
        figures[kind] = memory.estimate(served.graph, served.config)
    assert figures["pa"].total > figures["fia"].total and figures["pa"].workspaces > figures["fia"].workspaces
    assert auto == figures["pa"]
    monkeypatch.setattr(memory, "rewrite_buckets", _with_larger_buffers_for("fia"))
    monkeypatch.setattr(served.graph, "config", dataclasses.replace(served.graph.config, kernel_policy="auto"))
    assert memory.estimate(served.graph, served.config).buffers > figures["fia"].buffers  # fia's, now the larger


def _with_larger_buffers_for(kind):
    """`rewrite_buckets` whose `kind` rewrite copies one more input (a second table): its figure the larger."""
    original = memory.rewrite_buckets

    def rewrite(gm, config, target, bind):
        rewritten = original(gm, config, target, bind=bind)
        if config.kernel_policy == kind:
            signature = rewritten.signature
            table = next(spec for spec in signature.inputs if spec.name.startswith("vllm_block_table"))
            more = dataclasses.replace(signature, inputs=(*signature.inputs, table))
            rewritten = _Replaced(rewritten, signature=more)
        return rewritten

    return rewrite


class _Replaced:
    """A rewritten graph with some attributes replaced."""

    def __init__(self, rewritten, **replaced):
        self._rewritten, self.__dict__ = rewritten, {**replaced, "_rewritten": rewritten}

    def __getattr__(self, name):
        return getattr(self._rewritten, name)


def test_the_estimate_neither_dumps_nor_logs_what_the_compile_would(small_segments, tmp_path, caplog, monkeypatch):
    served = Served(piecewise_sizes=(), kernel_policy="pa", dump_dir=str(tmp_path / "dumps"))
    original, log = memory.rewrite_buckets, logging.getLogger("ascend_compile")

    def rewrite(gm, config, target, bind):  # the compile's rewrite, logging as the compile's does
        log.info("ascend_compile: rewritten (info)")
        log.warning("ascend_compile: rewritten (warning)")
        return original(gm, config, target, bind=bind)

    monkeypatch.setattr(memory, "rewrite_buckets", rewrite)
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        assert memory.estimate(served.graph, served.config) is not None
        assert log.getEffectiveLevel() == logging.DEBUG  # as it was
    assert not (tmp_path / "dumps").exists()
    assert [r.getMessage() for r in caplog.records if r.name == "ascend_compile"] == [
        "ascend_compile: rewritten (warning)"]


@pytest.mark.parametrize("sizes", [(16, 64), (64,)])  # one size alone too (the user's `piecewise_sizes`)
def test_the_piecewise_sizes_buffers_and_pieces_pool_are_added(small_segments, monkeypatch, sizes):
    served = Served(capture_all=True, piecewise_sizes=sizes, kernel_policy="pa", pa_max_batch=4)
    full = memory.estimate(Served(capture_all=True, piecewise_sizes=(), kernel_policy="pa", pa_max_batch=4).graph,
                           served.config)
    replayed = []

    def piece_pool(rewritten, runtime):  # the pieces' own replay, stood in: 10,001 bytes reserved
        replayed.append((runtime.name, [k.bucket for k in rewritten.piecewise.keys]))
        return 10_001

    monkeypatch.setattr(memory, "_piece_pool", piece_pool)
    figure = memory.estimate(served.graph, served.config)
    assert replayed == [("sim", list(sizes))]  # the rewritten graph's pieces, on the runtime's pool model
    assert figure.pool == full.pool + 10_502  # 5% more, rounded up
    assert figure.graphs == full.graphs and figure.workspaces == full.workspaces
    _serve_every_graph(served, sizes)
    assert served.artifacts[0].stats["piecewise_captures"] > 0
    assert served.measured()["buffers"] == figure.buffers > full.buffers  # every size's buffers too


def test_the_pieces_pool_is_traced_piece_by_piece_and_bounds_what_their_captures_reserve(small_segments):
    """The pieces' pool traced by the estimate itself (no stand-in): the stand-in model's first piece reads
    only the token count (its inputs hold no tensor), and is traced all the same; the figure with piecewise
    sizes exceeds the full graphs' alone and bounds the pool serving every graph and size reserves."""
    sizes = (16, 64)
    served = Served(capture_all=True, piecewise_sizes=sizes, kernel_policy="pa", pa_max_batch=4)
    full = memory.estimate(Served(capture_all=True, piecewise_sizes=(), kernel_policy="pa", pa_max_batch=4).graph,
                           served.config)
    figure = memory.estimate(served.graph, served.config)
    assert figure is not None and figure.pool > full.pool and figure.buffers > full.buffers
    _serve_every_graph(served, sizes)
    assert served.artifacts[0].stats["piecewise_captures"] == len(sizes)
    parts = served.measured()
    assert parts["workspaces"] == figure.workspaces and parts["buffers"] == figure.buffers
    assert 0.8 * figure.pool <= parts["pool"] <= figure.pool, (parts, figure)


def test_pieces_whose_allocations_cannot_be_traced_give_no_figure(small_segments, monkeypatch):
    served = Served(piecewise_sizes=(16, 64), kernel_policy="pa")
    monkeypatch.setattr(memory, "_piece_pool", lambda rewritten, runtime: None)
    assert memory.estimate(served.graph, served.config) is None


def test_a_graph_whose_allocations_cannot_be_traced_gives_no_figure(small_segments, monkeypatch):
    served = Served(piecewise_sizes=(), kernel_policy="pa")
    traced = []
    monkeypatch.setattr(memory, "trace_allocations", lambda gm, one_kernel: traced.append(gm) and None)
    assert memory.estimate(served.graph, served.config) is None
    assert traced


def test_on_a_runtime_without_graphs_the_figure_is_the_workspaces_alone(small_segments, monkeypatch):
    served = Served(piecewise_sizes=(), kernel_policy="pa", pa_max_batch=4)
    figure = memory.estimate(served.graph, served.config)
    monkeypatch.setattr(memory, "pool_model", lambda runtime: None)
    assert memory.estimate(served.graph, served.config) == memory.GraphMemoryEstimate(figure.workspaces, 0, 0, 0)


def test_a_graph_keeping_sizes_as_seen_has_no_figure_and_says_which(small_segments, monkeypatch, caplog):
    import sympy

    served = Served(piecewise_sizes=(), kernel_policy="pa")
    original = memory.rewrite_buckets

    def rewrite(gm, config, target, bind):
        rewritten = original(gm, config, target, bind=bind)
        rewritten.signature.__dict__["specialized"] = (sympy.Symbol("s7"), sympy.Symbol("s9"))
        return rewritten

    monkeypatch.setattr(memory, "rewrite_buckets", rewrite)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        assert memory.estimate(served.graph, served.config) is None
    assert [r.getMessage() for r in caplog.records if r.name == "ascend_compile"] == [
        "ascend_compile: no graph memory estimate: the graph keeps sizes ['s7', 's9'] as seen"]


def test_the_planning_context_is_made_on_the_graphs_device_and_the_binder_given_its_example_inputs(
        small_segments, monkeypatch):
    """The estimate rewrites with the graph's own binder class, made with the graph's example inputs, on a
    planning context of the graph's layers whose fakes are on the graph's device, with a block table wide
    enough for `max_model_len` (rounded up to whole blocks)."""
    served = Served(piecewise_sizes=(), kernel_policy="pa")
    made, bound = [], []
    original = memory.planning_context
    monkeypatch.setattr(memory, "planning_context", lambda names, config, device, mode, max_blocks: made.append(
        (list(names), config, device, max_blocks)) or original(names, config, device, mode, max_blocks))

    class Binder(type(served.graph.binder)):
        def __init__(self, get_forward_context, example_inputs=None):
            bound.append(example_inputs)
            super().__init__(get_forward_context, example_inputs)

    monkeypatch.setattr(served.graph, "binder", Binder(v.get_forward_context, served.graph.example_inputs))
    bound.clear()
    assert memory.estimate(served.graph, served.config) is not None
    assert made == [(list(served.model.attention_layers()), served.config, torch.device("cpu"), 32)]
    assert len(bound) == 1 and bound[0] is served.graph.example_inputs


def test_the_pieces_are_split_as_the_runner_splits_them(small_segments):
    """`memory._piecewise_graph`: a size's piecewise graph as the runner's own for that size (its padded
    sizes, the block table's width among them, and its segments), nothing captured. No vLLM: the example
    Llama, whose block table width is a size of its own."""
    import ascend_compile
    from ascend_compile.backend import backend
    from ascend_compile.passes.roles import SymbolKind
    from examples.llama import LlamaConfig, PagedBatch, build

    cfg = LlamaConfig(num_layers=2, num_blocks=128, block_size=16)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=250, capture_sizes=(4, 8), piecewise_sizes=(32, 64), runtime="sim")
    fn = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append))
    with torch.no_grad():
        fn(**PagedBatch(cfg, seed=2).step([20], [20]))
    art = artifacts[-1]
    ((key, _), served), = art.piecewise.items()
    assert SymbolKind.BLOCKS in served.signature.symbol_kinds.values() and 16 in served.padded.values()
    graph = memory._piecewise_graph(art.rewritten, key)
    assert graph.padded == served.padded
    assert [type(s).__name__ for s in graph.segments] == [type(s).__name__ for s in served.segments]
    assert graph.pieces == [] and graph.buffers == {}


class _AttentionOnly(torch.nn.Module):
    """vLLM's attention alone on the step's hidden states: a graph whose one tensor input is the step's."""

    def __init__(self, config):
        super().__init__()
        self.attn = v.Attention(2, 8, 0.25, num_kv_heads=2, prefix="model.layers.0.self_attn.attn", vllm_config=config)

    def forward(self, hidden):
        return self.attn(hidden, hidden, hidden)

    def attention_layers(self):
        return {self.attn.layer_name: self.attn}


def test_a_graph_with_one_tensor_input_is_estimated_on_its_device(small_segments, caplog):
    """The graph's device is its tensor inputs' (here its one input's): the estimate goes on to its answer
    (none: this graph keeps the hidden states' row count as seen, no role giving it a bucket)."""
    config = v.VllmConfig()
    model = _AttentionOnly(config)
    v.bind_kv_cache(model, 64, BLOCK)
    config.cache_config, config.model_config = NS(block_size=BLOCK), NS(dtype=torch.float32)
    torch._dynamo.reset()
    compile_fn = integration.backend(CompileConfig(max_model_len=MAX_LEN, capture_sizes=BUCKETS, runtime="sim",
                                                   kernel_policy="pa", piecewise_sizes=()),
                                     get_forward_context=v.get_forward_context)
    compiled = torch.compile(model, backend=compile_fn, dynamic=True)
    since = memory.handed_over()
    with torch.no_grad(), v.set_forward_context(None, config):
        compiled(torch.randn(3, 16))
    (graph,) = memory.tracked(since)
    tensors = [p for p in graph.gm.graph.find_nodes(op="placeholder")
               if isinstance(p.meta.get("example_value"), torch.Tensor)]
    assert len(tensors) == 1
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        assert memory.estimate(graph, config) is None
    assert "no graph memory estimate: the graph keeps sizes" in caplog.text


def test_the_graphs_are_replayed_in_capture_order_traced_as_the_runtime_records_kernels(small_segments, monkeypatch):
    """The graph pool is modelled in the order `capture_all` captures: decode graphs largest first, then the
    mixed ones; each variant traced with the runtime's own kernels (a simulator's device kernel is one
    kernel, any other op its body's)."""
    served = Served(piecewise_sizes=(), kernel_policy="pa", pa_max_batch=4)
    order, kernels = [], []
    rewrite, trace = memory.rewrite_buckets, memory.trace_allocations

    def recording(gm, config, target, bind):
        rewritten = rewrite(gm, config, target, bind=bind)
        return _Replaced(rewritten, variant_for=lambda key: order.append(key) or rewritten.variant_for(key))

    monkeypatch.setattr(memory, "rewrite_buckets", recording)
    monkeypatch.setattr(memory, "trace_allocations", lambda gm, one_kernel: kernels.append(one_kernel) or
                        trace(gm, one_kernel))
    assert memory.estimate(served.graph, served.config) is not None
    assert [(k.decode, k.bucket) for k in order] == [(True, 8), (True, 4), (False, 8), (False, 4)]
    assert kernels and all(getattr(k, "__name__", None) == "is_kernel" for k in kernels)


def test_on_a_runtime_without_graphs_each_kernel_auto_may_pick_is_sized(small_segments, monkeypatch):
    """With "auto" and no graph pool, the figure is still the larger of both kernels' workspaces."""
    served = Served(piecewise_sizes=(), kernel_policy="auto", pa_max_batch=4)
    rewrite = memory.rewrite_buckets

    def larger_for_fia(gm, config, target, bind):
        rewritten = rewrite(gm, config, target, bind=bind)
        if config.kernel_policy == "fia":
            return _Replaced(rewritten, plan=NS(slots={"fia": NS(nbytes=3 * MIB_), "more": NS(nbytes=1)}))
        return rewritten

    monkeypatch.setattr(memory, "rewrite_buckets", larger_for_fia)
    monkeypatch.setattr(memory, "pool_model", lambda runtime: None)
    assert memory.estimate(served.graph, served.config) == memory.GraphMemoryEstimate(3 * MIB_ + 1, 0, 0, 0)


MIB_ = 1 << 20


def test_one_piecewise_size_alone_has_its_pieces_traced(small_segments):
    """The user's `piecewise_sizes` of one size: its pieces are traced and added, as with several."""
    served = Served(capture_all=True, piecewise_sizes=(64,), kernel_policy="pa", pa_max_batch=4)
    full = memory.estimate(Served(capture_all=True, piecewise_sizes=(), kernel_policy="pa", pa_max_batch=4).graph,
                           served.config)
    figure = memory.estimate(served.graph, served.config)
    assert figure is not None and figure.pool > full.pool
