"""Windowed, sink and soft-capped attention (`ops/features.py`): the reference kernels against the
dense oracle, blocks outside a window never read, the exact workspace with a window, per-layer
kernels in a model mixing full and windowed layers, and the refusals."""
from __future__ import annotations

import json
import random

import pytest
import torch

from ascend_compile import CompileConfig, backend
from ascend_compile.ops import tiling
from ascend_compile.ops.features import AttentionFeatures
from ascend_compile.passes.workspaces import KernelSite, node_need
from examples.llama import LlamaConfig, PagedBatch, build
from tests.helpers import make_problem
from tests.test_backend import compiled_model

SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])


def attend(problem, **features):
    seq_lens, query_start_loc = problem.tensors()
    return torch.ops.ascend.attention(problem.query, problem.key_cache, problem.value_cache, problem.block_table,
                                      seq_lens, query_start_loc, problem.scale, **features)


@pytest.mark.parametrize("features", [
    {"window": 1}, {"window": 7}, {"window": 40}, {"window": 300}, {"window": 5000},  # < , = and > the contexts
    {"soft_cap": 0.3}, {"soft_cap": 30.0}, {"sinks": SINKS},
    {"window": 9, "soft_cap": 1.5}, {"window": 17, "sinks": SINKS}, {"window": 33, "soft_cap": 2.0, "sinks": SINKS},
])
@pytest.mark.parametrize("query_lens", [None, [1, 4, 2, 7, 1]], ids=["decode", "chunked"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_features_equal_the_dense_oracle(features, query_lens, kv_heads):
    problem = make_problem([40, 300, 1030, 17, 7], query_lens, heads=4, kv_heads=kv_heads, dim=16, block_size=16,
                           seed=len(features))
    torch.testing.assert_close(attend(problem, **features), problem.dense(**features), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("query_lens", [None, [1, 4, 2]])
def test_blocks_before_a_window_are_never_read(query_lens):
    """A runtime may free the blocks a window has left behind and reuse or null their entries
    (vLLM's hybrid KV-cache manager): entries before each sequence's span hold an invalid block id."""
    window = 20
    problem = make_problem([100, 333, 64], query_lens, block_size=16)
    expected = problem.dense(window=window)
    table = problem.block_table.clone()
    for row, (kv, q) in enumerate(zip(problem.seq_lens, problem.query_lens)):
        first = (kv - AttentionFeatures(window).span(kv, q)) // 16
        table[row, :first] = problem.key_cache.shape[0] + 1000
    problem.block_table = table
    torch.testing.assert_close(attend(problem, window=window), expected, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="block_table: expected block ids"):
        attend(problem)  # without the window every block is read


@pytest.mark.parametrize("max_query, tokens", [(1, 8), (8, 8), (5, 16)])
def test_the_workspace_with_a_window_is_the_brute_force_maximum_over_what_the_layer_reads(max_query, tokens):
    """The worst case over every step: `tokens` query tokens in sequences of at most `max_query`
    tokens each, of any KV length up to max_model_len, each tiling the keys it reads."""
    shape, window, max_len = tiling.AttentionShape(4, 2, 16, 16), 1500, 6000
    features = AttentionFeatures(window)
    site = KernelSite("fia", tiling.FIA, shape, features, max_query)
    need = node_need(site, tokens, max_len, None)
    brute = max(tiling.workspace_nbytes(tiling.FIA, shape, [features.span(kv, q)] * (tokens // q), [q] * (tokens // q))
                for q in range(1, max_query + 1) for kv in range(q, max_len + 1, 7))
    brute = max(brute, tokens * int(tiling.per_token_nbytes(tiling.FIA, shape, torch.tensor([window + max_query - 1]))))
    assert need.exact_nbytes == brute
    assert need.exact_nbytes < node_need(KernelSite("fia", tiling.FIA, shape), tokens, max_len, None).exact_nbytes


MIXED = LlamaConfig(num_layers=4, num_blocks=400, layer_types=("full", "sliding", "full", "sliding"),
                    sliding_window=48)


def test_a_model_mixing_full_and_windowed_layers_takes_pa_per_layer_where_it_can(tmp_path):
    """Full layers keep the bucket's policy (PA up to pa_max_batch); windowed layers take FIA in
    every bucket; equal to eager across buckets, decode and mixed; the plan says why per layer."""
    model, reference = build(MIXED), build(MIXED)
    fn, artifacts = compiled_model(model, max_model_len=512, capture_sizes=(4, 8, 16), pa_max_batch=4,
                                   sim_overflow="raise", dump_dir=str(tmp_path))
    batch, rng = PagedBatch(MIXED, seed=4), random.Random(4)
    steps = [[rng.randint(1, 500) for _ in range(n)] for n in (3, 2, 6, 4, 12, 3)]
    steps += [([30, 200, 90], [3, 1, 2]), ([60, 70], [5, 2])]
    with torch.no_grad():
        for step in steps:
            lens, qlens = step if isinstance(step, tuple) else (step, None)
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    art = max(artifacts, key=lambda a: len(a.graphs))
    assert sum(a.stats["replays"] for a in artifacts) == len(steps)
    plan = json.loads(open(f"{art.rewritten.graph_dir}/plan.json").read())
    small = [k["kernel"] for k in plan["graphs"]["b4.decode"]["kernels"]]
    assert small == [tiling.PA, tiling.FIA, tiling.PA, tiling.FIA]
    assert [k["kernel"] for k in plan["graphs"]["b8.decode"]["kernels"]] == [tiling.FIA] * 4
    windowed = plan["graphs"]["b4.decode"]["kernels"][1]
    assert "window" in windowed["reason"] and windowed["features"] == {"window": 48, "soft_cap": None, "sinks": False}
    # every bucket has a mixed graph: PA is decode-only, and on the simulator FIA's decode and mixed calls
    # take two branches (`Target.mixed_graph_kernels`)
    assert "b4.mixed" in plan["graphs"] and "b8.mixed" in plan["graphs"]


def test_pa_is_never_given_a_featured_layer():
    from ascend_compile.passes.select_kernels import select_kernels

    fn, _ = compiled_model(build(MIXED), max_model_len=512, capture_sizes=(4,))
    gm = {}

    def grab(graph, example_inputs):
        gm["g"] = graph
        return graph

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(build(MIXED), backend=grab)(**PagedBatch(MIXED).step([5, 6]))
    with pytest.raises(ValueError, match=r"PA does not take window; the layer needs FIA"):
        select_kernels(gm["g"], [tiling.PA] * 4)


def test_the_eager_op_runs_fia_for_a_featured_decode_batch():
    from ascend_compile.ops.library import choose_eager_kernel

    shape = tiling.AttentionShape(4, 2, 16, 16)
    assert choose_eager_kernel([1, 1], shape) == tiling.PA
    assert choose_eager_kernel([1, 1], shape, AttentionFeatures(window=8)) == tiling.FIA
    assert choose_eager_kernel([1, 1], shape, AttentionFeatures(sinks=True)) == tiling.FIA


@pytest.mark.parametrize("bad, message", [({"window": 0}, "window: expected a positive int"),
                                          ({"soft_cap": -1.0}, "soft_cap: expected a positive float"),
                                          ({"sinks": torch.zeros(3)}, r"sinks: expected a floating \[4\] tensor")])
def test_bad_features_are_refused_naming_the_argument(bad, message):
    with pytest.raises(ValueError, match=message):
        attend(make_problem([5, 9]), **bad)


def test_a_model_with_sinks_and_a_soft_cap_is_captured_and_equals_eager():
    cfg = LlamaConfig(num_layers=2, num_blocks=300, sinks=True, soft_cap=2.0, layer_types=("sliding", "full"),
                      sliding_window=30)
    model, reference = build(cfg), build(cfg)
    for m in (model, reference):
        for layer in m.layers:
            layer.attn.sinks.data.copy_(torch.tensor([0.3, -0.7, 1.1, 0.0]))
    fn, artifacts = compiled_model(model, max_model_len=256, capture_sizes=(4, 8), sim_overflow="raise")
    batch = PagedBatch(cfg, seed=6)
    steps = [[100, 20, 7], [200, 31], [5, 6, 7, 8, 9], ([40, 50], [3, 2])]
    with torch.no_grad():
        for step in steps:
            lens, qlens = step if isinstance(step, tuple) else (step, None)
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    assert sum(a.stats["replays"] for a in artifacts) == len(steps)
    kernels = {k["kernel"] for a in artifacts for g in a.describe()["graphs"].values() for k in g["kernels"]}
    assert kernels == {tiling.FIA}


def test_a_soft_cap_dynamo_takes_as_a_host_float_input_is_read_at_each_capture_and_checked_each_step():
    """Under `torch.compile(dynamic=True)` dynamo passes a module's float attribute (here the soft-cap)
    as a graph input; the compile refused it ("soft_cap: expected a constant of the layer", found by the
    differential tester). It is now the input's value at each capture; changed between steps, every step
    still equals eager (here dynamo compiles the new value; where it does not, the runner's check of host
    scalars re-captures, `lowering/input_checks.py`)."""
    cfg = LlamaConfig(num_layers=1, num_blocks=64, soft_cap=5.0)
    model, reference = build(cfg), build(cfg)
    artifacts = []
    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend(CompileConfig(max_model_len=64, capture_sizes=(4,),
                                                            sim_overflow="raise"), on_compiled=artifacts.append),
                       dynamic=True)
    batch = PagedBatch(cfg, seed=3)
    with torch.no_grad():
        for soft_cap, lens in ((5.0, [30, 2, 9]), (5.0, [31, 3, 10]), (0.5, [32, 4, 11]), (0.5, [33, 5])):
            object.__setattr__(cfg, "soft_cap", soft_cap)  # both models' layers read this (frozen) config
            inputs = batch.step(lens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    assert sum(a.stats["replays"] for a in artifacts) == 4 and sum(a.stats["eager_fallbacks"] for a in artifacts) == 0
