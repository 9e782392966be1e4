"""Piecewise graphs (issue 34, `lowering/piecewise.py`): steps no full graph serves run as captured
pieces, with attention, KV-cache writes and ops the device cannot capture run eagerly between them,
equal to eager; a model with an uncapturable op served so, its op never inside a replay; prefill and
chunked-prefill steps above the largest bucket; MLA prefill chunks on npu; failed steps leaving every
cache as before; moved caches captured again; what plan.json and `inspect` say."""
from __future__ import annotations

import json
import logging

import pytest
import torch

import ascend_compile
from ascend_compile import cli
from ascend_compile.backend import backend
from ascend_compile.config import CompileConfig
from ascend_compile.lowering.piecewise import PiecewiseGraph
from ascend_compile.passes.fx_utils import is_op
from ascend_compile.passes.split_pieces import Piece
from ascend_compile.runtime.sim import SimRuntime
from examples import llama
from examples.deepseek import build as build_mla
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu
from tests import test_uncapturable as uncapturable
from tests.test_failed_steps import (InjectedFault, WritesLogits, _assert_as_before, assert_close,  # noqa: F401
                                     assert_names_its_rows, caches, fault_in_layer)

MAX_LEN = 1024


def _compile(model, **options):
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(**{"max_model_len": MAX_LEN, "capture_sizes": (4, 8), **options})
    return ascend_compile.compile(model, backend=backend(config, on_compiled=artifacts.append)), artifacts


def _pieces_hold(art, op) -> bool:
    """Whether any captured piece of `art` holds a call of `op`."""
    return any(is_op(n, op) for g in art.piecewise.values() for p in g.pieces for n in p.gm.graph.nodes)


