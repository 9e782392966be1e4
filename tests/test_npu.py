"""The Ascend path (runtime "npu", torch_npu bindings, workspace probing, torchair interop), run in
CI against the fake torch_npu of `tests/fake_torch_npu.py`, which plays the device on the simulator."""
from __future__ import annotations

import ast
import inspect
import logging
import random

import pytest
import torch

from ascend_compile.config import CompileConfig
from ascend_compile.errors import ReplayError, StreamRace
from ascend_compile.ops.npu import kernels as npu_ops
from ascend_compile.ops import tiling
from ascend_compile.ops.npu.workspace_queries import NpuWorkspaceQuery, fia_probe_lengths
from ascend_compile.passes.fx_utils import is_op
from ascend_compile.passes.probe import ProbedWorkspaceNeed
from ascend_compile.passes.torchair import npugraph_ex_pre_pass
from ascend_compile.passes.workspaces import KernelSite
from ascend_compile.runtime import create_runtime, resolve_runtime
from ascend_compile.runtime.npu import NpuRuntime
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu
from tests.helpers import make_problem
from tests.test_backend import compiled_model

MAX_LEN = 512
#: The KV-cache block size of the compiled runs: paged FIA on torch_npu takes multiples of 128.
NPU_BLOCK = 128
#: The models' dtype: PA and FIA take float16 and bfloat16, never float32 (`ops/npu/rules.py`,
#: ATTENTION_DTYPES); the end-to-end test runs float16 too.
DTYPE = torch.bfloat16
#: Compiled vs eager in each dtype: the kernels split and round their partial results in it.
TOLERANCES = {torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float16: dict(atol=4e-3, rtol=4e-3)}
TOL = TOLERANCES[DTYPE]
KERNELS = ("_npu_paged_attention", "npu_fused_infer_attention_score.out")
QUERIES = ("_npu_paged_attention_get_workspace", "_npu_fused_infer_attention_score_get_max_workspace")
CPU = torch.device("cpu")


@pytest.fixture
def fake_npu(monkeypatch):
    """The fake torch_npu, installed as `torch_npu` / `torch.npu` for one test."""
    return fake_torch_npu.install(monkeypatch)


def lengths(rng, n, max_len=MAX_LEN):
    return [rng.randint(1, max_len) for _ in range(n)]


def run_model(steps, cfg, **options):
    """The example model compiled on runtime "npu" and eager over `steps` (lengths, or (lengths,
    query lengths)); returns [(compiled, eager)] (an exception in place of a failed step's output)
    and the artifacts."""
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, runtime="npu", **options)
    batch = PagedBatch(cfg, seed=3)
    results = []
    with torch.no_grad():
        for step in steps:
            lens, qlens = step if isinstance(step, tuple) else (step, None)
            inputs = batch.step(lens, qlens)
            try:
                out = fn(**inputs)
            except Exception as e:  # noqa: BLE001 - the tests inspect it
                out = e
            results.append((out, reference(**inputs)))
    return results, artifacts


def assert_all_close(results, dtype=DTYPE):
    for compiled, eager in results:
        assert isinstance(compiled, torch.Tensor), compiled
        assert compiled.dtype == dtype
        torch.testing.assert_close(compiled, eager, **TOLERANCES[dtype])


# ----------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_on_npu_matches_eager_with_pa_and_fia(fake_npu, dtype):
    rng = random.Random(0)
    steps = [lengths(rng, n) for n in (3, 2, 6, 3, 8)] + [([40, 300, 17], [3, 1, 2])]  # the last: mixed (FIA)
    results, artifacts = run_model(steps, LlamaConfig(dtype=dtype, num_layers=2, num_blocks=128, block_size=NPU_BLOCK),
                                   max_model_len=MAX_LEN, capture_sizes=(4, 8), pa_max_batch=4)
    assert_all_close(results, dtype)
    art = artifacts[-1]
    assert isinstance(art.runtime, NpuRuntime) and art.describe()["runtime"]["torch_npu"] == "2.14.0"
    kernels = {k["kernel"] for g in art.describe()["graphs"].values() for k in g["kernels"]}
    assert kernels == {tiling.PA, tiling.FIA}
    assert art.stats["replays"] >= 3 and art.stats["captures"] >= 2
    # The kernels ran as torch_npu's ops, and the buckets of one artifact captured into one pool.
    assert {k for k, _ in fake_npu.executed} == {tiling.PA, tiling.FIA} and fake_npu.count(*KERNELS) > 0
    assert len(set(fake_npu.pools[-art.stats["captures"]:])) == 1


def test_auto_kernel_policy_times_the_torch_npu_kernels(fake_npu):
    results, artifacts = run_model([[30, 40, 50, 60]], LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=128, block_size=NPU_BLOCK),
                                   max_model_len=MAX_LEN, capture_sizes=(4,), kernel_policy="auto")
    assert_all_close(results)
    (choice,) = artifacts[-1].describe()["graphs"]["b4.decode"]["kernels"]
    assert choice["reason"].startswith(("PA: measured", "FIA: measured")) and set(choice["times_ms"]) == {
        tiling.PA, tiling.FIA,
    }
    # Both were timed through torch_npu's kernels (at auto_seq_len, 512), before any capture.
    trace = [what for what, _ in fake_npu.trace]
    assert set(trace[:trace.index("graph_task_group_begin")]) >= set(KERNELS)
    assert {(k, kv) for k, kv in fake_npu.executed if kv == (512,) * 4} == {(tiling.PA, (512,) * 4),
                                                                            (tiling.FIA, (512,) * 4)}


