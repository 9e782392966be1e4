"""MLA on runtime "npu" (`ops/npu/mla.py`): FIA v2's MLA form and the cache write against the fake
torch_npu (`tests/fake_torch_npu_mla.py`), the DeepSeek-style example compiled and replayed from captured
graphs across buckets, and each documented constraint refused at compile time, naming the layer."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from ascend_compile.ops.npu import kernels as npu_ops
from ascend_compile.ops import tiling
from ascend_compile.ops.npu import rules as npu_rules, workspace_queries as npu_workspace
from ascend_compile.ops.npu.workspace_queries import NpuWorkspaceQuery
from examples.deepseek import DeepSeekConfig, build
from examples.llama import PagedBatch
from tests import fake_torch_npu, fake_torch_npu_sources
from tests.mla_helpers import make_mla_problem
from tests.test_backend import compiled_model
from tests.test_npu import check_call

CPU = torch.device("cpu")
#: bfloat16 (FIA v2's MLA form takes half precision): compiled and eager round alike only up to this.
TOL = dict(atol=3e-2, rtol=3e-2)
KERNEL = "npu_fused_infer_attention_score_v2.out"
QUERY = "_npu_fused_infer_attention_score_v2_get_max_workspace"
#: The MLA shape FIA v2 takes (d 512, rope 64), tiny elsewhere.
CFG = DeepSeekConfig(num_layers=2, hidden_size=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16,
                     v_head_dim=16, ffn_size=32, block_size=128, num_blocks=96, dtype=torch.bfloat16)
MAX_LEN = 1024
BUCKETS = (2, 4, 8)


@pytest.fixture
def fake_npu(monkeypatch):
    return fake_torch_npu.install(monkeypatch)


def _problem(seq_lens, query_lens=None, block_size=128):
    problem = make_mla_problem(seq_lens, query_lens, heads=4, kv_lora_rank=512, rope_dim=64, block_size=block_size,
                               seed=len(seq_lens))
    for name in ("q_full", "q_pe", "kv_c_cache", "k_pe_cache", "w_uk"):
        setattr(problem, name, getattr(problem, name).to(torch.bfloat16))
    return problem


@pytest.mark.parametrize("query_lens, sparse_mode", [(None, 0), ([1, 5, 2, 16], 3)], ids=["decode", "mixed"])
def test_fia_v2_mla_equals_the_reference_with_the_wheels_schemas(fake_npu, query_lens, sparse_mode):
    """The binding's call and its workspace query, against the schemas of the wheel; the sparse mode
    set by the query lengths (0 without a mask for one query token per sequence, else 3 with it)."""
    problem = _problem([40, 300, 129, 700], query_lens)
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    shape = tiling.AttentionShape.of_mla(problem.q_nope, problem.q_pe, problem.kv_c_cache)
    ends, width = problem.query_start_loc[1:], problem.block_table.shape[1]
    tokens = problem.q_pe.shape[0]
    need = NpuWorkspaceQuery(kernels, torch.bfloat16).mla_max(shape, tokens, width, max(problem.query_lens))
    assert need == -(-tiling.max_workspace(tiling.MLA, shape, tokens, width * 128).nbytes // 2) * 2
    q_nope = problem.q_nope.contiguous()  # the NPU target stages it so (`passes/contiguous_query.py`)
    out = torch.empty_like(q_nope)
    kernels.mla_fused_infer_attention(q_nope, problem.q_pe, problem.kv_c_cache, problem.k_pe_cache,
                                      problem.block_table, ends, problem.seq_lens, problem.scale,
                                      torch.empty(need, dtype=torch.uint8), out)
    seq_lens, query_start_loc = problem.tensors()
    expected = torch.ops.ascend.mla_attention(problem.q_nope, problem.q_pe, problem.kv_c_cache, problem.k_pe_cache,
                                              problem.block_table, seq_lens, query_start_loc, problem.scale)
    torch.testing.assert_close(out, expected)
    schemas = fake_torch_npu.schemas()
    assert [c.name for c in fake_npu.calls] == [QUERY, KERNEL]
    for call in fake_npu.calls:
        check_call(schemas[call.name], call.args, call.kwargs)
        assert call.kwargs["sparse_mode"] == sparse_mode and (call.kwargs["atten_mask"] is None) == (sparse_mode == 0)
        assert call.kwargs["num_key_value_heads"] == 1 and call.kwargs["input_layout"] == "TND"
    assert fake_npu.calls[1].kwargs["actual_seq_qlen"] == ends  # cumulative, the query call's are the probe's
    assert fake_npu.calls[1].kwargs["actual_seq_kvlen"] == problem.seq_lens
    assert str(torch.ops.npu.npu_fused_infer_attention_score_v2.out._schema) == "npu::" + str(schemas[KERNEL])
    assert [(a.name, str(a.type)) for a in schemas[QUERY].arguments] == \
        [(a.name, str(a.type)) for a in schemas["npu_fused_infer_attention_score_v2"].arguments]


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_the_mla_cache_write_is_the_device_op_reading_nothing_on_the_host(fake_npu, slot_dtype):
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    caches = [torch.zeros(4, 16, 512, dtype=torch.bfloat16), torch.zeros(4, 16, 64, dtype=torch.bfloat16)]
    expected = [c.clone() for c in caches]
    kv_c, k_pe = torch.randn(3, 512, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    slots = torch.tensor([17, -1, 40], dtype=slot_dtype)
    with fake_torch_npu.HostReads() as reads:
        kernels.mla_cache_write(kv_c, k_pe, *caches, slots)
    assert reads.reads == []
    torch.ops.ascend.mla_cache_write(kv_c, k_pe, *expected, slots)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    (call,) = fake_npu.calls
    assert call.name == "npu_scatter_pa_kv_cache" and call.kwargs == {"cache_mode": "Norm"}
    assert call.args[4].dtype == slot_dtype and fake_npu.writes == [2]
    check_call(fake_torch_npu.schemas()[call.name], call.args, call.kwargs)


def _steps():
    decode = [[700, 5, 130], [1000, 20], [64, 128, 129, 300, 1, 900, 17], [256] * 8, [3]]
    mixed = [([30, 900, 97], [3, 1, 4]), ([60, 2], [2, 1]), ([120, 16, 17, 1000], [1, 2, 1, 4])]
    return [(lens, None) for lens in decode] + mixed + [([400, 6], None)]


def _run(cfg, steps, **options):
    model, reference_model = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, runtime="npu", max_model_len=MAX_LEN, **{"capture_sizes": BUCKETS, **options})
    batch = PagedBatch(cfg, seed=26, table_width=MAX_LEN // cfg.block_size)
    with torch.no_grad():
        for lens, qlens in steps:
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference_model(**inputs), **TOL)
    return artifacts


def test_the_deepseek_example_on_npu_is_replayed_from_captured_graphs_and_equals_eager(fake_npu, tmp_path):
    """Decode and mixed steps across buckets, each a replay of a decode or a mixed graph; the update
    table refreshes FIA v2's lengths; the workspace is FIA v2's answer, asked once per graph, and
    every call is given the artifact's slot."""
    steps = _steps()
    artifacts = _run(CFG, steps, dump_dir=str(tmp_path))
    assert sum(a.stats["replays"] for a in artifacts) == len(steps)
    assert sum(a.stats["eager_fallbacks"] for a in artifacts) == 0
    art = max(artifacts, key=lambda a: len(a.graphs))  # dynamo's general graph (the first may be static)
    plan = json.loads(open(f"{art.rewritten.graph_dir}/plan.json").read())
    keys = {f"b{b}.{kind}" for b in BUCKETS for kind in ("decode", "mixed")}
    assert set(plan["graphs"]) == keys
    graphs = art.describe()["graphs"]
    for name in ("b8.decode", "b4.mixed"):
        table = graphs[name]["update_table"]
        assert [e["kernel"] for e in table] == [tiling.MLA] * CFG.num_layers
        assert table[0]["refresh"] == {"actual_seq_qlen": {"input": "l_query_start_loc_", "conversion": "ends"},
                                       "actual_seq_kvlen": {"input": "l_seq_lens_", "conversion": "list"}}
    # A decode graph is captured with one query token per sequence (sparse_mode 0), a mixed one with its
    # padding packed, one dummy of its 4 tokens (sparse_mode 3): each keeps the mode its updates issue.
    assert graphs["b8.decode"]["update_table"][0]["frozen_at_capture"]["actual_seq_qlen"] == list(range(1, 9))
    assert graphs["b4.mixed"]["update_table"][0]["frozen_at_capture"]["actual_seq_qlen"] == [4]
    assert graphs["b4.mixed"]["update_table"][0]["frozen_at_capture"]["actual_seq_kvlen"] == [4]
    # One question per graph (its layers share the answer), the static artifacts' graphs included; a
    # one-token bucket's mixed graph asks what its decode graph asks (one query token per sequence).
    asked = {(id(a), k.bucket, 1 if k.decode else k.bucket) for a in artifacts for k in a.rewritten.choices}
    # and one per piecewise size, up to the first FIA v2 cannot take (8192 tokens: more than 4096 sequences,
    # refused by the rule before any question: `npu_rules.check_mla_sequences`)
    piecewise = [a.rewritten.piecewise for a in artifacts if a.rewritten.piecewise is not None]
    pieces = {(id(a), k.bucket, k.bucket) for a in artifacts if a.rewritten.piecewise
              for k in a.rewritten.piecewise.keys} - asked
    assert fake_npu.count(QUERY) == len(asked) + len(pieces) and len(asked) >= len(keys)
    assert all(p.keys[-1].bucket <= npu_rules.MLA_MAX_SEQUENCES for p in piecewise)
    shape = tiling.AttentionShape(CFG.num_heads, 1, CFG.kv_lora_rank, CFG.block_size, CFG.qk_rope_head_dim)
    largest = max(k.bucket for p in piecewise for k in p.keys)  # the slot serves the pieces' MLA calls too
    exact = tiling.max_workspace(tiling.MLA, shape, max(max(BUCKETS), largest), MAX_LEN).nbytes
    (slot,) = plan["workspace"]["slots"].values()
    assert slot["nbytes"] == -(-exact // 2) * 2
    calls = [c for c in fake_npu.calls if c.name == KERNEL]
    slots = {(s.nbytes,) for a in artifacts for s in a.rewritten.plan.slots.values()}
    assert calls and all(tuple(c.kwargs["workspace"].shape) in slots for c in calls)
    assert {c.kwargs["sparse_mode"] for c in calls} == {0, 3}


def test_a_step_of_more_than_16_query_tokens_per_sequence_is_served_piecewise_saying_why(fake_npu, caplog):
    """FIA v2's MLA form takes 1-16 query tokens per sequence: a prefill chunk of 20 is not served by a
    full graph (a compile-time refusal would refuse every model that prefills) but piecewise, the
    layers' MLA attention run between the pieces as the model's op, equal to eager."""
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        artifacts = _run(CFG, [([40, 600, 7], None), ([25, 3], [20, 1]), ([41, 601, 9, 10], None)],
                         capture_sizes=(2, 32))
    assert sum(a.stats["eager_fallbacks"] for a in artifacts) == 0 and sum(a.stats["replays"] for a in artifacts) == 2
    assert sum(a.stats["piecewise_steps"] for a in artifacts) == 1
    assert "takes 1-16 query tokens per sequence" in caplog.text and "a sequence of the step has 20" in caplog.text


def test_a_decode_step_above_the_buckets_is_served_piecewise_on_the_mla_kernel(fake_npu):
    """A decode step of 12 sequences, above the largest bucket (8), runs on the pieces of p16 with its MLA layers
    on FIA v2 between them (sparse_mode 0, the call's own lengths), not on the model's attention op: the captured
    graphs' sparse-mode rule is no rule of an eager call (TND takes 0 or 3 at any query lengths, L8719). A mixed
    step above the buckets likewise, in mode 3."""
    steps = [([30, 7], None), ([5 + 9 * i for i in range(12)], None), ([40, 6, 70, 8, 9, 10, 11, 12, 13, 14],
                                                                         [3, 1, 1, 1, 1, 1, 1, 1, 1, 1])]
    artifacts = _run(CFG, steps)
    assert sum(a.stats["piecewise_steps"] for a in artifacts) == 2
    graphs = [g for a in artifacts for g in a.pieces.graphs.values()]
    assert graphs and not [g.describe().get("attention_op_steps") for g in graphs if g.refusals]
    big = [c for c in fake_npu.calls if c.name == KERNEL and len(c.kwargs["actual_seq_kvlen"]) in (10, 12)]
    # the decode step captures p16's pieces on its own values first (`lowering/piecewise_live.py`): its layers'
    # calls made once there and once by the step; the mixed step replays those pieces
    assert [(len(c.kwargs["actual_seq_kvlen"]), c.kwargs["sparse_mode"]) for c in big] == \
        [(12, 0)] * 2 * CFG.num_layers + [(10, 3)] * CFG.num_layers


@pytest.mark.parametrize("source", [None, fake_torch_npu_sources.LATER], ids=["docs", "later-source"])
def test_mlas_workspace_probe_is_sized_by_what_the_devices_answer_depends_on(fake_npu, source):
    """Piecewise sizes up to 4096 tokens: where the device's max-workspace answer reads no token count (the later
    source's MLA max path, by core count: `fake_torch_npu_sources.mla_max_workspace`), no probe tensor holds more
    than 128 query tokens and the slot is that answer; where it grows with the tokens (the reference tiling the
    fake plays otherwise), the largest size is asked at its own tokens. Every step equal to eager either way, a
    decode step above the buckets on the kernel."""
    fake_npu.kernel_source = source
    steps = [([30, 7], None), ([5 + 9 * i for i in range(12)], None)]
    artifacts = _run(CFG, steps, piecewise_sizes=(16, 512, 4096))
    asked = [c.args[0].shape[0] for c in fake_npu.calls if c.name == QUERY]
    slots = {s.nbytes for a in artifacts for s in a.rewritten.plan.slots.values()}
    if source is None:
        assert max(asked) == 4096
        return
    assert max(asked) <= npu_workspace.MLA_PROBE_TOKENS
    assert slots == {fake_torch_npu_sources.mla_max_workspace(source)}
    assert sum(a.stats["piecewise_steps"] for a in artifacts) == 1


@pytest.mark.parametrize("source", [None, fake_torch_npu_sources.LATER], ids=["docs", "later-source"])
def test_the_mla_workspace_reserved_before_compiling_is_the_devices_answer(fake_npu, source):
    """The estimate vLLM reserves before sizing its KV cache (`NpuTarget.workspace_estimate`) takes MLA's
    workspace from the device's query, as the compile will: on the later source its core-count formula (less
    than the simulator's at a piecewise 4096), with probe tensors of at most 128 query tokens; PA and FIA keep
    the simulator's formula (no device question)."""
    from ascend_compile.config import CompileConfig
    from ascend_compile.passes.workspaces import KernelSite
    from ascend_compile.runtime.npu import NpuRuntime
    from ascend_compile.targets import NpuTarget

    fake_npu.kernel_source = source
    shape = tiling.AttentionShape(CFG.num_heads, 1, CFG.kv_lora_rank, CFG.block_size, CFG.qk_rope_head_dim)
    estimate = NpuTarget(NpuRuntime(CPU)).workspace_estimate(CompileConfig(max_model_len=MAX_LEN, runtime="npu"),
                                                             torch.bfloat16)
    need = estimate(KernelSite("mla", tiling.MLA, shape, max_query_len=16), 4096, MAX_LEN, None).nbytes
    simulator = tiling.max_workspace(tiling.MLA, shape, 4096, MAX_LEN).nbytes
    asked = [c.args[0].shape[0] for c in fake_npu.calls if c.name == QUERY]
    if source is None:
        assert need == -(-simulator // 2) * 2 and max(asked) == 4096
    else:
        assert need == fake_torch_npu_sources.mla_max_workspace(source) < simulator
        assert max(asked) <= npu_workspace.MLA_PROBE_TOKENS
    fia = tiling.AttentionShape(4, 2, 128, 128)
    before = len(fake_npu.calls)
    assert estimate(KernelSite("fia", tiling.FIA, fia), 64, MAX_LEN, None).nbytes == \
        tiling.max_workspace(tiling.FIA, fia, 64, MAX_LEN).nbytes and len(fake_npu.calls) == before


@pytest.mark.parametrize("change, message", [
    ({"kv_lora_rank": 256}, r"q_nope: .* takes kv_lora_rank \(the query's d\) 512 .* got 256"),
    ({"qk_rope_head_dim": 32}, r"q_pe: .* takes rope d 64 .*'query_rope和keyRope的d为64', L8726\), got 32"),
    ({"num_heads": 6}, r"q_nope: .* takes query heads \[1, 2, 4, 8, 16, 32, 64, 128\] .* got 6"),
    ({"block_size": 64}, r"block_size: .* takes KV-cache blocks of \[16, 128\] tokens .* got 64"),
    ({"dtype": torch.float32}, r"q_nope: .* takes float16 or bfloat16 queries .* got torch.float32"),
    ({"num_blocks": 2}, r"kv_c_cache: torch_npu.npu_fused_infer_attention_score_v2 .* needs at least as many cache "
                        r"blocks .* bucket 5 is captured with 5 padding sequences"),
])
def test_each_documented_constraint_is_refused_at_compile_naming_the_layer(fake_npu, change, message):
    cfg = dataclasses.replace(CFG, num_layers=1, **change)
    fn, _ = compiled_model(build(cfg), runtime="npu", max_model_len=256, capture_sizes=(8,))
    layer = r"mla_fused_infer_attention\w* \(layer L\['self'\].layers.0.attn\)"
    with pytest.raises(Exception, match=layer) as err, torch.no_grad():
        fn(**PagedBatch(cfg, seed=1).step([5, 6], [2, 3]))  # traced static: one bucket of 5 tokens
    assert err.match(message)
    assert fake_npu.count(KERNEL, QUERY) == 0  # refused before torch_npu is asked anything


def test_non_contiguous_latent_caches_are_refused_at_compile(fake_npu):
    model = build(dataclasses.replace(CFG, num_layers=1))
    attn = model.layers[0].attn
    attn.kv_c_cache = torch.zeros(96, 2, 128, 512, dtype=torch.bfloat16)[:, 0]  # one half of a paired cache
    fn, _ = compiled_model(model, runtime="npu", max_model_len=256, capture_sizes=(8,))
    # The layer's cache write is refused first (npu_scatter_pa_kv_cache: '输入参数不支持非连续'), its kernel alike.
    with pytest.raises(Exception, match=r"\(layer L\['self'\].layers.0.attn\): kv_c_cache: torch_npu.npu_scatter_pa_"
                                        r"kv_cache takes contiguous tensors .*'输入参数不支持非连续'"):
        with torch.no_grad():
            fn(**PagedBatch(CFG, seed=1).step([5, 6]))


def test_more_sequences_than_fia_v2_takes_are_refused_at_compile(fake_npu):
    cfg = dataclasses.replace(CFG, num_layers=1, block_size=16, num_blocks=4200)
    fn, _ = compiled_model(build(cfg), runtime="npu", max_model_len=64, capture_sizes=(8, 4104))
    with torch.no_grad():
        fn(**PagedBatch(cfg, seed=1).step([5, 6, 7]))  # traced static (one bucket of 3), served
    with pytest.raises(Exception, match=r"\(layer L\['self'\].layers.0.attn\): capture_sizes: .* at most 4096 sequences "
                                        r"per call \('actual_seq_qlen和actual_seq_kvlen的元素个数不大于4096', L8738\)"):
        with torch.no_grad():  # another size: traced general, for the capture sizes
            fn(**PagedBatch(cfg, seed=1).step([5, 6]))


def test_the_fake_takes_a_full_softmax_lse_as_vllm_ascend_passes_it(fake_npu):
    """vLLM-Ascend passes FIA v2's MLA form a `[num_tokens]` softmax_lse (`mla_v1.py`); the `.out`
    overload's softmax_lse is reserved ("当前预留，暂不支持", L9059): taken, never written (issue 33, item 6)."""
    from ascend_compile.ops.npu import mla as npu_mla

    problem = _problem([40, 300, 129])
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    q_nope = problem.q_nope.contiguous()
    out, lse = torch.empty_like(q_nope), torch.full((q_nope.shape[0],), 7.0, dtype=torch.bfloat16)
    npu_mla.mla_attention(kernels.torch_npu, kernels.atten_mask, lse, q_nope, problem.q_pe, problem.kv_c_cache,
                          problem.k_pe_cache, problem.block_table, problem.query_start_loc[1:], problem.seq_lens,
                          problem.scale, torch.empty(1 << 22, dtype=torch.uint8), out)
    seq_lens, query_start_loc = problem.tensors()
    expected = torch.ops.ascend.mla_attention(problem.q_nope, problem.q_pe, problem.kv_c_cache, problem.k_pe_cache,
                                              problem.block_table, seq_lens, query_start_loc, problem.scale)
    torch.testing.assert_close(out, expected)
    assert lse.eq(7.0).all()
