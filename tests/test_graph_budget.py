"""The graph budget and the start-up ledger (issue 48, items 1 and 3): the compile counts the graphs it
will capture (full graphs, piecewise sizes x pieces) against the device's stream budget and drops
piecewise sizes past it (one WARNING naming them, never a failure); plan.json and `inspect` give the
count, the budget and the seconds of each start-up phase and capture."""
from __future__ import annotations

import json
import logging
import time

import pytest
import torch

import ascend_compile
from ascend_compile import cli, ledger
from ascend_compile.backend import backend
from ascend_compile.config import CompileConfig, default_capture_sizes, default_piecewise_sizes
from ascend_compile.lowering.budget import sample
from ascend_compile.runtime.sim import SimRuntime
from ascend_compile.targets import Target
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu

#: the smallest model the example builds: 80 of its layers compile and capture in seconds
TINY = dict(vocab_size=32, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_size=16, num_blocks=64)


def _compile(cfg, sim, **options):
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(**{"max_model_len": 256, **options})
    fn = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append,
                                                            target=lambda device, config: Target(sim)))
    return fn, artifacts


def test_a_stream_limit_of_2048_at_80_layers_compiles_and_serves_every_step_equal_to_eager(caplog):
    """The defaults (35 buckets, 40 piecewise sizes up to 8192 tokens) at 80 layers plan 70 full graphs
    and 81 pieces a piecewise size: 3,310 graphs, past a device of 2,048 streams. The compile keeps 24
    piecewise sizes (the largest among them), says which it dropped in one WARNING, and every step, on
    a full graph, on pieces or eagerly, equals eager, no capture refused."""
    cfg = LlamaConfig(num_layers=80, **TINY)
    sim = SimRuntime(stream_budget=2048)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        fn, artifacts = _compile(cfg, sim)
        reference, batch = build(cfg), PagedBatch(cfg, seed=2)
        with torch.no_grad():
            for lens, qlens in (([30, 40, 50], None), ([60, 70], [3, 2]), ([200, 250], [150, 150])):
                inputs = batch.step(lens, qlens)
                torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=1e-5, rtol=1e-5)
    art, = artifacts
    budget = art.startup.budget
    sizes = list(default_piecewise_sizes(default_capture_sizes()))
    assert (budget.full, budget.pieces, len(sizes)) == (70, 81, 40)
    assert budget.budget == 2048 and budget.graphs <= 2048 and len(budget.sizes) == (2048 - 70) // 81
    assert budget.sizes[-1] == 8192 and sorted(budget.sizes + budget.dropped) == sizes
    assert [k.bucket for k in art.rewritten.piecewise.keys] == budget.sizes
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "3310 graphs" in warnings[0] and str(budget.dropped) in warnings[0]
    assert art.stats["failed_captures"] == 0 and art.stats["captures"] == 2 and art.stats["piecewise_captures"] == 1
    assert sum(n for (_, path), n in art.served.items() if path == "piecewise") == 1  # 300 tokens, on pieces
    plan = art.describe()["startup"]["graph_budget"]
    assert plan == {"graphs": budget.graphs, "full_graphs": 70, "piecewise_sizes": 24, "graphs_per_piecewise_size": 81,
                    "budget": 2048, "budget_source": budget.source, "dropped_piecewise_sizes": budget.dropped}


def test_the_sizes_kept_are_spread_the_largest_always_among_them():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    assert sample(sizes, 8) == sizes and sample(sizes, 1) == [128] and sample(sizes, 0) == []
    assert sample(sizes, 3) == [1, 16, 128] and sample(sizes, 2) == [1, 128]