# ----------------------------------------------------------------------------- the update protocol


@pytest.mark.parametrize("policy, kernel", [("pa", "_npu_paged_attention"),
                                            ("fia", "npu_fused_infer_attention_score.out")])
def test_replay_is_launched_before_the_updates_which_record_the_events(fake_npu, policy, kernel):
    # On the simulator's streams: each update is ordered before its kernel only by the event.
    rng = random.Random(1)
    steps = [lengths(rng, n) for n in (3, 4, 2)]
    results, artifacts = run_model(steps, LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK), max_model_len=MAX_LEN,
                                   capture_sizes=(4,), kernel_policy=policy)
    assert_all_close(results)
    rt, trace = artifacts[-1].runtime, fake_npu.trace
    # Capture of each kernel: wait and reset of its event, then its task group, on the capture stream.
    first = max(i for i, (what, _) in enumerate(trace) if what == "graph_task_group_end") - 4
    assert [what for what, _ in trace[first:first + 5]] == [
        "ExternalEvent.wait", "ExternalEvent.reset", "graph_task_group_begin", kernel, "graph_task_group_end",
    ]
    assert all(stream is rt.capture_stream for _, stream in trace[first:first + 5])
    # A step: the replay first, then per layer the update and the record of its event, then sync.
    last = max(i for i, (what, _) in enumerate(trace) if what == "replay")
    assert [what for what, _ in trace[last:]] == ["replay"] + [
        "graph_task_update_begin", kernel, "graph_task_update_end", "ExternalEvent.record",
    ] * 2 + ["synchronize"]
    assert all(stream is rt.update_stream for _, stream in trace[last + 1:-1])
    assert trace[last][1] is not rt.update_stream


def test_skipped_update_hits_the_missing_event_error(fake_npu):
    from tests.test_design_cases import SkipUpdates, with_target

    results, _ = run_model([[10, 20, 30]], LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=128, block_size=NPU_BLOCK), max_model_len=MAX_LEN,
                           capture_sizes=(4,), kernel_policy="pa", target=with_target(updates=SkipUpdates()))
    error = results[0][0]
    assert isinstance(error, ReplayError) and "never recorded" in str(error)


def _two_unsynchronized_steps(fake_npu, monkeypatch, order_steps):
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=128, block_size=NPU_BLOCK)
    fn, artifacts = compiled_model(build(cfg), runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4,),
                                   kernel_policy="pa")
    batch = PagedBatch(cfg)
    with torch.no_grad():
        fn(**batch.step([5, 6, 7]))
        fn(**batch.step([18, 19, 40, 41]))  # every size now dynamic: one graph, bucket 4, captured
        rt = artifacts[-1].runtime
        monkeypatch.setattr(rt, "synchronize", lambda: None)  # a runner that does not sync each step
        if not order_steps:
            monkeypatch.setattr(rt, "order_after_previous_step", lambda: None)
        fake_npu.executed.clear()
        fn(**batch.step([20, 21, 22]))
        fn(**batch.step([30, 31]))
        torch.npu.synchronize()
    return fake_npu.executed


def test_steps_are_ordered_on_the_device_without_a_host_sync(fake_npu, monkeypatch):
    # The second step's updates wait for the first replay: each replay runs with its own lengths.
    executed = _two_unsynchronized_steps(fake_npu, monkeypatch, order_steps=True)
    assert executed == [(tiling.PA, (20, 21, 22, 1)), (tiling.PA, (30, 31, 1, 1))]  # padding: KV length 1


def test_unordered_steps_race_on_the_device(fake_npu, monkeypatch):
    # Without the ordering, nothing orders step 2's update after replay 1's kernel on the device: it
    # may rewrite the task before replay 1 reads it (and its record be consumed by replay 1's reset).
    with pytest.raises(StreamRace, match=r"_npu_paged_attention.*task update of graph\d+ group 0"):
        _two_unsynchronized_steps(fake_npu, monkeypatch, order_steps=False)


def test_replaying_on_the_update_stream_is_refused(fake_npu):
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=128, block_size=NPU_BLOCK)
    fn, artifacts = compiled_model(build(cfg), runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4,))
    with torch.no_grad():
        fn(**PagedBatch(cfg).step([5, 6, 7]))
    graph = next(iter(artifacts[-1].graphs.values())).graph
    with torch.npu.stream(artifacts[-1].runtime.update_stream), pytest.raises(ReplayError, match="would hang"):
        graph.replay()


# ----------------------------------------------------------------------------- workspace probing

CASE1_CFG = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=512, block_size=128)
CASE1_STEPS = ([100, 200, 300], [8000, 7000, 8192], [3900, 3000, 2000])
#: Case 1 is about the full graphs' plan: piecewise graphs (which would serve the steps the check sends
#: away, on FIA) are off, so that the slot is the full graphs' exact maximum and refused steps run eagerly.
CASE1_OPTIONS = dict(max_model_len=8192, capture_sizes=(4,), kernel_policy="pa", piecewise_sizes=[])


