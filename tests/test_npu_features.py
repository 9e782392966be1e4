"""Issue 33, item 7: the attention features on runtime "npu", served as vLLM-Ascend serves them on FIA
(`ascend_compile/ops/npu_features.py`): a sliding window as FIA's band mode and sinks as FIA v2's
`learnable_sink`, each replayed step equal to eager against the fake torch_npu, which computes the band
as its docs define it (`tests/fake_torch_npu_features.py`: a window off by one differs); the logit
soft-cap, which vLLM-Ascend does not serve on FIA, refused at compile time naming the layer."""
from __future__ import annotations

import random

import pytest
import torch

from ascend_compile.ops import npu as npu_ops
from ascend_compile.ops import tiling
from ascend_compile.ops.features import AttentionFeatures
from ascend_compile.ops.npu_workspace import NpuWorkspaceQuery
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu
from tests.helpers import make_problem
from tests.test_backend import compiled_model
from tests.test_npu import CPU, DTYPE, MAX_LEN, NPU_BLOCK, TOL, check_call

WINDOW = 24
#: `pre_tokens`' default (`_op_plugin_docs.py` L8110), vLLM-Ascend's `SWA_INT_MAX` for layers without a window.
MAX_TOKENS = 2147483647
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.25])
V1, V2 = "npu_fused_infer_attention_score.out", "npu_fused_infer_attention_score_v2.out"
V1_QUERY, V2_QUERY = ("_npu_fused_infer_attention_score_get_max_workspace",
                      "_npu_fused_infer_attention_score_v2_get_max_workspace")
#: Decode steps in buckets 4 and 8 and mixed ones, sequences shorter and longer than the window.
STEPS = [[300, 20, 7], [200, 25, 24, 400, 26, 3], [9, 500, 130, 64], ([90, 23, 300], [3, 1, 2]), [31, 33]]


@pytest.fixture
def fake_npu(monkeypatch):
    return fake_torch_npu.install(monkeypatch)


def run_replayed(cfg: LlamaConfig, steps=STEPS):
    """The example model compiled on runtime "npu" (without `verify`, so every output is the replay's own)
    and eager, over `steps`; asserts each step equal and replayed; returns the artifacts."""
    model, reference = build(cfg), build(cfg)
    for layer in [*model.layers, *reference.layers] if cfg.sinks else []:
        layer.attn.sinks.data.copy_(SINKS.to(cfg.dtype))
    fn, artifacts = compiled_model(model, runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4, 8), pa_max_batch=4,
                                   verify=False)
    batch = PagedBatch(cfg, seed=7)
    with torch.no_grad():
        for step in steps:
            lens, qlens = step if isinstance(step, tuple) else (step, None)
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
    assert sum(a.stats["replays"] for a in artifacts) == len(steps)
    return artifacts


def band_of(call) -> tuple:
    return call.kwargs["sparse_mode"], call.kwargs.get("pre_tokens"), call.kwargs.get("next_tokens")


def test_a_sliding_window_model_on_npu_equals_eager_through_fias_band_mode(fake_npu):
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK, layer_types=("full", "sliding"),
                      sliding_window=WINDOW)
    run_replayed(cfg)
    calls = [c for c in fake_npu.calls if c.name == V1]
    # The full layer causal (bucket 8 and mixed steps), the sliding one in band mode: W - 1 keys before the
    # query's own, none after; its workspace asked in the same form.
    assert {band_of(c) for c in calls} == {(3, None, None), (4, WINDOW - 1, 0)}
    assert (4, WINDOW - 1, 0) in {band_of(c) for c in fake_npu.calls if c.name == V1_QUERY}
    assert all(c.kwargs["atten_mask"].shape == (2048, 2048) for c in calls)
    schemas = fake_torch_npu.schemas()
    for call in fake_npu.calls:
        check_call(schemas[call.name], call.args, call.kwargs)


