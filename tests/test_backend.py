"""The backend end to end: compiled vs eager on the example model, the runner's rules, the update table."""
from __future__ import annotations

import collections
import importlib.metadata
import json
import logging
import random
import threading

import pytest
import torch

import ascend_compile
from ascend_compile import cli
from ascend_compile import backend
from ascend_compile.config import CompileConfig
from ascend_compile.ops import tiling
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu

MAX_LEN = 512
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def compiled_model(model, target=None, **options):
    """`torch.compile` through our backend (on `target`, a target factory, if given), keeping the
    artifacts it builds."""
    artifacts = []
    torch._dynamo.reset()
    extra = {} if target is None else {"target": target}
    return torch.compile(model, backend=backend(CompileConfig(**options), on_compiled=artifacts.append, **extra)), artifacts


def random_step(rng, batch, size, mixed=False, max_len=MAX_LEN):
    lens = [rng.randint(1, max_len) for _ in range(size)]
    qlens = [rng.randint(1, min(4, n)) for n in lens] if mixed else None
    return batch.step(lens, qlens)


@pytest.mark.parametrize("runtime", ["sim", "eager"])
def test_compiled_matches_eager_over_random_steps(runtime):
    cfg = LlamaConfig(num_layers=2, num_blocks=1024)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(1, 2, 4, 8, 16), pa_max_batch=4,
                                   runtime=runtime)
    batch = PagedBatch(cfg, seed=1)
    rng = random.Random(runtime)
    sizes = [3, 4, 5, 7, 8, 9, 16, 2, 13, 21, 6, 1, 12, 16, 3, 30]
    with torch.no_grad():
        for i, size in enumerate(sizes):
            inputs = random_step(rng, batch, size, mixed=(i % 4 == 3))
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    stats = sum((a.stats for a in artifacts), start=__import__("collections").Counter())
    # 21 and 30 tokens exceed the largest bucket: piecewise on the simulator, eagerly on runtime "eager"
    assert stats["piecewise_steps" if runtime == "sim" else "eager_fallbacks"] >= 1
    if runtime == "sim":
        assert stats["replays"] >= 10 and stats["captures"] >= 3
        kernels = {k["kernel"] for a in artifacts for g in a.describe()["graphs"].values() for k in g["kernels"]}
        assert kernels == {tiling.PA, tiling.FIA}


def test_every_graph_replays_with_changing_lengths():
    cfg = LlamaConfig(num_layers=3, num_blocks=1024)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(4, 8), pa_max_batch=4)
    batch = PagedBatch(cfg, seed=2)
    rng = random.Random(0)
    with torch.no_grad():
        first = random_step(rng, batch, 3)  # dynamo's first, static-shape graph
        fn(**first)
        reference(**first)  # keep the two KV caches identical
        for _ in range(8):
            size = rng.choice([3, 4, 6, 8])
            inputs = random_step(rng, batch, size)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    art = artifacts[-1]
    assert {g.name for g in art.graphs.values()} == {"b4.decode", "b8.decode"}
    assert art.stats["captures"] == 2 and art.stats["replays"] == 8


def test_update_table_is_keyed_by_node_and_refreshed_from_inputs():
    cfg = LlamaConfig(num_layers=2, num_blocks=1024)
    fn, artifacts = compiled_model(build(cfg), max_model_len=MAX_LEN, capture_sizes=(4, 8), pa_max_batch=4)
    batch = PagedBatch(cfg)
    rng = random.Random(0)
    with torch.no_grad():
        fn(**random_step(rng, batch, 3))
        fn(**random_step(rng, batch, 6))
        fn(**random_step(rng, batch, 2))
    plan = artifacts[-1].describe()["graphs"]
    fia = plan["b8.decode"]["update_table"]
    assert [e["node"] for e in fia] == ["fused_infer_attention_default", "fused_infer_attention_default_1"]
    assert fia[0]["refresh"] == {
        "actual_seq_lengths": {"input": "l_query_start_loc_", "conversion": "ends"},
        "actual_seq_lengths_kv": {"input": "l_seq_lens_", "conversion": "list"},
    }
    # A decode graph is captured as decode (issue 33): 8 sequences of one query token, each of KV length 1
    # (never 0: the sim's fast-path rule), FIA's S=1 branch, which every update keeps; mixed steps of the
    # bucket have a graph of their own, captured with their padding packed (`passes/padding.py`).
    assert fia[0]["frozen_at_capture"]["actual_seq_lengths"] == list(range(1, 9))
    assert fia[0]["frozen_at_capture"]["actual_seq_lengths_kv"] == [1] * 8
    assert "b8.mixed" in plan and "b4.mixed" in plan
    pa = plan["b4.decode"]["update_table"]
    assert [e["kernel"] for e in pa] == [tiling.PA, tiling.PA] and all(e["event"] for e in pa)
    assert pa[0]["refresh"] == {"context_lens": {"input": "l_seq_lens_", "conversion": "list"}}
    assert min(pa[0]["frozen_at_capture"]["context_lens"]) > 1  # PA is captured long, like vLLM-Ascend's 6144