def test_pa_is_asked_once_per_graph_and_each_step_needing_more_runs_eagerly(fake_npu):
    # PA is asked once, at its capture length (min(6144, max_model_len)), as vLLM-Ascend asks it when
    # capturing. Its need peaks at 3841 (16 splits) and falls above 4096, so the step at 3900 needs more
    # than the slot: its own lengths, asked before the replay, send it to eager, right, never overrun.
    results, artifacts = run_model(CASE1_STEPS, CASE1_CFG, sim_overflow="raise", **CASE1_OPTIONS)
    assert_all_close(results)
    plan = artifacts[-1].rewritten.plan
    slot = plan.slots["attn_workspace"]
    shape = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=128)
    # dynamo keeps the first step's 3 tokens static: bucket 3, every sequence at 6144; the slot is the
    # mixed graph's FIA need, still less than the step at 3900 needs
    pa = tiling.workspace_nbytes(tiling.PA, shape, [6144] * 3)
    assert [(n["nbytes"], n["argmax_len"]) for n in plan.to_json()["needs"]["b3.decode"]] == [(pa, 6144)] * 2
    assert pa <= slot.nbytes < tiling.workspace_nbytes(tiling.PA, shape, [3900, 3000, 2000])
    stats = artifacts[-1].stats
    assert stats["eager_fallbacks"] == 1 and stats["replays"] >= 1  # the step at 3900, and no other


def test_a_mixed_batch_needing_more_than_every_uniform_one_is_caught_before_the_kernel(fake_npu):
    # The slot covers every uniform batch of bucket 4 (probed at every length of PA's peak), but three
    # long sequences with one of 3841 are tiled short: more than any uniform batch. Asked with the step's
    # lengths, that step runs eagerly; without the check, it overruns the slot on the device.
    shape = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=128)
    steps = ([100, 200], [8000, 7990, 8100, 6000], [7937, 7937, 7937, 3841], [3841] * 4)
    probe = dict(workspace_probe_lens=[3841, 8192], sim_overflow="raise", **CASE1_OPTIONS)
    results, artifacts = run_model(steps, CASE1_CFG, **probe)
    assert_all_close(results)
    slot = artifacts[-1].rewritten.plan.slots["attn_workspace"]
    assert slot.nbytes == tiling.max_uniform_workspace(tiling.PA, shape, 4, 8192).nbytes
    assert tiling.workspace_nbytes(tiling.PA, shape, [7937, 7937, 7937, 3841]) > slot.nbytes
    assert artifacts[-1].stats["eager_fallbacks"] == 1 and artifacts[-1].stats["replays"] >= 1
    unchecked, _ = run_model(steps, CASE1_CFG, pa_workspace_check=False, **probe)
    assert isinstance(unchecked[2][0], ReplayError) and "workspace too small" in str(unchecked[2][0])


def test_replays_ask_pa_with_each_steps_lengths_and_fia_never(fake_npu):
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4,))
    batch = PagedBatch(cfg)
    rng = random.Random(2)
    with torch.no_grad():
        for n in (3, 4):  # both dynamo graphs are compiled, probed and captured
            inputs = batch.step(lengths(rng, n))
            fn(**inputs)
            reference(**inputs)  # keep the two KV caches identical
        asked = [fake_npu.count(q) for q in QUERIES]
        assert all(asked)
        for n in (2, 4, 3):
            inputs = batch.step(lengths(rng, n))
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
    # one PA question per replay (the two layers share a shape), none of FIA
    assert [fake_npu.count(q) for q in QUERIES] == [asked[0] + 3, asked[1]]
    assert artifacts[-1].stats["replays"] == 4


def test_configured_probe_lengths_are_the_ones_asked(fake_npu):
    # Probing only 1024, 2048 and 8192 misses PA's peak: the plan says so (arg-max 2048), and, with the
    # per-step check off, a step at the peak overruns the workspace on the device.
    results, artifacts = run_model(CASE1_STEPS, CASE1_CFG, workspace_probe_lens=[8192, 1024, 2048],
                                   pa_workspace_check=False, **CASE1_OPTIONS)
    slot = artifacts[-1].rewritten.plan.slots["attn_workspace"]
    assert slot.argmax_len == 2048
    assert isinstance(results[1][0], torch.Tensor) and isinstance(results[2][0], ReplayError)
    assert "workspace too small" in str(results[2][0])


class FormulaQueries:
    """Workspace queries answered by the reference tiling, as the device answers them: PA for the
    lengths given, FIA's maximum for any lengths the block table holds."""

    def __init__(self) -> None:
        self.asked = []

    def paged_attention(self, shape, context_lens, max_blocks):
        self.asked.append((tiling.PA, len(context_lens), max_blocks))
        return tiling.workspace_nbytes(tiling.PA, shape, context_lens)

    def fused_infer_attention_max(self, shape, tokens, max_blocks, features):
        self.asked.append((tiling.FIA, tokens, max_blocks))
        return tiling.max_workspace(tiling.FIA, shape, tokens, max_blocks * shape.block_size).nbytes