@pytest.mark.parametrize("runtime", ["sim", "npu"])
def test_an_uncapturable_op_is_run_between_pieces_and_every_step_equals_eager(monkeypatch, caplog, runtime):
    """The model of tests/test_uncapturable.py (a custom op reading device data on the host, in every
    layer): no full graph can be captured, so every step, decode or mixed, is served piecewise; each
    equals eager exactly; the op is split out of the pieces and its body never runs inside a replay
    (on the simulator a replay's tasks run in `SimRuntime._run_tasks`, counted here); no step waits
    for the device (`synchronizes`: the eager ops queue behind the pieces on the stream)."""
    dtype = torch.float32
    if runtime == "npu":
        fake_torch_npu.install(monkeypatch)
        dtype = torch.bfloat16
    in_replay = {"calls": 0, "tasks": 0}
    body = uncapturable.BODY_CALLS
    run_tasks = SimRuntime._run_tasks

    def running(self, tasks, stream):
        before = body["compiled"]
        in_replay["tasks"] += len(tasks)
        try:
            return run_tasks(self, tasks, stream)
        finally:
            in_replay["calls"] += body["compiled"] - before

    monkeypatch.setattr(SimRuntime, "_run_tasks", running)
    monkeypatch.setattr(llama.Attention, "attend", uncapturable._attend)
    cfg = LlamaConfig(num_layers=2, num_blocks=128, block_size=128, dtype=dtype)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = _compile(model, runtime=runtime, max_model_len=512, pa_max_batch=4)
    batch = PagedBatch(cfg, seed=5)
    body.update(compiled=0, eager=0)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="ascend_compile"):
        for step in uncapturable.STEPS + [([300, 200], [150, 100])]:
            lens, qlens = step if isinstance(step, tuple) else (step, None)
            inputs = batch.step(lens, qlens)
            uncapturable._CALLER[0] = "compiled"
            got = fn(**inputs)
            uncapturable._CALLER[0] = "eager"
            assert_close(got, reference(**inputs))  # the padded pieces' matmuls round as the eager ones may not
            for a, b in zip(caches(model), caches(reference), strict=True):
                assert_close(a, b)
    uncapturable._CALLER[0] = "compiled"
    art = artifacts[-1]
    op = torch.ops.uncapturable_test.host_gate
    assert op in art.uncapturable
    assert art.stats["piecewise_steps"] == len(uncapturable.STEPS) + 1 and art.stats["eager_fallbacks"] == 0
    assert art.stats["replays"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "piecewise graphs run it eagerly" in warnings[0]
    assert not _pieces_hold(art, op)
    graph = next(iter(art.piecewise.values()))
    reasons = {n.name: why for n, why in graph.eager.items()}
    assert sum("cannot be captured" in why for why in reasons.values()) == 2  # one per layer
    kinds = {kind for kind, path in art.served if path == "piecewise"}
    assert {"decode", "mixed"} <= kinds
    assert in_replay["calls"] == 0 and in_replay["tasks"] > 0
    assert art.stats["synchronizes"] == 0, art.stats
    # one token count serves decode and mixed steps alike: the pieces hold no lengths
    assert len({k.bucket for k, _ in art.piecewise}) < art.stats["piecewise_steps"]


def _llama(num_layers=2):
    cfg = LlamaConfig(num_layers=num_layers, num_blocks=512, block_size=16)
    return cfg, build(cfg), build(cfg)


@pytest.mark.parametrize("verify", [False, True])
def test_a_512_token_prefill_and_a_chunked_prefill_mix_above_the_largest_bucket_are_served_piecewise(verify, tmp_path):
    """Buckets up to 8 tokens: a 512-token prefill (one sequence), a chunked-prefill mix (a 300-token
    chunk beside decodes), a prefill of four sequences and decode steps in the buckets. The large
    steps run on the pieces of the smallest piecewise size holding each (512, 512, 256, 64), equal to eager
    in outputs and every KV cache; the decode steps replay full graphs; plan.json says which path
    served which kind of step and why, and what runs between the pieces."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", verify=verify, dump_dir=str(tmp_path))
    batch = PagedBatch(cfg, seed=3)
    steps = [([5, 9], None), ([512], [512]), ([700, 30, 45, 3], [300, 1, 1, 1]), ([40, 50, 60, 70], [40, 50, 60, 70]),
             ([31, 41, 51], None), ([100, 7], [33, 2])]
    with torch.no_grad():
        for lens, qlens in steps:
            inputs = batch.step(lens, qlens)
            assert_close(fn(**inputs), reference(**inputs))
            for got, want in zip(caches(model), caches(reference), strict=True):
                assert_close(got, want)
    art = artifacts[-1]
    assert dict(art.served) == {("decode", "full"): 2, ("prefill", "piecewise"): 3, ("mixed", "piecewise"): 1}
    assert art.stats["eager_fallbacks"] == 0 and art.stats["piecewise_captures"] == 3
    assert {str(k) for k, _ in art.piecewise} == {"p512", "p256", "p64"}
    plan = json.loads(open(f"{art.rewritten.graph_dir}/plan.json").read())
    pieces = plan["piecewise"]
    assert pieces["enabled"] and pieces["kernels"] == ["fused_infer_attention"]
    assert pieces["graphs"]["p512"]["pieces"] == cfg.num_layers + 1 and pieces["graphs"]["p512"]["captured"]
    # the cache writes (padding-safe, into caches used in place) stay in the pieces
    assert sorted(set(pieces["eager_nodes"].values())) == [
        "attention kernel: takes the step's lengths", "workspace: the artifact's slot"]
    assert plan["served"]["steps"]["prefill"]["piecewise"] >= 2
    assert any(why.startswith("no graph for 512 tokens") for why in plan["served"]["not_full"])
    if verify:
        assert all(g["verified"]["ok"] for g in pieces["graphs"].values())
    text = cli.render(f"{art.rewritten.graph_dir}/plan.json", plan)
    assert "piecewise graphs: sizes" in text and "steps served, by kind" in text
    assert "run eagerly between pieces: attention kernel" in text


class Tempered(torch.nn.Module):
    """The example model returning three outputs: logits over a host temperature (a 0-d CPU tensor, a
    host scalar frozen into a graph), the logits' row sums, and a value of the first piece that only
    the graph's output reads (its memory must outlive the later pieces' captures)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.model = build(cfg)

    def forward(self, temperature, **inputs):
        early = self.model.embed(inputs["input_ids"]).sum(-1)  # made in the first piece, read by the output only
        logits = self.model(**inputs)
        return logits / temperature, logits.sum(-1), early