def test_a_budget_no_piecewise_size_fits_turns_them_off_and_steps_above_the_buckets_run_eagerly(caplog):
    cfg = LlamaConfig(num_layers=2, **TINY)
    fn, artifacts = _compile(cfg, SimRuntime(), capture_sizes=(4, 8), piecewise_sizes=(16, 32), graph_budget=4)
    batch, reference = PagedBatch(cfg, seed=2), build(cfg)
    with torch.no_grad():
        inputs = batch.step([5] * 12)
        torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=1e-5, rtol=1e-5)
    art, = artifacts
    assert art.rewritten.piecewise is None and "graph budget (4, the graph_budget option)" in art.rewritten.piecewise_reason
    assert art.served[("decode", "eager")] == 1 and art.startup.budget.dropped == [16, 32]


def test_plan_json_and_inspect_give_the_graph_count_the_budget_and_the_start_up_ledger(tmp_path, caplog, capsys):
    """kernel_policy "auto" times the kernels at compile time: the ledger has dynamo's trace, the passes
    and the kernel timing, each capture's seconds; `inspect` prints them with the graph count and budget;
    the compile says it all in one INFO line."""
    cfg = LlamaConfig(num_layers=2, **TINY)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        fn, artifacts = _compile(cfg, SimRuntime(stream_budget=10), capture_sizes=(4, 8), piecewise_sizes=(16, 32, 64),
                                 kernel_policy="auto", dump_dir=str(tmp_path))
        batch = PagedBatch(cfg, seed=2)
        with torch.no_grad():
            fn(**batch.step([30, 40, 50]))
            fn(**batch.step([5] * 12))
    art, = artifacts
    lines = [r.getMessage() for r in caplog.records if "start-up:" in r.getMessage()]
    assert len(lines) == 1 and "dynamo_trace" in lines[0] and "kernel_timing" in lines[0], lines
    plan = json.loads(next(tmp_path.rglob("plan.json")).read_text())["startup"]
    assert plan["seconds"]["dynamo_trace"] > 0 and plan["seconds"]["passes"] > 0 and plan["seconds"]["kernel_timing"] > 0
    assert set(plan["captures"]) == {"b4.decode", "p16"} and plan["capture_seconds"] > 0
    assert plan["graph_budget"]["graphs"] <= 10 and plan["graph_budget"]["dropped_piecewise_sizes"] == [32]
    assert cli.main(["inspect", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "start-up: dynamo_trace" in printed and "captures" in printed
    assert f"graphs to capture: {plan['graph_budget']['graphs']}" in printed and "budget: 10" in printed
    assert "piecewise sizes dropped to fit the budget: [32]" in printed


def test_a_phase_timed_inside_another_is_taken_out_of_it():
    phases = __import__("collections").Counter()
    with ledger.recording(phases), ledger.phase("outer"):
        time.sleep(0.05)
        with ledger.phase("inner"):
            time.sleep(0.1)
    assert 0.04 < phases["outer"] < 0.09 and phases["inner"] >= 0.1
    assert ledger.PROCESS["inner"] >= 0.1


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_a_bad_graph_budget_is_refused_naming_the_option(value):
    with pytest.raises(ValueError, match="graph_budget: expected a positive int"):
        CompileConfig(graph_budget=value)


def test_on_npu_the_budget_is_vllm_ascends_1800(monkeypatch):
    """torch_npu answers no stream count (`get_stream_limit` gives a stream's cores): the npu runtime's
    budget is vLLM-Ascend's cap on ACL graphs, said with its source in plan.json."""
    fake_torch_npu.install(monkeypatch)
    cfg = LlamaConfig(num_layers=2, num_blocks=64, block_size=128, dtype=torch.bfloat16)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=256, capture_sizes=(4, 8), piecewise_sizes=(16,), runtime="npu")
    fn = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append))
    with torch.no_grad():
        fn(**PagedBatch(cfg, seed=2).step([30, 40, 50]))
    budget = artifacts[0].describe()["startup"]["graph_budget"]
    assert budget["budget"] == 1800 and "vLLM-Ascend's MAX_CAPTURE_SIZE" in budget["budget_source"]
    assert budget["graphs"] == budget["full_graphs"] + budget["graphs_per_piecewise_size"] and "dropped_piecewise_sizes" not in budget