def test_probing_without_a_device_finds_the_formula_maximum():
    shape = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    device = FormulaQueries()
    need_fn = ProbedWorkspaceNeed(device)
    fia = need_fn(KernelSite("n", tiling.FIA, shape), 8, 5000, None)
    assert fia.nbytes == tiling.max_uniform_workspace(tiling.FIA, shape, 8, 5000).nbytes
    pa = need_fn(KernelSite("n", tiling.PA, shape), 8, 5000, None)  # at its capture length, min(6144, 5000)
    assert (pa.nbytes, pa.argmax_len) == (tiling.workspace_nbytes(tiling.PA, shape, [5000] * 8), 5000)
    # Once each: PA at its capture length, FIA's answer covering every length (recorded as max_model_len).
    assert need_fn.queries == {tiling.PA: 1, tiling.FIA: 1}
    assert need_fn(KernelSite("n", tiling.FIA, shape), 8, 5000, None).argmax_len == 5000
    assert {b for *_, b in device.asked} == {313}
    device.asked.clear()
    need_fn(KernelSite("other_layer", tiling.PA, shape), 8, 5000, None)
    need_fn(KernelSite("other_layer", tiling.FIA, shape), 8, 5000, 1000)
    assert not device.asked  # answers are cached: layers of one shape cost one probe set; FIA ignores a pin
    exact = tiling.max_uniform_workspace(tiling.PA, shape, 8, 5000)
    scanned = ProbedWorkspaceNeed(device, [1, exact.argmax_len, 5000])(KernelSite("n", tiling.PA, shape), 8, 5000, None)
    assert (scanned.nbytes, scanned.argmax_len) == (exact.nbytes, exact.argmax_len)
    pinned = ProbedWorkspaceNeed(device, [100, 3000])(KernelSite("n", tiling.PA, shape), 2, 5000, 1000)
    assert (pinned.argmax_len, pinned.exact_argmax_len) == (1000, 3000) and pinned.nbytes < pinned.exact_nbytes
    with pytest.raises(ValueError, match="workspace_probe_lens: lengths \\[6000\\] exceed max_model_len=5000"):
        ProbedWorkspaceNeed(device, [6000])(KernelSite("n", tiling.PA, shape), 2, 5000, None)
    with pytest.raises(ValueError, match="workspace_probe_lens: expected lengths of at most max_model_len"):
        CompileConfig(max_model_len=100, workspace_probe_lens=[200])


# ----------------------------------------------------------------------------- runtime selection


def test_auto_picks_npu_when_torch_npu_reports_a_device(fake_npu, monkeypatch):
    assert resolve_runtime("auto", CPU) == "npu"
    runtime = create_runtime("auto", CPU)
    assert isinstance(runtime, NpuRuntime) and runtime.describe() == {
        "name": "npu", "device": "cpu", "graphs": True, "task_updates": True, "torch_npu": "2.14.0",
    }
    monkeypatch.setattr(torch.npu, "is_available", lambda: False)
    assert resolve_runtime("auto", CPU) == "sim"
    with pytest.raises(ValueError, match="runtime: 'npu' runs graphs whose tensors are on an NPU"):
        NpuRuntime(torch.device("meta"))


def test_without_torch_npu_auto_is_the_simulator_and_npu_says_what_is_missing():
    assert resolve_runtime("auto", CPU) == "sim"
    with pytest.raises(ImportError, match="runtime: 'npu' needs torch_npu"):
        create_runtime("npu", CPU)


# ----------------------------------------------------------------------------- signatures


def _fits(type_, value) -> bool:
    """Whether a Python value is what the dispatcher accepts for a schema type."""
    kind = type_.kind()
    if kind == "OptionalType":
        return value is None or _fits(type_.getElementType(), value)
    if kind == "ListType":
        return isinstance(value, list) and all(_fits(type_.getElementType(), v) for v in value)
    python = {"TensorType": torch.Tensor, "IntType": int, "SymIntType": int, "FloatType": float,
              "StringType": str, "BoolType": bool}[kind]
    return isinstance(value, python) and (kind == "BoolType" or not isinstance(value, bool))