def test_one_host_conversion_per_input_and_no_workspace_work_at_replay(monkeypatch):
    cfg = LlamaConfig(num_layers=4, num_blocks=1024)
    fn, artifacts = compiled_model(build(cfg), max_model_len=MAX_LEN, capture_sizes=(4, 8))
    batch = PagedBatch(cfg)
    rng = random.Random(0)
    with torch.no_grad():
        fn(**random_step(rng, batch, 3))
        fn(**random_step(rng, batch, 6))
        art = artifacts[-1]
        before = dict(art.stats), art.runtime.memory_stats()

        def no_query(*args, **kwargs):
            raise AssertionError("workspace sized at replay")

        monkeypatch.setattr(tiling, "max_workspace", no_query)
        for _ in range(5):
            fn(**random_step(rng, batch, 7))
    assert art.stats["host_conversions"] - before[0]["host_conversions"] == 5 * 2  # seq_lens and query_start_loc
    assert art.stats["updates"] - before[0]["updates"] == 5 * 4  # one per layer
    assert art.runtime.memory_stats() == before[1]  # nothing allocated at replay


@pytest.mark.parametrize("runtime", ["sim", "npu"])
def test_a_task_whose_host_lists_did_not_change_since_the_last_replay_is_not_issued_again(monkeypatch, runtime):
    """A task update persists in the graph: the same step again issues no update, only the events its
    kernels wait on (else the replay would hang); a step changing only the KV lengths issues every task
    that reads them; each step equals eager."""
    dtype = torch.float32
    if runtime == "npu":
        fake_torch_npu.install(monkeypatch)
        dtype = torch.bfloat16
    cfg = LlamaConfig(num_layers=3, num_blocks=64, block_size=128, dtype=dtype)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(4,), runtime=runtime)
    batch = PagedBatch(cfg, seed=4)
    issued = []
    with torch.no_grad():
        for lens in ([10, 20], [30, 40, 50], [30, 40, 50], [30, 40, 50], [31, 41, 51]):
            inputs = batch.step(lens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL[dtype])
            issued.append(artifacts[-1].stats["updates"])
    art = artifacts[-1]
    # (dynamo's second trace serves from the second step) the first replay issues all three layers,
    # the same lists twice more issue none, changed KV lengths issue all three again
    assert [b - a for a, b in zip(issued[1:], issued[2:])] == [0, 0, 3], issued
    assert art.stats["replays"] == 4, art.stats


def test_length_above_max_model_len_is_a_clear_error():
    cfg = LlamaConfig(num_layers=1, num_blocks=1024)
    fn, _ = compiled_model(build(cfg), max_model_len=64, capture_sizes=(4,))
    batch = PagedBatch(cfg)
    with torch.no_grad():
        fn(**batch.step([10, 20, 30]))
        with pytest.raises(ValueError, match="seq_lens: a sequence of length 65 exceeds max_model_len=64"):
            fn(**batch.step([10, 65, 30]))


def step_after_moving(tensor, replace, num_layers=1, **options):
    """A compiled model and its eager twin stepped at 3 and 6 tokens (the second step is dynamo's
    dynamic graph: buckets 4 and 8 captured), then the tensor `tensor(model)` replaced in both by the
    same fresh values (`replace(model, new)`), then a step of 7 tokens (bucket 8, captured before
    the move) compared; returns the artifact."""
    cfg = LlamaConfig(num_layers=num_layers, num_blocks=1024)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(4, 8), **options)
    batch = PagedBatch(cfg)
    rng = random.Random(0)
    with torch.no_grad():
        for size in (3, 6):
            inputs = random_step(rng, batch, size)
            fn(**inputs)
            reference(**inputs)
        fresh = torch.randn_like(tensor(model))
        replace(model, fresh.clone())
        replace(reference, fresh.clone())
        inputs = random_step(rng, batch, 7)
        torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    return artifacts[-1]


