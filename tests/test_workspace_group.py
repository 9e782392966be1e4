"""Workspace groups (`lowering/workspace_group.py`, issue 49): a target and a drafter compiled side by
side with one `workspace_group` share one attention-workspace slot and one simulated device, the
drafter captured after the target, the graph pool handing the drafter's capture blocks the target's
freed, replays alternating, every step equal to eager; the slot never freed nor moved under a graph
that reads it; and each model's plan under its own name (`model_name`), its own update table in
`ascend-compile inspect`."""
from __future__ import annotations

import json
import threading

import pytest
import torch

import ascend_compile
from ascend_compile import cli
from ascend_compile.backend import backend
from ascend_compile.config import CompileConfig
from ascend_compile.runtime.sim import SimRuntime
from ascend_compile.targets import Target
from examples.llama import LlamaConfig, PagedBatch, build

TARGET_CFG = LlamaConfig(num_layers=3, num_blocks=256)
DRAFT_CFG = LlamaConfig(num_layers=1, num_blocks=256)
#: The drafter's larger bucket needs more workspace than the target's: joining grows the slot. A kernel
#: short of workspace raises (it would write past its slot on the device).
OPTIONS = dict(max_model_len=1024, kernel_policy="pa", piecewise_sizes=[], runtime="sim", sim_overflow="raise")


def compiled(cfg, sizes, **options):
    """A model (and its eager twin, same weights, a cache of its own) compiled with `options`; its artifacts."""
    artifacts: list = []
    config = CompileConfig(capture_sizes=sizes, **OPTIONS, **options)
    fn = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append))
    return fn, build(cfg), artifacts


def prefill(cfg, batch):
    """A step of two whole prompts: more tokens than any bucket, served eagerly (it compiles the model)."""
    return batch.step([20, 30], [20, 30])


def step_error(fn, reference, inputs):
    return (fn(**inputs) - reference(**inputs)).abs().max().item()


def graph_pool_blocks(art):
    """(segment, offset) of every graph-pool block the captured graphs of `art` allocated."""
    return {(ref.segment.index, ref.offset) for entry in art.graphs.values() if entry.graph is not None
            for task in entry.graph.recording.tasks for _, ref in getattr(task, "fresh", ())
            if ref.segment.pool.name == "graph"}


def workspace_addresses(art):
    """The address of the workspace every captured kernel of `art` was given (its task's uint8 operand)."""
    return {art.runtime.address_of(a) for entry in art.graphs.values() for e in entry.table.entries.values()
            for a in e.args if isinstance(a, torch.Tensor) and a.dtype == torch.uint8}