def check_call(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> None:
    """That a call binds to `schema` by the dispatcher's rules, with keywords in schema order."""
    names = [a.name for a in schema.arguments]
    positional = [a for a in schema.arguments if not a.kwarg_only]
    assert len(args) <= len(positional), f"{schema.name}: {len(args)} positional arguments"
    by_name = {a.name: v for a, v in zip(positional, args)}
    for name in kwargs:
        assert name in names and name not in by_name, f"{schema.name}: keyword {name!r}"
    order = [names.index(n) for n in kwargs]
    assert order == sorted(order), f"{schema.name}: keywords {list(kwargs)} out of schema order"
    by_name.update(kwargs)
    for a in schema.arguments:
        if a.name in by_name:
            assert _fits(a.type, by_name[a.name]), f"{schema.name}: {a.name} is not a {a.type}"
        else:
            assert a.has_default_value(), f"{schema.name}: required {a.name!r} missing"


def test_calls_match_the_torch_npu_2_14_schemas(fake_npu):
    schemas = fake_torch_npu.schemas()
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    for kernel in (tiling.PA, tiling.FIA):
        query_lens = [1, 1, 1] if kernel == tiling.PA else [1, 4, 2]
        prob = make_problem([5, 3000, 40], query_lens=query_lens, block_size=NPU_BLOCK, dtype=DTYPE)
        host = (prob.seq_lens,) if kernel == tiling.PA else (prob.query_start_loc[1:], prob.seq_lens)
        shape = tiling.AttentionShape.of(prob.query, prob.key_cache)
        queries, width = NpuWorkspaceQuery(kernels, prob.query.dtype), prob.block_table.shape[1]
        if kernel == tiling.PA:  # for these lengths; FIA: the most any lengths the table holds can need
            need = queries.paged_attention(shape, prob.seq_lens, width)
            assert need == tiling.workspace_nbytes(kernel, shape, prob.seq_lens) > 0
        else:
            need = queries.fused_infer_attention_max(shape, prob.query.shape[0], width)
            assert need == tiling.max_workspace(kernel, shape, 7, width * NPU_BLOCK).nbytes
            assert need >= tiling.workspace_nbytes(kernel, shape, prob.seq_lens, prob.query_lens) > 0
        out = torch.empty_like(prob.query)
        workspace = torch.empty(need, dtype=torch.uint8)
        kernels.call(kernel, prob.query, prob.key_cache, prob.value_cache, prob.block_table, *host, prob.scale,
                     workspace, out)
        torch.testing.assert_close(out.float(), prob.dense(), **TOL)
    assert {c.name for c in fake_npu.calls} == set(KERNELS + QUERIES)
    for call in fake_npu.calls:
        check_call(schemas[call.name], call.args, call.kwargs)
    # The fake's ops are these very schemas, and FIA's query takes the default overload's arguments.
    assert str(torch.ops.atb._npu_paged_attention.default._schema) == "atb::" + str(schemas["_npu_paged_attention"])
    fia_out = torch.ops.npu.npu_fused_infer_attention_score.out._schema
    assert str(fia_out) == "npu::" + str(schemas["npu_fused_infer_attention_score.out"])
    default = schemas["npu_fused_infer_attention_score"].arguments
    assert [(a.name, str(a.type)) for a in schemas["_npu_fused_infer_attention_score_get_max_workspace"].arguments] \
        == [(a.name, str(a.type)) for a in default]


def test_check_call_rejects_what_the_device_rejects():
    schema = fake_torch_npu.schemas()["_npu_paged_attention"]
    t, lens = torch.zeros(1), torch.zeros(1, dtype=torch.int32)
    good = (t, t, t, 2, 4, 0.5, t, lens, t)
    check_call(schema, good, {"workspace": t})
    for args, kwargs in ((good + (t,), {}), (good, {"workspace_": t}), (good[:8], {}),
                         (good[:3] + (2.0,) + good[4:], {})):
        with pytest.raises(AssertionError):
            check_call(schema, args, kwargs)
    fia = fake_torch_npu.schemas()["npu_fused_infer_attention_score.out"]
    with pytest.raises(AssertionError, match="out of schema order"):
        check_call(fia, (t, t, t), {"num_heads": 4, "block_table": t, "out": [t, t]})


def test_fake_graph_api_has_the_real_python_signatures(fake_npu):
    for line in fake_torch_npu.read_fixture()["python torch.npu"]:
        tree = ast.parse(f"def {line.replace('.', '_DOT_')}: pass").body[0]
        name = tree.name.replace("_DOT_", ".")
        expected = [(a.arg, ast.literal_eval(d) if d is not None else inspect.Parameter.empty)
                    for a, d in zip(tree.args.args, [None] * (len(tree.args.args) - len(tree.args.defaults))
                                    + tree.args.defaults)]
        if tree.args.kwarg is not None:
            expected.append((tree.args.kwarg.arg, inspect.Parameter.empty))
        obj = torch.npu
        for part in name.split("."):
            obj = getattr(obj, part)
        got = [(p.name, p.default) for p in inspect.signature(obj).parameters.values()]
        assert got == expected, name


# ----------------------------------------------------------------------------- torchair interop


class CallableValue:
    """torchair's config value holding a callable (`configs/compiler_config.py`)."""

    def __init__(self, value) -> None:
        self.value = value


class NpugraphExConfig:
    """The part of npugraph_ex's CompilerConfig its pass hook uses."""

    def __init__(self, pre_pass) -> None:
        self.post_grad_custom_pre_pass = CallableValue(pre_pass)


def fake_npugraph_ex(config, graphs):
    """A dynamo backend calling the hook the way npugraph_ex's `_optimize_fx` does, then checking
    what npugraph_ex's ACL-graph updater needs (`acl_graph.py: get_update_ruler`): PA's argument 7
    is a graph input, so each replay refreshes it from the step's input."""

    def backend(gm, example_inputs):
        config.post_grad_custom_pre_pass.value(gm, example_inputs, config)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node in gm.graph.nodes:
            if node.target is torch.ops.atb._npu_paged_attention.default:
                assert node.args[7] in placeholders
        graphs.append(gm)
        return gm.forward

    return backend


def test_our_passes_run_inside_npugraph_ex_through_its_pre_pass_hook(fake_npu):
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=1024)
    model, reference = build(cfg), build(cfg)
    config = CompileConfig(max_model_len=MAX_LEN, kernel_policy="pa")
    graphs = []
    torch._dynamo.reset()
    fn = torch.compile(model, backend=fake_npugraph_ex(NpugraphExConfig(npugraph_ex_pre_pass(config)), graphs),
                       dynamic=False)
    batch = PagedBatch(cfg, seed=4)
    rng = random.Random(4)
    with torch.no_grad():
        for _ in range(3):  # one sequence at 256 keeps the block table 16 wide: one graph
            inputs = batch.step([256] + lengths(rng, 3, 256))
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
    assert len(graphs) == 1
    gm = graphs[0]
    nodes = list(gm.graph.nodes)
    pa = [n for n in nodes if n.target is torch.ops.atb._npu_paged_attention.default]
    workspace = [n for n in nodes if is_op(n, torch.ops.ascend.workspace)]
    assert len(pa) == 2 and len(workspace) == 1 and all(n.kwargs["workspace"] is workspace[0] for n in pa)
    shape = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    assert workspace[0].args[0] == tiling.max_workspace(tiling.PA, shape, 4, MAX_LEN).nbytes > 0
    assert not any(is_op(n, torch.ops.ascend.attention) or "ascend_host_of" in n.meta for n in nodes)
    assert fake_npu.count(*QUERIES) > 0  # sized by torch_npu's own workspace queries