def test_sinks_on_npu_are_fia_v2s_learnable_sink_and_equal_eager(fake_npu):
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK, sinks=True,
                      layer_types=("sliding", "full"), sliding_window=WINDOW)
    run_replayed(cfg)
    calls = [c for c in fake_npu.calls if c.name == V2]
    assert calls and not fake_npu.count(V1, "_npu_paged_attention")  # sinks: FIA v2 in every bucket
    # vLLM-Ascend's call: band mode for the sliding layer, sparse 3 (pre_tokens at its default) for the full one
    assert {band_of(c) for c in calls} == {(4, WINDOW - 1, 0), (3, MAX_TOKENS, 0)}
    assert {(c.kwargs["learnable_sink"].dtype, tuple(c.kwargs["learnable_sink"].shape)) for c in calls} == {
        (torch.bfloat16, (4,))}
    asked = [c for c in fake_npu.calls if c.name == V2_QUERY]
    assert asked and all(c.kwargs["learnable_sink"] is not None for c in asked)
    schemas = fake_torch_npu.schemas()
    for call in fake_npu.calls:
        check_call(schemas[call.name], call.args, call.kwargs)


def vllm_ascends_band(window):
    """vLLM-Ascend's arguments: `pre_tokens=self.sliding_window` (attention_v1.py L942), W itself."""
    return {} if window is None else {"pre_tokens": window, "next_tokens": 0}


@pytest.mark.parametrize("sinks", [None, SINKS], ids=["fia", "fia-v2-sinks"])
@pytest.mark.parametrize("query_lens", [None, [1, 3, 1, 2, 4]], ids=["decode", "mixed"])
def test_a_window_off_by_one_differs_from_eager(fake_npu, monkeypatch, sinks, query_lens):
    """The binding's window against the dense oracle, then with vLLM-Ascend's `pre_tokens=W`: on the fake,
    which computes the documented band, that is a window of W + 1 keys, and it differs from eager."""
    window = 9
    prob = make_problem([300, 23, 10, 9, 130], query_lens, block_size=NPU_BLOCK, dtype=DTYPE, seed=3)
    sinks = None if sinks is None else sinks.to(DTYPE)
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    features = AttentionFeatures(window, None, sinks is not None)
    shape = tiling.AttentionShape.of(prob.query, prob.key_cache)
    need = NpuWorkspaceQuery(kernels, DTYPE).fused_infer_attention_max(shape, prob.query.shape[0],
                                                                        prob.block_table.shape[1], features)

    def attend():
        out = torch.empty_like(prob.query)
        kernels.call(tiling.FIA, prob.query, prob.key_cache, prob.value_cache, prob.block_table,
                     prob.query_start_loc[1:], prob.seq_lens, prob.scale, torch.empty(need, dtype=torch.uint8), out,
                     window, None, sinks)
        return out.float()

    torch.testing.assert_close(attend(), prob.dense(window=window, sinks=sinks), **TOL)
    monkeypatch.setattr("ascend_compile.ops.npu_features.band_tokens", vllm_ascends_band)
    off = attend()
    torch.testing.assert_close(off, prob.dense(window=window + 1, sinks=sinks), **TOL)
    assert (off - prob.dense(window=window, sinks=sinks)).abs().max() > 10 * TOL["atol"]


@pytest.mark.parametrize("cfg_features", [dict(soft_cap=30.0),
                                          dict(soft_cap=30.0, layer_types=("full", "sliding"), sliding_window=64),
                                          dict(soft_cap=30.0, sinks=True)], ids=["soft-cap", "with-window", "with-sinks"])
def test_a_soft_cap_stays_refused_at_compile_naming_the_layer_and_why(fake_npu, cfg_features):
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK, **cfg_features)
    fn, _ = compiled_model(build(cfg), runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4,))
    why = r"layer .*: soft_cap is not supported on runtime 'npu': .*take no logit soft-cap .*vLLM-Ascend does not serve"
    with torch.no_grad(), pytest.raises(Exception, match=why):
        fn(**PagedBatch(cfg, seed=0).step([10, 20, 30]))
    assert not fake_npu.executed