def test_moved_kv_cache_is_recaptured_not_read_stale():
    art = step_after_moving(lambda m: m.layers[0].attn.key_cache,
                            lambda m, new: setattr(m.layers[0].attn, "key_cache", new))
    assert art.stats["recaptures"] == 1


def test_moved_parameter_is_recaptured_not_read_stale():
    """`p.data = t` keeps the Parameter object and moves its memory: the graph must not replay with
    the old address (dynamo's guards pass: same shape, dtype and device)."""
    art = step_after_moving(lambda m: m.layers[0].down.weight,
                            lambda m, new: setattr(m.layers[0].down.weight, "data", new))
    assert art.stats["recaptures"] == 1


def test_a_new_kv_cache_logs_one_short_warning_for_all_the_graphs_it_re_captures(caplog):
    """A new KV cache (as each of transformers' `generate_batch` allocates) moves every cache input of
    every captured graph: one WARNING says how many inputs of which kind, which graph re-captures
    and how many more will; the inputs' names, and the same change found by the next graph, are
    at DEBUG only."""
    cfg = LlamaConfig(num_layers=2, num_blocks=256)
    model, reference = build(cfg), build(cfg)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=(4, 8))
    fn = ascend_compile.compile(model, backend=backend(config, on_compiled=artifacts.append))
    batch, rng = PagedBatch(cfg), random.Random(0)

    def step(size):
        inputs = random_step(rng, batch, size)
        torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)

    with torch.no_grad():
        step(3), step(6)  # b4.decode and b8.decode captured
        for m in (model, reference):
            for layer in m.layers:
                layer.attn.key_cache = torch.zeros_like(layer.attn.key_cache)
                layer.attn.value_cache = torch.zeros_like(layer.attn.value_cache)
        with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
            step(7), step(2)  # b8.decode re-captured, then b4.decode for the same change
    (art,) = artifacts
    assert art.stats["recaptures"] == 2
    records = [r for r in caplog.records if r.name == "ascend_compile"]
    (warning,) = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert warning == ("ascend_compile: 4 KV cache inputs moved since b8.decode was captured: re-capturing it; "
                       "1 more captured graph will re-capture on next use")
    debug = " ".join(r.getMessage() for r in records if r.levelno == logging.DEBUG)
    assert "l_self_modules_layers_modules_1_modules_attn_buffers_value_cache_" in debug
    assert "re-capturing b4.decode for the same change" in debug


def test_frozen_parameters_checks_kv_caches_and_buffers_but_not_parameters(tmp_path):
    art = step_after_moving(lambda m: m.layers[1].attn.value_cache,
                            lambda m, new: setattr(m.layers[1].attn, "value_cache", new),
                            num_layers=2, frozen_parameters=True, dump_dir=str(tmp_path))
    assert art.stats["recaptures"] == 1
    checked = {art.names[i] for i in art.checked}
    parameters = {s.name for s in art.signature.inputs if s.parameter}
    assert len(parameters) == 2 * 6 + 3  # per layer: two norms, qkv, o, gate_up, down; embed, norm, lm_head
    assert not checked & parameters
    assert {n for n in checked if "cache" in n} == {f"l_self_modules_layers_modules_{i}_modules_attn_buffers_{kv}_cache_"
                                                  for i in range(2) for kv in ("key", "value")}
    plan = json.loads(open(f"{art.rewritten.graph_dir}/plan.json").read())
    shown = {i["name"]: i["address_checked"] for i in plan["inputs"] if "address_checked" in i}
    assert shown == {name: name not in parameters for name in shown} and set(shown) >= checked | parameters