@pytest.mark.parametrize("dynamic", [False, True], ids=["default", "dynamic"])
def test_a_host_scalar_changing_between_piecewise_steps_and_three_outputs(dynamic):
    """Steps above the buckets on pieces, with a host scalar that changes between them (a sampling
    temperature; under dynamic=True a plain torch.compile wraps floats so too): each step equals eager
    in every output, the pieces captured again for a new value, never replayed with a stale one."""
    cfg = LlamaConfig(num_layers=2, num_blocks=512, block_size=16)
    model, reference = Tempered(cfg), Tempered(cfg)
    reference.load_state_dict(model.state_dict())
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=(4, 8))
    fn = torch.compile(model, backend=backend(config, on_compiled=artifacts.append), dynamic=dynamic or None)
    batch = PagedBatch(cfg, seed=4)
    with torch.no_grad():
        for i, temperature in enumerate((0.5, 0.5, 2.0, 2.0, 0.7, 0.5)):
            seqs = 2 + i % 2  # the sequence count varies too: the steps are padded
            inputs = batch.step([40 + i + 9 * j for j in range(seqs)], [20 + i] + [15] * (seqs - 1))  # above 8 tokens
            temp = torch.tensor(temperature)
            got, want = fn(temp, **inputs), reference(temp, **inputs)
            for g, w in zip(got, want, strict=True):
                assert_close(g, w)
    assert sum(a.stats["piecewise_steps"] for a in artifacts) >= 4, [a.stats for a in artifacts]


def test_a_piecewise_graph_that_fails_verify_serves_no_step(monkeypatch):
    """`verify` on pieces: a piecewise graph whose first step differs from eager (here its attention
    kernels, run between the pieces with the artifact's workspace, read a query off by one) serves
    neither that step (eager's result is returned) nor any later one; every step equals eager."""
    from ascend_compile.ops import reference as kernels

    def off_by_one(kernel):
        def run(query, *args, **kwargs):
            if any(isinstance(a, torch.Tensor) and a.data_ptr() in slots for a in args):
                query = query + 1.0
            return kernel(query, *args, **kwargs)
        return run

    monkeypatch.setattr(kernels, "fused_infer_attention", off_by_one(kernels.fused_infer_attention))
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", verify=True)
    batch = PagedBatch(cfg, seed=6)
    slots: set[int] = set()
    with torch.no_grad():
        for lens, qlens in [([5, 9], None), ([60, 70], [30, 20]), ([61, 71, 20], [31, 21, 5]), ([90], [40]),
                            ([7, 8, 9], None)]:
            inputs = batch.step(lens, qlens)
            assert_close(fn(**inputs), reference(**inputs))
            slots.update(w.data_ptr() for a in artifacts for w in a.workspaces.values())
    art = artifacts[-1]
    graphs = list(art.piecewise.values())
    assert graphs and all(g.verified is not None and not g.verified["ok"] for g in graphs), [g.describe() for g in graphs]
    assert all("differed from eager" in g.eager_reason for g in graphs)
    assert sum(g.replays for g in graphs) == len(graphs)  # the checked first step of each, never again
    assert art.stats["verify_failures"] == len(graphs) and art.stats["eager_fallbacks"] >= 1