def test_target_and_drafter_share_one_slot_and_pool_replaying_alternately_equal_to_eager(request):
    torch._dynamo.reset()
    group = f"spec-{request.node.name}"
    target, target_ref, target_arts = compiled(TARGET_CFG, (4,), workspace_group=group, model_name="target")
    draft, draft_ref, draft_arts = compiled(DRAFT_CFG, (4, 8), workspace_group=group, model_name="drafter")
    t_batch, d_batch = PagedBatch(TARGET_CFG, seed=1), PagedBatch(DRAFT_CFG, seed=2)
    with torch.no_grad():
        assert step_error(target, target_ref, prefill(TARGET_CFG, t_batch)) < 1e-5
        assert step_error(target, target_ref, t_batch.step([40, 50, 60])) < 1e-5  # the target's graph, captured
        (t_art,) = target_arts
        first_slot = t_art.group.slot.numel()
        runtime = t_art.runtime
        _, old_segment, old_offset = runtime.address_of(t_art.group.slot)
        assert t_art.stats["captures"] == 1 and first_slot == t_art.rewritten.plan.slots["attn_workspace"].nbytes
        assert step_error(draft, draft_ref, prefill(DRAFT_CFG, d_batch)) < 1e-5  # the drafter joins: the slot grows
        (d_art,) = draft_arts
        group_ = t_art.group
        assert d_art.group is group_ and d_art.runtime is t_art.runtime and d_art.lock is t_art.lock
        assert group_.regrown == [{"from_bytes": first_slot, "to_bytes": group_.slot.numel(), "graphs_dropped": 1}]
        # What the user allocates after the compile (as vLLM its KV cache): small blocks filling every hole the
        # old slot and the drafter's own slot left; no replay may write them.
        kept = [runtime.empty((512,), torch.uint8).fill_(i % 251) for i in range(3 * group_.slot.numel() // 512)]
        # the old slot's memory was given back (no copy of the artifact's attributes kept it): the user got it
        assert any(runtime.address_of(t)[1] == old_segment and 0 <= runtime.address_of(t)[2] - old_offset < first_slot
                   for t in kept)
        for i in range(6):  # alternating: the target recaptured, then the drafter captured after it
            lens = [300 + 50 * i, 520, 700 + i]  # past 256 keys PA splits a sequence: its workspace is used
            assert step_error(target, target_ref, t_batch.step(lens)) < 1e-5, i
            assert step_error(draft, draft_ref, d_batch.step([270 + i, 400, 300, 290, 500, 280, 260][: 5 + i % 3])) < 1e-5, i
    assert all(bool((t == i % 251).all()) for i, t in enumerate(kept))
    assert t_art.stats["captures"] == 2 and d_art.stats["captures"] == 1  # the target's first graph dropped
    assert t_art.stats["replays"] == 7 and d_art.stats["replays"] == 6  # every decode step, from a graph
    # the drafter's captures reused graph-pool blocks the target's capture had freed
    assert graph_pool_blocks(t_art) & graph_pool_blocks(d_art)
    slot = runtime.address_of(group_.slot)
    assert workspace_addresses(t_art) == workspace_addresses(d_art) == {slot}
    assert slot[0] == "general"  # outside the graph pool the captures reuse
    plan = t_art.describe()["workspace"]["group"]
    needs = {m["model"]: m["needs_bytes"] for m in plan["members"]}
    assert needs["drafter"] > needs["target"] == first_slot
    assert plan["slot_bytes"] == needs["drafter"] and plan["saved_bytes"] == needs["target"]
    assert plan["separate_slots_bytes"] == needs["target"] + needs["drafter"]


def drafter_step(fn, reference, inputs):
    with torch.no_grad():  # grad mode is the thread's own
        return step_error(fn, reference, inputs)


def test_a_member_step_waits_for_another_member_step_in_another_thread(request):
    torch._dynamo.reset()
    group = f"spec-{request.node.name}"
    target, target_ref, target_arts = compiled(TARGET_CFG, (4,), workspace_group=group)
    draft, draft_ref, draft_arts = compiled(DRAFT_CFG, (4,), workspace_group=group)
    t_batch, d_batch = PagedBatch(TARGET_CFG, seed=1), PagedBatch(DRAFT_CFG, seed=2)
    errors: list = []
    with torch.no_grad():
        target(**t_batch.step([5, 6]))
        draft(**d_batch.step([5, 6]))
        inputs = d_batch.step([7, 8, 9])
        with target_arts[0].lock:  # the target's step in progress
            thread = threading.Thread(target=lambda: errors.append(drafter_step(draft, draft_ref, inputs)))
            thread.start()
            thread.join(0.5)
            assert thread.is_alive()  # the drafter's step waits
        thread.join(30)
    assert not thread.is_alive() and errors and errors[0] < 1e-5


def test_members_must_share_a_runtime(request):
    torch._dynamo.reset()
    group = f"spec-{request.node.name}"
    target, _, _ = compiled(TARGET_CFG, (4,), workspace_group=group)
    eager = ascend_compile.compile(build(DRAFT_CFG), backend=backend(CompileConfig(
        capture_sizes=(4,), **{**OPTIONS, "runtime": "eager"}, workspace_group=group)))
    with torch.no_grad():
        target(**PagedBatch(TARGET_CFG).step([5]))
        with pytest.raises(Exception, match="a group's members run on one device and runtime"):
            eager(**PagedBatch(DRAFT_CFG).step([5]))


def test_members_share_the_runtimes_graph_budget(request):
    torch._dynamo.reset()
    group, sim = f"spec-{request.node.name}", SimRuntime(stream_budget=40)
    budgets = {}
    for name, cfg in (("target", TARGET_CFG), ("drafter", DRAFT_CFG)):  # default piecewise sizes: 4 .. 8192
        artifacts: list = []
        config = CompileConfig(capture_sizes=(4,), max_model_len=1024, workspace_group=group, model_name=name)
        fn = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append,
                                                                target=lambda device, config: Target(sim)))
        with torch.no_grad():
            fn(**PagedBatch(cfg).step([5]))
        budgets[name] = artifacts[0].startup.budget
    target, drafter = budgets["target"], budgets["drafter"]
    assert target.budget == 40 and target.dropped  # the target alone fills most of the device's streams
    assert drafter.budget == 40 - target.graphs and target.graphs + drafter.graphs <= 40


def test_each_model_has_its_own_dump_and_update_table_in_inspect(tmp_path, capsys, request):
    torch._dynamo.reset()
    group = f"spec-{request.node.name}"
    target, _, _ = compiled(TARGET_CFG, (4,), model_name="target", dump_dir=str(tmp_path), workspace_group=group)
    draft, _, _ = compiled(DRAFT_CFG, (4, 8), model_name="drafter", dump_dir=str(tmp_path), workspace_group=group)
    with torch.no_grad():
        target(**PagedBatch(TARGET_CFG).step([5, 6]))
        draft(**PagedBatch(DRAFT_CFG).step([5, 6]))
        target(**PagedBatch(TARGET_CFG).step([5, 6]))  # captured again on the grown slot
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "target"]
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    by_model = {plan["model"]: plan for plan in plans.values()}
    assert {key.split("/")[0] for key in plans} == set(by_model) == {"target", "drafter"}
    tables = {m: p["graphs"]["b4.decode"]["update_table"] for m, p in by_model.items()}
    assert len(tables["target"]) == TARGET_CFG.num_layers and len(tables["drafter"]) == DRAFT_CFG.num_layers
    assert cli.main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    needs = {m: p["workspace"]["group"]["members"] for m, p in by_model.items()}
    target_need, drafter_need = (next(n["needs_bytes"] for n in needs["drafter"] if n["model"] == m)
                                 for m in ("target", "drafter"))
    for model, cfg in (("target", TARGET_CFG), ("drafter", DRAFT_CFG)):
        section = next(s for s in text.split("\n\n== ") if f"model: {model}" in s.splitlines()[0])
        table = section.split(f"update table of {model} b4.decode\n", 1)[1]
        assert sum(line.startswith("paged_attention") for line in table.splitlines()) == cfg.num_layers
        assert (f"workspace group {group}: one slot of {drafter_need} B for target {target_need} B, drafter "
                f"{drafter_need} B; a slot each would hold {target_need + drafter_need} B (saved {target_need} B)"
                in section)


@pytest.mark.parametrize("options, error", [
    (dict(workspace_group="spec", share_workspace=False), "share_workspace=False"),
    (dict(model_name="../target"), "model_name: expected a name"),
    (dict(workspace_group=".."), "workspace_group: expected a name"),
])
def test_group_and_model_names_are_checked(options, error):
    with pytest.raises(ValueError, match=error):
        CompileConfig(max_model_len=64, **options)