def test_steps_of_alternating_shapes_in_one_graph_match_eager():
    """Each step shape stages through its own copy plan (kept per shape): shapes coming back after
    others must find their own padding, not the last step's."""
    cfg = LlamaConfig(num_layers=1, num_blocks=1024)
    model = build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(8,))
    batch = PagedBatch(cfg)
    steps = [([300, 20, 7], None), ([5], None), ([40, 41, 42, 43, 44, 45], None), ([300, 20, 7], None),
             ([9, 100], [3, 2]), ([5], None), ([60, 61, 62], [1, 2, 3])]
    with torch.no_grad():
        for lens, qlens in steps:
            inputs = batch.step(lens, qlens)
            expected = model(**{k: v.clone() for k, v in inputs.items()})
            torch.testing.assert_close(fn(**inputs), expected, atol=2e-5, rtol=1e-4)
    assert sum(a.stats["replays"] for a in artifacts) == len(steps)


def test_block_table_wider_than_max_model_len_is_a_clear_error():
    cfg = LlamaConfig(num_layers=1, num_blocks=1024)
    fn, _ = compiled_model(build(cfg), max_model_len=64, capture_sizes=(4,))
    with torch.no_grad():
        fn(**PagedBatch(cfg).step([10, 20, 30]))
        wide = PagedBatch(cfg, table_width=64 // cfg.block_size + 3).step([10, 20, 30])
        with pytest.raises(ValueError, match=r"l_block_table_: shape \(3, 7\) does not fit the graph's padded shape "
                                             r"\(\d+, 4\) \(block_table is wider than max_model_len / block_size\)"):
            fn(**wide)


def test_clone_outputs_false_returns_views_the_next_step_overwrites():
    cfg = LlamaConfig(num_layers=1, num_blocks=1024)
    fn, _ = compiled_model(build(cfg), max_model_len=MAX_LEN, capture_sizes=(8,), clone_outputs=False)
    batch = PagedBatch(cfg)
    rng = random.Random(0)
    with torch.no_grad():
        fn(**random_step(rng, batch, 3))
        first = fn(**random_step(rng, batch, 6))
        kept = first.clone()
        fn(**random_step(rng, batch, 5))
    assert not torch.equal(first, kept)


class DisjointBatch(PagedBatch):
    """Steps that never share a cache block, so concurrent steps cannot see each other's cache
    writes: the eager reference, which runs unlocked, then agrees with any interleaving."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        self.free = list(range(cfg.num_blocks))
        self.rng.shuffle(self.free)

    def blocks_for(self, context_lens):
        need = [max(1, -(-n // self.cfg.block_size)) for n in context_lens]
        width = max(need)
        tables = [[self.free.pop() for _ in range(n)] for n in need]
        return [t + [0] * (width - len(t)) for t in tables]


def test_concurrent_callers_do_not_interleave_replays():
    cfg = LlamaConfig(num_layers=1, num_blocks=2048)
    model, reference = build(cfg), build(cfg)
    fn, _ = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(8,))
    batch = DisjointBatch(cfg)
    rng = random.Random(0)
    steps = [random_step(rng, batch, n) for n in (3, 6, 5, 7, 6, 8, 4, 5)]
    errors = []

    def worker(items):
        try:
            with torch.no_grad():
                for inputs in items:
                    torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with torch.no_grad():
        for inputs in steps[:2]:
            fn(**inputs)
            reference(**inputs)
    threads = [threading.Thread(target=worker, args=(steps[2:] * 2,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_memory_report_lists_pool_and_workspace_per_graph():
    cfg = LlamaConfig(num_layers=2, num_blocks=1024)
    fn, artifacts = compiled_model(build(cfg), max_model_len=MAX_LEN, capture_sizes=(4, 8))
    batch = PagedBatch(cfg)
    rng = random.Random(0)
    with torch.no_grad():
        fn(**random_step(rng, batch, 3))
        fn(**random_step(rng, batch, 6))
    report = artifacts[-1].memory_report()
    assert report["workspace_bytes"]["attn_workspace"] == artifacts[-1].rewritten.plan.slots["attn_workspace"].nbytes
    assert set(report["graphs"]) == {"b8.decode"}
    assert report["graphs"]["b8.decode"]["outputs_bytes"] == 8 * cfg.vocab_size * 4
    # the graph's memory stays reserved in the pool; its outputs do not pin it (other captures may reuse it)
    assert report["pool"]["graph"]["reserved_bytes"] > 0 and report["pool"]["graph"]["allocated_bytes"] == 0


def test_capture_all_captures_every_decode_bucket(tmp_path, capsys):
    cfg = LlamaConfig(num_layers=1, num_blocks=1024)
    fn, artifacts = compiled_model(build(cfg), max_model_len=MAX_LEN, capture_sizes=(2, 4, 8), pa_max_batch=2,
                                   capture_all=True, dump_dir=str(tmp_path))
    batch = PagedBatch(cfg)
    rng = random.Random(0)
    with torch.no_grad():
        fn(**random_step(rng, batch, 3))
        fn(**random_step(rng, batch, 5))
    art = artifacts[-1]
    assert {g.name for g in art.graphs.values() if g.graph is not None} == {"b2.decode", "b4.decode", "b8.decode"}
    plan = json.loads(open(f"{art.rewritten.graph_dir}/plan.json").read())
    assert "update_table" in plan["graphs"]["b4.decode"]
    assert cli.main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "update table of b4.decode" in out and "context_lens<-l_seq_lens_.list" in out


def test_entry_point_registers_the_backend():
    names = {ep.name for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert "ascend_graph" in names
    assert "ascend_graph" in torch._dynamo.list_backends()


def test_torch_compile_options_reach_the_backend():
    cfg = LlamaConfig(num_layers=1)
    torch._dynamo.reset()
    fn = torch.compile(build(cfg), backend="ascend_graph", options={"max_model_len": 64, "not_an_option": 1})
    with pytest.raises(Exception, match=r"unknown option\(s\) \['not_an_option'\]"):
        with torch.no_grad():
            fn(**PagedBatch(cfg).step([3, 4]))


def test_wrong_metadata_dtype_fails_at_trace_time():
    cfg = LlamaConfig(num_layers=1)
    torch._dynamo.reset()
    fn = torch.compile(build(cfg), backend="ascend_graph", options={"max_model_len": 64})
    inputs = PagedBatch(cfg).step([3, 4])
    inputs["seq_lens"] = inputs["seq_lens"].long()
    with pytest.raises(Exception, match="seq_lens: expected dtype torch.int32"):
        with torch.no_grad():
            fn(**inputs)


def test_inference_mode_steps_match_eager():
    cfg = LlamaConfig(num_layers=2, num_blocks=1024)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(4, 8))
    batch = PagedBatch(cfg, seed=3)
    rng = random.Random(3)
    with torch.inference_mode():
        for size in (3, 6, 8, 5, 2):
            inputs = random_step(rng, batch, size)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    assert artifacts[-1].stats["replays"] >= 3


class WritesIntoCallerBuffer(torch.nn.Module):
    """The example model, also writing its logits into a buffer the caller passes (vLLM-style)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, logits_out, **inputs):
        logits = self.model(**inputs)
        logits_out.copy_(logits)
        return logits