def test_npugraph_ex_pass_refuses_fia_whose_lengths_it_cannot_refresh(fake_npu):
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=1024)
    pre_pass = npugraph_ex_pre_pass(CompileConfig(max_model_len=MAX_LEN, kernel_policy="fia"))
    torch._dynamo.reset()
    fn = torch.compile(build(cfg), backend=fake_npugraph_ex(NpugraphExConfig(pre_pass), []), dynamic=False)
    with pytest.raises(Exception, match="npugraph_ex refreshes FIA's lengths only from SymInt graph inputs"):
        with torch.no_grad():
            fn(**PagedBatch(cfg).step([5, 6]))


# ----------------------------------------------------------------------------- what the device requires (issue 15)


def test_seq_lens_may_be_host_lengths_while_the_query_is_on_the_device():
    # The torchair path passes seq_lens to PA as its host context_lens, so the unified op must take
    # seq_lens on the CPU with everything else on the device ("meta" stands in for the NPU here).
    meta = torch.device("meta")
    query = torch.empty(3, 4, 16, device=meta)
    cache = torch.empty(8, NPU_BLOCK, 2, 16, device=meta)
    block_table = torch.empty(3, 2, dtype=torch.int32, device=meta)
    start_loc = torch.empty(4, dtype=torch.int32, device=meta)
    seq_lens = torch.tensor([5, 6, 7], dtype=torch.int32)
    out = torch.ops.ascend.attention(query, cache, cache, block_table, seq_lens, start_loc, 0.25)
    assert out.device == meta and out.shape == query.shape


def test_workspace_probes_are_caches_of_a_few_blocks_the_device_accepts(fake_npu):
    # PA's docs constrain block ids only: its probe is one block every row names. FIA's docs want as many
    # blocks as the sequences' lengths take (the fake checks it): its probe packs the graph's tokens into
    # as few sequences as a row holds, and sends no empty one (the kernel counts the lists' entries, L4275).
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    shape = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=NPU_BLOCK)
    queries = NpuWorkspaceQuery(kernels, DTYPE)
    assert queries.paged_attention(shape, [512, 300, 129, 1], 4) == tiling.workspace_nbytes(
        tiling.PA, shape, [512, 300, 129, 1])
    assert queries.fused_infer_attention_max(shape, 300, 2) == tiling.max_workspace(tiling.FIA, shape, 300, 256).nbytes
    pa_call, fia_call, decode_call = fake_npu.calls[-3:]
    assert pa_call.args[1].shape[0] == 1 and pa_call.args[6].shape == (4, 4)
    assert fia_call.args[1].shape[0] == 3 and fia_call.kwargs["block_table"].shape == (2, 2)
    assert fia_call.kwargs["actual_seq_lengths_kv"] == [256, 44] and fia_call.kwargs["actual_seq_lengths"] == [256, 300]
    # and in the one-query-token form (a decode step's): 300 sequences of one token, one key in all, one block
    assert decode_call.args[1].shape[0] == 1 and decode_call.kwargs["block_table"].shape == (300, 2)
    assert decode_call.kwargs["actual_seq_lengths"] == list(range(1, 301))
    assert decode_call.kwargs["actual_seq_lengths_kv"] == [1] + [0] * 299
    assert fia_probe_lengths(5, 2) == ([2, 2, 1], [2, 2, 1]) and fia_probe_lengths(4, 2) == ([2, 2], [2, 2])


def test_workspace_bytes_are_the_answers_bytes_not_its_element_count(fake_npu):
    # FIA's query answers in the query's dtype: a bfloat16 answer of n elements is 2n bytes.
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    shape = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=NPU_BLOCK)
    need = NpuWorkspaceQuery(kernels, DTYPE).fused_infer_attention_max(shape, 3, 24)
    exact = tiling.max_workspace(tiling.FIA, shape, 3, 24 * NPU_BLOCK).nbytes
    assert 0 < exact <= need < exact + 2