def test_an_8192_token_prefill_on_pieces_saves_nothing_and_waits_for_nothing():
    """A step is its graph, at the largest piecewise size too: an 8,192-token prefill (eight sequences
    of 1,024) runs on the p8192 pieces with no cache row saved, no launch outside the pieces and
    their eager nodes, and no synchronize; equal to eager in outputs and every KV cache."""
    cfg = LlamaConfig(num_layers=2, num_blocks=8 * 1024 // 16, block_size=16)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = _compile(model, runtime="sim", max_model_len=1024)
    batch = PagedBatch(cfg, seed=8)
    with torch.no_grad():
        inputs = batch.step([1024] * 8, [1024] * 8)
        assert_close(fn(**inputs), reference(**inputs))
    for got, want in zip(caches(model), caches(reference), strict=True):
        assert_close(got, want)
    art = artifacts[-1]
    assert {str(k) for k, _ in art.piecewise} == {"p8192"} and art.stats["piecewise_steps"] == 1
    assert art.stats["saved_bytes"] == 0 and art.stats["launches_outside_graph"] == 0, art.stats
    assert art.stats["synchronizes"] == 0, art.stats


def test_the_workspace_slot_is_sized_for_every_piecewise_size_too(monkeypatch):
    """The plan sizes every piecewise key's kernels (FIA v2's MLA form on npu, asked of torch_npu) and
    the one slot is the exact maximum over the full graphs' and the pieces' needs; listing fewer sizes
    gives a smaller slot; [] turns piecewise graphs off, saying so. Sizes whose need the kernel cannot
    answer (FIA v2 takes at most 4096 sequences) get no piecewise graphs, logged."""
    from tests import test_mla_npu

    fake_torch_npu.install(monkeypatch)
    cfg = test_mla_npu.CFG
    slots = {}
    for sizes in ([], [64], None):
        fn, artifacts = _compile(build_mla(cfg), runtime="npu", capture_sizes=(2, 32), piecewise_sizes=sizes)
        with torch.no_grad():
            fn(**PagedBatch(cfg, seed=1, table_width=MAX_LEN // cfg.block_size).step([5, 9]))
        art = artifacts[-1]
        plan = art.rewritten.plan
        slots[str(sizes)] = max(s.nbytes for s in plan.slots.values())
        if sizes == []:
            assert art.rewritten.piecewise is None and art.describe()["piecewise"] == {
                "enabled": False, "reason": "piecewise_sizes is empty"}
            continue
        keys = art.rewritten.piecewise.keys
        assert [k.bucket for k in keys] == ([64] if sizes else [s for s in art.config.piecewise_sizes if s <= 4096])
        assert all(str(k) in plan.needs for k in keys)
        assert slots[str(sizes)] == max(n.nbytes for needs in plan.needs.values() for n in needs)
    assert slots["[]"] < slots["[64]"] < slots["None"]


def test_bad_piecewise_sizes_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="piecewise_sizes: expected a list of positive ints"):
        CompileConfig(piecewise_sizes=(0, 8))
    with pytest.raises(ValueError, match="piecewise_sizes: expected a list of ints"):
        CompileConfig.from_options({"piecewise_sizes": 512})
    assert CompileConfig(capture_sizes=(4, 8)).piecewise_sizes[:3] == (4, 8, 16)
    assert CompileConfig().piecewise_sizes[-1] == 8192


def test_above_the_largest_piecewise_size_the_step_runs_eagerly_saying_why(caplog):
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", piecewise_sizes=[16, 64])
    batch = PagedBatch(cfg, seed=4)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="ascend_compile"):
        for lens, qlens in [([5, 9], None), ([100], [100]), ([50], [50])]:
            inputs = batch.step(lens, qlens)
            assert_close(fn(**inputs), reference(**inputs))
    art = artifacts[-1]
    assert art.served[("prefill", "eager")] == 1 and art.served[("prefill", "piecewise")] == 1
    assert "above the largest piecewise size (64 tokens)" in caplog.text


@pytest.mark.parametrize("save", [False, True], ids=["default", "save_cache_rows"])
@pytest.mark.parametrize("runtime", ["sim", "npu"])
def test_a_piecewise_step_failing_on_a_later_layer_leaves_every_cache_as_before(runtime, save, fault_in_layer,
                                                                                monkeypatch):
    """The attention of layer 1 of 3 raising between pieces, after layers 0 and 1 wrote their KV rows
    and a caller's buffer is about to be written: the buffer is as before, and every cache too under
    `save_cache_rows`, else every row but the step's own slots (named in the error); the same step
    then equals eager. By default the 50-token prefill saved nothing."""
    cfg = LlamaConfig(num_layers=3, num_blocks=512)
    if runtime == "npu":
        fake_torch_npu.install(monkeypatch)
        cfg = LlamaConfig(num_layers=3, num_blocks=128, block_size=128, dtype=torch.bfloat16)
    model, reference = WritesLogits(cfg), WritesLogits(cfg)
    fn, artifacts = _compile(model, runtime=runtime, save_cache_rows=save)
    batch = PagedBatch(cfg, seed=5)

    def step(lens, qlens):
        inputs = batch.step(lens, qlens)
        return {**inputs, "out": torch.zeros(sum(qlens), cfg.vocab_size, dtype=cfg.dtype)}

    with torch.no_grad():
        inputs = step([30, 40], [1, 1])
        assert_close(fn(**inputs), reference(**inputs))
        inputs = step([60, 70], [20, 30])
        before = [t.clone() for t in [*caches(model), inputs["out"]]]
        fault_in_layer(artifacts, model.model.layers[1].attn.key_cache, mark=None)
        with pytest.raises(InjectedFault) as raised:
            fn(**inputs)
        fault_in_layer.disarm()
        _assert_as_before(model, before, inputs, None if save else inputs["slot_mapping"])
        if not save:
            assert_names_its_rows(raised.value, inputs, 2)
        expected = {**inputs, "out": inputs["out"].clone()}
        assert_close(fn(**inputs), reference(**expected))
        assert_close(inputs["out"], expected["out"])
        for got, want in zip(caches(model), caches(reference), strict=True):
            assert_close(got, want)
    art = artifacts[-1]
    # the failing step raised while its pieces were captured on its values (`piecewise_live.py`): served once
    assert art.stats["failed_steps"] == 1 and art.stats["piecewise_steps"] == 1
    assert (art.stats["saved_bytes"] == 0) == (not save)


def test_a_new_kv_cache_captures_the_pieces_again(caplog):
    """The KV caches replaced by new tensors (a re-allocated cache): the pieces, which hold no cache but
    read the caller's weights in place, and the eager nodes, which take the new caches, still equal eager;
    a replaced weight is captured again."""
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=6)
    with torch.no_grad():
        inputs = batch.step([300], [300])
        assert_close(fn(**inputs), reference(**inputs))
        for m in (model, reference):
            m.layers[0].attn.key_cache = m.layers[0].attn.key_cache.clone()
            m.layers[1].down.weight = torch.nn.Parameter(m.layers[1].down.weight * 1.5)
        inputs = batch.step([310], [300])
        assert_close(fn(**inputs), reference(**inputs))
    art = artifacts[-1]
    assert art.stats["piecewise_steps"] >= 1