@pytest.mark.parametrize("runtime", ["sim", "eager"])
def test_inputs_the_graph_writes_into_are_copied_back(runtime):
    cfg = LlamaConfig(num_layers=1, num_blocks=1024)
    fn, artifacts = compiled_model(WritesIntoCallerBuffer(build(cfg)), max_model_len=MAX_LEN, capture_sizes=(8,),
                                   runtime=runtime)
    reference = build(cfg)
    batch = PagedBatch(cfg)
    rng = random.Random(0)
    with torch.no_grad():
        for size in (3, 6, 5):
            inputs = random_step(rng, batch, size)
            buffer = torch.zeros(size, cfg.vocab_size)
            fn(buffer, **inputs)
            torch.testing.assert_close(buffer, reference(**inputs), atol=2e-5, rtol=1e-4)
    mutated = {s.name: s.role.value for s in artifacts[-1].signature.inputs if s.mutated}
    assert mutated.pop("l_logits_out_") == "batch"
    assert sorted(mutated.values()) == ["kv_cache", "kv_cache"]  # written in place, never copied


def test_all_buckets_share_one_graph_pool():
    """Captured largest first, with outputs that do not pin their memory, every bucket's graph fits in
    what the largest one needs alone; with outputs pinned (a runtime whose weak aliases own their
    memory) the same captures need far more."""
    from ascend_compile.runtime.sim import SimRuntime
    from ascend_compile.targets import Target

    class PinningSim(SimRuntime):
        def weak_alias(self, tensor):
            return tensor

    cfg = LlamaConfig(num_layers=2, num_blocks=1024)
    sizes = (1, 2, 4, 8, 16, 32, 64)
    reserved = {}
    for runtime, capture_sizes in ((SimRuntime, sizes[-1:]), (SimRuntime, sizes), (PinningSim, sizes)):
        fn, artifacts = compiled_model(build(cfg), max_model_len=MAX_LEN, capture_sizes=capture_sizes, capture_all=True,
                                       target=lambda device, config, rt=runtime: Target(rt(segment_bytes=1 << 14)))
        batch = PagedBatch(cfg)
        with torch.no_grad():
            fn(**random_step(random.Random(0), batch, 3))
            fn(**random_step(random.Random(1), batch, 5))
        art = artifacts[-1]
        assert sum(g.graph is not None for g in art.graphs.values()) == len(capture_sizes)
        reserved[(runtime.__name__, len(capture_sizes))] = art.memory_report()["pool"]["graph"]["reserved_bytes"]
    largest = reserved[("SimRuntime", 1)]
    assert reserved[("SimRuntime", len(sizes))] <= 1.25 * largest, reserved
    assert reserved[("PinningSim", len(sizes))] > 1.25 * largest, reserved  # 1.31x here