def test_capture_and_padding_never_give_the_kernels_zero_lengths(fake_npu):
    # Captured on zero lengths, a kernel takes its fast path and records another task than its updates
    # issue (refused); padding sequences of KV 0 under q=1 break FIA's q <= kv. Both are gone.
    results, artifacts = run_model([[40, 300, 17], ([40, 300, 17], [3, 1, 2])], LlamaConfig(dtype=DTYPE,
        num_layers=1, num_blocks=128, block_size=NPU_BLOCK), max_model_len=MAX_LEN, capture_sizes=(8,),
        kernel_policy="pa")
    assert_all_close(results)
    tables = [e for art in artifacts for g in art.describe()["graphs"].values() for e in g.get("update_table", ())]
    frozen = {e["kernel"]: e["frozen_at_capture"] for e in tables}
    # PA at vLLM-Ascend's 6144, within what the captured block table holds; FIA's padding sequences
    # with as many KV as query tokens (the last one takes the rest of the tokens).
    assert min(frozen[tiling.PA]["context_lens"]) > 1
    ends = frozen[tiling.FIA]["actual_seq_lengths"]
    assert frozen[tiling.FIA]["actual_seq_lengths_kv"] == [b - a for a, b in zip([0] + ends, ends)]
    assert all(min(kv) >= 1 for kernel, kv in fake_npu.executed if kernel == tiling.PA)
    # FIA's calls are padded to their block table's rows with empty sequences (0 query tokens, KV 0:
    # `npu_ops.table_batch`): never all zero, and every sequence with query tokens has at least as many keys
    fia = [c.kwargs for c in fake_npu.calls if c.name == "npu_fused_infer_attention_score.out"]
    for kw in fia:
        ends, kv = kw["actual_seq_lengths"], kw["actual_seq_lengths_kv"]
        assert max(kv) >= 1 and all(n >= b - a for a, b, n in zip([0] + ends, ends, kv)), kw


def test_fia_decode_graphs_are_captured_as_decode_and_mixed_steps_get_their_own_graph(fake_npu):
    # FIA's branch is chosen by the query lengths a task is issued with (`_op_plugin_docs.py` L8056): the
    # decode graph is captured with 8 sequences of one token, as vLLM-Ascend captures its decode graphs, and
    # a mixed step replays the bucket's mixed graph; the fake refuses an update between branches.
    results, artifacts = run_model([[40, 300, 17], ([40, 300, 17], [3, 1, 2]), [41, 301, 18, 5]],
                                   LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=128, block_size=NPU_BLOCK),
                                   max_model_len=MAX_LEN, capture_sizes=(8,), kernel_policy="fia")
    assert_all_close(results)
    # the captured graphs of every artifact (dynamo traces the first step's sizes static, then recompiles)
    graphs = {k: g for a in artifacts for k, g in a.describe()["graphs"].items() if "update_table" in g}
    (decode,) = graphs["b8.decode"]["update_table"][:1]
    assert decode["frozen_at_capture"]["actual_seq_lengths"] == list(range(1, 9))
    assert decode["frozen_at_capture"]["actual_seq_lengths_kv"] == [1] * 8
    (mixed,) = graphs["b8.mixed"]["update_table"][:1]
    assert mixed["frozen_at_capture"]["actual_seq_lengths"][0] > 1  # its padding packed: FIA's prompt branch
    assert sum(a.stats["replays"] for a in artifacts) == 3 and sum(a.stats["eager_fallbacks"] for a in artifacts) == 0


def test_context_lens_tensors_live_until_the_device_has_read_them(fake_npu):
    # The NPU runtime keeps each context_lens tensor alive until the device has run its task. ATB clones
    # CPU inputs when the call is issued (op-plugin AtbCommon.cpp, ParamSetter::Input), and so does the
    # fake, so this is belt and braces, no longer a device rule the fake enforces.
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK)
    results, artifacts = run_model([[10, 20, 30], [40, 50, 60, 70]], cfg, max_model_len=MAX_LEN,
                                   capture_sizes=(4,), kernel_policy="pa")
    assert_all_close(results)
    rt = artifacts[-1].runtime
    graph = next(iter(artifacts[-1].graphs.values())).graph
    assert len(graph.host_tensors) == 2 and not rt.kernels.host_tensors  # the graph's; the step's freed at sync


def test_a_piecewise_steps_host_tensors_are_held_until_the_stream_passes_its_end(fake_npu):
    # A piecewise step does not synchronize (its eager kernels queue behind the pieces on the stream), so
    # the host tensors its eager kernels were given (PA's context_lens; FIA's lists, here, are copied when
    # called) are held with an event recorded at the step's end, and dropped at a later step's end once
    # the device has passed that event, never waited for.
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK)
    # decode steps, then above the bucket (dynamo traces the sizes dynamic at the second)
    steps = [[10, 20, 30], [11, 21, 31, 41, 51], [12, 22, 32, 42, 52, 62], [13, 23, 33, 43, 53, 63, 73]]
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4,))
    batch = PagedBatch(cfg, seed=3)
    held = []
    with torch.no_grad():
        for lens in steps:
            inputs = batch.step(lens)
            assert_all_close([(fn(**inputs), reference(**inputs))])
            rt = artifacts[-1].runtime
            held.append([event for event, _ in rt._held])
            assert not rt.kernels.host_tensors
    stats = [a.stats for a in artifacts]
    assert sum(s["piecewise_steps"] for s in stats) == 3 and sum(s["eager_fallbacks"] for s in stats) == 0, stats
    assert stats[-1]["piecewise_steps"] == 3 and stats[-1]["synchronizes"] == 0, stats  # no host wait in them
    # each piecewise step's own event; the earlier step's dropped once passed (the next pieces ran past it)
    assert [len(h) for h in held[1:]] == [1, 1, 1] and len({id(h[0]) for h in held[1:]}) == 3