def test_mla_prefill_chunks_on_npu_are_served_piecewise(monkeypatch, caplog):
    """DeepSeek-style MLA on runtime "npu": FIA v2's MLA form takes 1-16 query tokens per sequence, so
    a 20-token chunk, a 40+30 mix and a 64-token prefill were each run eagerly whole; now each runs
    piecewise: the pieces replayed, the layers' MLA attention run between them as the model's op (the
    target refusing the kernel these lengths), every step equal to eager; steps the kernel takes (a
    mixed step above the buckets of at most 16 query tokens a sequence) run the kernel between the
    pieces, on the artifact's slot."""
    from tests import test_mla_npu

    fake = fake_torch_npu.install(monkeypatch)
    steps = [([40, 600, 7], None), ([25, 3], [20, 1]), ([41, 601, 9, 10], None), ([100, 50], [40, 30]),
             ([300, 64], [64, 64]), ([200, 17, 30, 31], [16, 16, 15, 14])]
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        artifacts = test_mla_npu._run(test_mla_npu.CFG, steps, capture_sizes=(2, 32))
    art = max(artifacts, key=lambda a: a.stats["steps"])
    assert art.stats["piecewise_steps"] >= 3 and art.stats["eager_fallbacks"] == 0
    assert "takes 1-16 query tokens per sequence" in caplog.text and "serving it piecewise" in caplog.text
    slots = {tuple(w.shape) for w in art.workspaces.values()}
    last = [c for c in fake.calls if c.name == test_mla_npu.KERNEL][-test_mla_npu.CFG.num_layers:]
    assert all(c.kwargs["actual_seq_qlen"] == [16, 32, 47, 61] and tuple(c.kwargs["workspace"].shape) in slots
               for c in last)  # the last step's own lengths, unpadded, on the artifact's slot
    refused = [why for g in art.piecewise.values() for why in g.refusals]
    assert refused and all("takes 1-16 query tokens per sequence" in why for why in refused)