def test_decode_and_mixed_steps_of_one_bucket_each_replay_their_own_graph():
    # A bucket whose decode graph takes PA (decode-only) has a mixed graph of its own; which graph a step
    # takes is remembered per bucket and step kind (`RewrittenGraphs.key_for`): decode steps, a mixed one,
    # decode again, each on its own graph and equal to eager.
    cfg = LlamaConfig(num_layers=2, num_blocks=256)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(8,), pa_max_batch=8, runtime="sim")
    batch = PagedBatch(cfg, seed=5)
    steps = [([40, 9, 77], None), ([41, 10, 78, 5, 60], None), ([42, 11, 79, 6, 61], None),
             ([43, 12, 80, 7, 62], [1, 2, 1, 1, 2]), ([45, 14, 81, 8, 64, 3], None),
             ([46, 15, 82, 9, 65, 4], [2, 1, 1, 1, 1, 1])]
    with torch.no_grad():
        for lens, qlens in steps:
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs))
    # dynamo traced the first step static, then the sizes of the next three, then those of the last two:
    # the two later artifacts each serve decode steps, then a mixed one
    replays = collections.Counter()
    for art in artifacts[1:]:
        assert art.served[("mixed", "full")] == 1 and art.served[("mixed", "eager")] == 0, art.served
        replays.update({entry.name: entry.replays for entry in art.graphs.values()})
    assert replays == {"b8.decode": 3, "b8.mixed": 2}, replays


def test_a_steps_seconds_split_into_its_phases_and_the_host():
    # `art.seconds`: each replay's copy-in, launch and synchronize, and the rest of the step as host time;
    # the runner takes the replay phases out of the step's time through their running sum (`PhaseSeconds.device`).
    cfg = LlamaConfig(num_layers=2, num_blocks=256)
    model, reference = build(cfg), build(cfg)
    torch._dynamo.reset()
    artifacts = []
    fn = torch.compile(model, dynamic=True, backend=backend(CompileConfig(max_model_len=MAX_LEN, capture_sizes=(8,),
                                                                          runtime="sim"), on_compiled=artifacts.append))
    batch = PagedBatch(cfg, seed=6)
    with torch.no_grad():
        for lens in ([40, 9, 77], [41, 10, 78, 5], [5] * 12):  # two replays of b8, one piecewise step
            inputs = batch.step(lens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs))
    stats = sum((art.stats for art in artifacts), collections.Counter())
    assert stats["replays"] == 2 and stats["piecewise_steps"] == 1
    for art in artifacts:
        seconds = art.seconds
        assert seconds.device == pytest.approx(seconds["copy_in"] + seconds["launch_and_updates"] +
                                               seconds["synchronize"], rel=1e-9, abs=0)
    total = sum((art.seconds for art in artifacts), collections.Counter())
    assert min(total["copy_in"], total["launch_and_updates"], total["synchronize"], total["host"]) > 0