def test_the_binding_refuses_a_soft_cap_naming_the_argument(fake_npu):
    prob = make_problem([40, 9], block_size=NPU_BLOCK, dtype=DTYPE)
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    out, workspace = torch.empty_like(prob.query), torch.empty(1 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"soft_cap: not supported on runtime 'npu': .*L8061, L8585"):
        kernels.fused_infer_attention(prob.query, prob.key_cache, prob.value_cache, prob.block_table, [1, 2],
                                      prob.seq_lens, prob.scale, workspace, out, None, 30.0, None)
    assert not fake_npu.executed


@pytest.mark.parametrize("cfg_features, refusal", [
    (dict(dtype=torch.float16), r"sinks: .*\(learnable_sink\) takes a bfloat16 \(Q_N,\) = \(4,\) learnable_sink .*L8625"),
    (dict(head_dim=144, hidden_size=64), r"value_cache: .*\(learnable_sink\) takes a value head dim of at most 128 .*L8757"),
], ids=["float16", "head-dim-144"])
def test_sinks_fia_v2_does_not_take_are_refused_at_compile_naming_the_layer(fake_npu, cfg_features, refusal):
    cfg = LlamaConfig(**{"dtype": DTYPE, **cfg_features}, num_layers=2, num_blocks=128, block_size=NPU_BLOCK,
                      sinks=True)
    fn, _ = compiled_model(build(cfg), runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4,))
    with torch.no_grad(), pytest.raises(Exception, match=rf"layer .*: {refusal}"):
        fn(**PagedBatch(cfg, seed=0).step([10, 20, 30]))
    assert not fake_npu.executed


def _valid_calls(prob, window: int = WINDOW):
    """A valid FIA band-mode call and a valid FIA v2 call with `learnable_sink`, as vLLM-Ascend makes them
    (`attention_v1.py` `full_graph_fia` and `full_graph_fia_v2`; keywords in the schemas' order): each
    (positional arguments, keyword arguments)."""
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    num_blocks, block_size, kv_heads, dim = prob.key_cache.shape
    caches = tuple(c.view(num_blocks, block_size, kv_heads * dim) for c in (prob.key_cache, prob.value_cache))
    ends, lens, heads = list(prob.query_start_loc[1:]), list(prob.seq_lens), prob.query.shape[1]
    band = dict(pre_tokens=window - 1, next_tokens=0)
    v1 = dict(atten_mask=mask, actual_seq_lengths=ends, actual_seq_lengths_kv=lens, block_table=prob.block_table,
              num_heads=heads, scale=prob.scale, **band, input_layout="TND", num_key_value_heads=kv_heads,
              sparse_mode=4, block_size=block_size)
    v2 = dict(atten_mask=mask, actual_seq_qlen=ends, actual_seq_kvlen=lens, block_table=prob.block_table,
              learnable_sink=SINKS.to(DTYPE), num_query_heads=heads, num_key_value_heads=kv_heads,
              softmax_scale=prob.scale, **band, input_layout="TND", sparse_mode=4, block_size=block_size)
    return ((prob.query, *caches), v1), ((prob.query, *caches), v2)