def test_the_split_runs_only_the_attention_kernels_eagerly_and_pads_the_slot_mapping_with_minus_one():
    """The split of the example Llama: each attention kernel is an eager node (the workspace node stands
    for the slot); every other node, the cache writes included, is in one piece per layer plus one; after
    a step, the pieces' slot-mapping buffer holds the step's slots then -1 (the cache writes skip those)."""
    cfg, model, _ = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=7)
    with torch.no_grad():
        fn(**batch.step([5, 9]))
        fn(**batch.step([100], [100]))
    art = artifacts[-1]
    graph: PiecewiseGraph = next(iter(art.piecewise.values()))
    pieces = [s for s in graph.segments if isinstance(s, Piece)]
    assert len(pieces) == cfg.num_layers + 1
    eager = {str(n.target) for n in graph.eager}
    assert eager == {"ascend.fused_infer_attention.default", "ascend.workspace.default"}
    in_pieces = [n for p in pieces for n in p.nodes]
    assert not any(str(n.target) in eager for n in in_pieces)
    assert sum(str(n.target) == "ascend.reshape_and_cache" for n in in_pieces) == cfg.num_layers
    (mapping,) = [buffer for p in graph.pieces for node, buffer in p.copied if node.name == "l_slot_mapping_"]
    inputs = batch.step([300], [100])
    with torch.no_grad():
        fn(**inputs)
    assert mapping.shape == (128,) and mapping[:100].tolist() == inputs["slot_mapping"].tolist()
    assert mapping[100:].tolist() == [-1] * 28
    # the pieces pin nothing of the graph pool between steps: each static output is held weakly once its
    # last reader is captured (the pieces after it may reuse its memory, as they replay in that order)
    assert graph.memory() == {"static_inputs_bytes": 3 * 128 * 8, "outputs_bytes": 0}  # ids, positions, slots
    assert art.runtime.memory_stats()["graph"]["allocated_bytes"] == 0
    assert art.memory_report()["piecewise"]


def test_a_differential_run_of_random_steps_across_full_piecewise_and_eager(monkeypatch):
    """Random steps across the buckets, the piecewise sizes and above them, with a new cache now and
    then: every step's logits and every cache equal eager's, whatever served it."""
    import random

    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim", piecewise_sizes=[16, 64, 256], verify=True)
    batch = PagedBatch(cfg, seed=8)
    rng = random.Random(8)
    with torch.no_grad():
        for i in range(14):
            n = rng.choice([1, 2, 3, 5, 8])
            qlens = [rng.choice([1, 1, 3, 20, 90]) for _ in range(n)]
            lens = [q + rng.randint(0, 200) for q in qlens]
            inputs = batch.step(lens, qlens)
            assert_close(fn(**inputs), reference(**inputs))
            for got, want in zip(caches(model), caches(reference), strict=True):
                assert_close(got, want)
            if i == 7:
                for m in (model, reference):
                    m.layers[1].attn.value_cache = m.layers[1].attn.value_cache.clone()
    art = artifacts[-1]
    assert {path for _, path in art.served} >= {"piecewise"}