def test_kernels_are_set_up_eagerly_before_the_first_capture(fake_npu):
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=128, block_size=NPU_BLOCK)
    results, _ = run_model([[10, 20, 30]], cfg, max_model_len=MAX_LEN, capture_sizes=(4,), kernel_policy="pa")
    assert_all_close(results)
    trace = [what for what, _ in fake_npu.trace]
    assert trace.index("_npu_paged_attention") < trace.index("graph_task_group_begin")


def test_fia_block_size_is_checked_before_torch_npu_is_asked(fake_npu):
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    shape = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match=r"block_size: torch_npu's paged FIA .* got 16"):
        NpuWorkspaceQuery(kernels, DTYPE).fused_infer_attention_max(shape, 2, 4)
    assert fake_npu.count(*QUERIES) == 0
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=128)  # block_size 16: the mixed graph's FIA is refused at compile
    results, _ = run_model([[10, 20, 30]], cfg, max_model_len=MAX_LEN, capture_sizes=(4,), kernel_policy="pa")
    assert "block_size: torch_npu's paged FIA" in str(results[0][0])


# ----------------------------------------------------------------------------- ops without a device kernel


@torch.library.custom_op("npu_test::cache_write_with_host_reads", mutates_args=("key_cache", "value_cache"))
def cache_write_with_host_reads(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """A cache write with the host logic of `ascend.reshape_and_cache`'s Python body: the slots'
    minimum read on the host, a boolean-mask index (a data-dependent shape), their maximum read."""
    if slot_mapping.numel() and int(slot_mapping.min()) < -1:
        raise ValueError("slot_mapping: expected slots >= 0 or -1")
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if slots.numel() and int(slots.max()) >= key_cache.shape[0] * key_cache.shape[1]:
        raise ValueError("slot_mapping: a slot past the cache")
    blocks, offsets = slots // key_cache.shape[1], slots % key_cache.shape[1]
    key_cache[blocks, offsets] = key[valid]
    value_cache[blocks, offsets] = value[valid]


@cache_write_with_host_reads.register_fake
def _(key, value, key_cache, value_cache, slot_mapping) -> None:
    return None


def test_an_unbound_cache_write_with_host_reads_is_served_eagerly_on_npu(monkeypatch, caplog):
    # Not a torch_npu op, so no kernel of the device: its body is recorded op by op, and its first host
    # read fails the capture, as it would on an Ascend device. The graph serves its steps eagerly (issue
    # 33, item 1), one WARNING naming the op; before, every step raised trying the capture again.
    fake_torch_npu.install(monkeypatch, device_kernels=fake_torch_npu.DEVICE_KERNELS)
    from examples import llama

    def attend(self, q, k, v, block_table, seq_lens, query_start_loc, slot_mapping):
        torch.ops.npu_test.cache_write_with_host_reads(k, v, self.key_cache, self.value_cache, slot_mapping)
        return torch.ops.ascend.attention(q, self.key_cache, self.value_cache, block_table, seq_lens,
                                          query_start_loc, self.cfg.head_dim**-0.5)

    monkeypatch.setattr(llama.Attention, "attend", attend)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        results, artifacts = run_model([[10, 20, 30], [40, 50, 60, 70], [5, 6, 7]],
                                       LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=128, block_size=NPU_BLOCK),
                                       max_model_len=MAX_LEN, capture_sizes=(4,), kernel_policy="pa")
    assert_all_close(results)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(artifacts) and all(
        "npu_test.cache_write_with_host_reads.default" in w and "aten.item.default inside" in w for w in warnings)
    assert sum(a.stats["replays"] + a.stats["captures"] for a in artifacts) == 0


def test_the_bound_cache_write_is_captured_on_a_fake_with_only_torch_npus_kernels(fake_npu):
    # Before the binding (issue 22, item 1) this capture failed on the strict fake: the op's Python
    # body read device data on the host. Bound to npu_scatter_pa_kv_cache, it is one device kernel.
    results, artifacts = run_model([[10, 20, 30], [40, 50], [60, 70, 80, 90]],
                                   LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=128, block_size=NPU_BLOCK),
                                   max_model_len=MAX_LEN, capture_sizes=(4,), kernel_policy="pa")
    assert_all_close(results)
    assert sum(a.stats["replays"] for a in artifacts) == 3
    assert fake_npu.count("npu_scatter_pa_kv_cache") >= 3


def test_fia_accepts_padding_sequences_of_kv_length_0(fake_npu):
    # vLLM-Ascend updates padded decode requests with KV length 0 (model_runner_v1.py); torch_npu 2.14's
    # FIA docs ask only for non-negative KV lengths of at most KV_S (_op_plugin_docs.py L8211, L8275).
    prob = make_problem([40, 1, 1], block_size=NPU_BLOCK, dtype=DTYPE)
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    out, expected = torch.full_like(prob.query, float("nan")), torch.empty_like(prob.query)
    args = (prob.query, prob.key_cache, prob.value_cache, prob.block_table, [1, 2, 3], [40, 0, 0], prob.scale)
    kernels.fused_infer_attention(*args, torch.zeros(1 << 20, dtype=torch.uint8), out)
    torch.ops.ascend.fused_infer_attention(*args, torch.zeros(1 << 20, dtype=torch.uint8), expected)
    torch.testing.assert_close(out, expected, **TOL)
    assert not out[1:].any()  # a sequence of KV length 0 yields zeros