@pytest.mark.parametrize("form, change, refusal", [
    ("v1", dict(pre_tokens=-3, next_tokens=1), "pre_tokens: expected preTokens >= -actual_seq_qlen"),
    ("v1", dict(atten_mask=None), "atten_mask: expected the .2048, 2048. bool/int8/uint8 mask"),
    ("v1", dict(atten_mask="upper"), "atten_mask: expected the lower-triangular mask"),
    ("v1", dict(sparse_mode=2), "sparse_mode: expected 3 .rightDownCausal. or 4"),
    ("v2", dict(learnable_sink=SINKS), r"learnable_sink: expected a bfloat16 \(4,\) tensor .*L8625"),
    ("v2", dict(learnable_sink=SINKS[:2].to(DTYPE)), r"learnable_sink: expected a bfloat16 \(4,\) tensor"),
    ("v2", dict(input_layout="BSH"), "input_layout: expected 'TND' with learnable_sink"),
    ("v2", dict(pre_tokens=-1), "pre_tokens: expected preTokens >= -actual_seq_qlen"),
], ids=["band-empty", "no-mask", "upper-mask", "sparse-2", "float32-sink", "sink-shape", "bsh", "v2-band-empty"])
def test_the_fake_refuses_band_and_sink_calls_its_docs_forbid(fake_npu, form, change, refusal):
    prob = make_problem([300, 40], [1, 3], block_size=NPU_BLOCK, dtype=DTYPE)
    v1, v2 = _valid_calls(prob)
    (args, kwargs), op = (v1, torch.ops.npu.npu_fused_infer_attention_score.out) if form == "v1" else \
        (v2, torch.ops.npu.npu_fused_infer_attention_score_v2.out)
    out = [torch.empty_like(prob.query), torch.empty(1)]
    op(*args, **kwargs, workspace=None, out=out)  # the valid call runs
    if change.get("atten_mask") == "upper":
        change = dict(atten_mask=kwargs["atten_mask"].T.contiguous())
    with pytest.raises(ValueError, match=refusal):
        op(*args, **{**kwargs, **change}, workspace=None, out=out)


def test_the_fake_and_the_binding_refuse_a_float16_query_and_a_wide_head_with_learnable_sink(fake_npu):
    prob = make_problem([300, 40], [1, 3], block_size=NPU_BLOCK, dtype=DTYPE)
    _, (args, kwargs) = _valid_calls(prob)
    v2 = torch.ops.npu.npu_fused_infer_attention_score_v2.out
    half = tuple(a.to(torch.float16) for a in args)
    with pytest.raises(ValueError, match="query: expected bfloat16 .'数据类型仅支持BFLOAT16', L8733"):
        v2(*half, **kwargs, out=[half[0].clone(), torch.empty(1)])
    wide = make_problem([300, 40], [1, 3], dim=144, block_size=NPU_BLOCK, dtype=DTYPE)
    _, (args, kwargs) = _valid_calls(wide)
    with pytest.raises(ValueError, match="value: expected a head dim of at most 128 .'仅支持value的d小于等于128', L8757"):
        v2(*args, **kwargs, out=[torch.empty_like(wide.query), torch.empty(1)])
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    with pytest.raises(ValueError, match=r"value_cache: .*\(learnable_sink\) takes a value head dim of at most 128"):
        kernels.fused_infer_attention(wide.query, wide.key_cache, wide.value_cache, wide.block_table, [1, 4],
                                      wide.seq_lens, wide.scale, torch.empty(1 << 20, dtype=torch.uint8),
                                      torch.empty_like(wide.query), None, None, SINKS.to(DTYPE))
    assert not fake_npu.executed  # the binding refused before the device


def test_a_window_spanning_the_whole_context_equals_causal_attention(fake_npu):
    """A window at least as long as every sequence is causal attention: band mode then computes what sparse 3
    does (no key dropped at the window's edge)."""
    rng = random.Random(2)
    prob = make_problem([rng.randint(1, 500) for _ in range(5)], [1, 2, 1, 3, 1], block_size=NPU_BLOCK, dtype=DTYPE)
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    workspace = torch.empty(1 << 22, dtype=torch.uint8)
    outs = []
    for window in (None, 500, MAX_LEN):
        out = torch.empty_like(prob.query)
        kernels.fused_infer_attention(prob.query, prob.key_cache, prob.value_cache, prob.block_table,
                                      prob.query_start_loc[1:], prob.seq_lens, prob.scale, workspace, out, window)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert {band_of(c) for c in fake_npu.calls if c.name == V1} == {(3, None, None), (4, 499, 0), (4, MAX_LEN - 1, 0)}
