"""Issue 33, item 7: the attention features on runtime "npu", served as vLLM-Ascend serves them on FIA
(`ascend_compile/ops/npu/features.py`): a sliding window as FIA's band mode and sinks as FIA v2's
`learnable_sink`, each step equal to eager against the fake torch_npu, which computes the band as its
docs define it (`tests/fake_torch_npu_features.py`: a window off by one differs); the logit soft-cap,
which vLLM-Ascend does not serve on FIA, refused at compile time naming the layer.

Both readings of the band at one query token per sequence run (`ascend_compile/ops/npu/band_probe.py`):
the docs' (the band has no effect there, the fake's default) and vLLM-Ascend's (it applies). The device's
probe decides: with the docs' reading, decode steps with a sequence longer than the window run eagerly
and equal eager; with vLLM-Ascend's, every step replays.

Both readings of the band's edge run too (`npu_band_probe.band_edge`): the docs' (a band of `pre_tokens`
P holds P keys before the query's own and its own: `pre_tokens = W - 1`) and vLLM-Ascend's
(`pre_tokens = W`), the fake's `band_reading`. The device's edge probe decides which `pre_tokens` the
binding passes; where it finds neither, windowed layers run eagerly."""
from __future__ import annotations

import random

import pytest
import torch

import logging

from ascend_compile.ops.npu import kernels as npu_ops
from ascend_compile.ops import tiling
from ascend_compile.ops.npu import band_probe as npu_band_probe
from ascend_compile.ops.features import AttentionFeatures
from ascend_compile.ops.npu.workspace_queries import NpuWorkspaceQuery
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
#: Decode steps in buckets 4 and 8 and mixed ones, sequences shorter and longer than the window (the
#: last decode step's all within it).
STEPS = [[300, 20, 7], [200, 25, 24, 400, 26, 3], [9, 500, 130, 64], ([90, 23, 300], [3, 1, 2]), [31, 33],
         [5, 24, 17, 9, 3]]
#: The two readings of FIA's band at one query token per sequence: the docs' and vLLM-Ascend's.
READINGS = {"docs-band-ignored-at-s1": False, "band-applied-at-s1": True}
#: Those with each reading of the band's edge (the fake's `band_reading`): the docs' and vLLM-Ascend's.
EDGE_READINGS = {**{k: (a, "docs") for k, a in READINGS.items()},
                 **{f"vllm-edge-{k}": (a, "vllm-ascend") for k, a in READINGS.items()}}


@pytest.fixture
def fake_npu(monkeypatch):
    return fake_torch_npu.install(monkeypatch)


@pytest.fixture(params=list(READINGS.values()), ids=list(READINGS))
def either_reading(request, monkeypatch):
    """The fake under each reading of the band at S 1 (`tests/fake_torch_npu_features.py`)."""
    return fake_torch_npu.install(monkeypatch, band_at_single_query=request.param)


@pytest.fixture(params=list(EDGE_READINGS.values()), ids=list(EDGE_READINGS))
def any_reading(request, monkeypatch):
    """The fake under each reading of the band at S 1 and of its edge (`tests/fake_torch_npu_features.py`)."""
    applies, edge = request.param
    return fake_torch_npu.install(monkeypatch, band_at_single_query=applies, band_reading=edge)


def band_form(sinks: bool = False) -> npu_band_probe.BandForm:
    """The band form of the example model's layers here (4 heads, 2 KV heads, head dim 16: `examples/llama.py`)."""
    return npu_band_probe.BandForm(4, 2, 16, DTYPE, NPU_BLOCK, sinks)


def pre_tokens_of(fake, window: int = WINDOW) -> int:
    """The `pre_tokens` that serves `window` under the fake's reading of the band's edge."""
    return window - 1 if fake.band_reading == "docs" else window


def eager_steps(steps, band_at_single_query: bool) -> int:
    """The steps the S=1 band probe's answer sends eagerly where the device does not apply the band: decode
    steps with a sequence longer than the window, and every decode step of bucket 4, whose graph (with PA,
    `pa_max_batch=4`) is captured at a KV length past the window (`lowering/inputs.capture_seq_len`), a
    step the guard refuses, so that graph serves none."""
    return 0 if band_at_single_query else sum(not isinstance(s, tuple) and (max(s) > WINDOW or len(s) <= 4)
                                              for s in steps)


def is_band_probe(call) -> bool:
    """Whether `call` is one of the band probes' (one sequence of KV `PROBE_KV_LEN`, pre_tokens 15 or 16)."""
    kv = call.kwargs.get("actual_seq_lengths_kv", call.kwargs.get("actual_seq_kvlen"))
    return list(kv or []) == [npu_band_probe.PROBE_KV_LEN] and call.kwargs.get("pre_tokens") in (
        npu_band_probe.PROBE_WINDOW - 1, npu_band_probe.PROBE_WINDOW)


def is_probe(call) -> bool:
    """Whether `call` is a band probe's or the form probe's (one sequence of KV 1 or 2 on a one-block table:
    `ops/npu/form_probe.py`)."""
    kv = call.kwargs.get("actual_seq_lengths_kv", call.kwargs.get("actual_seq_kvlen"))
    return is_band_probe(call) or tuple(call.kwargs["block_table"].shape) == (1, 1) and list(kv or []) in ([1], [2])


def served(fake, name: str):
    """The calls of `name`, the band probes' own left out."""
    return [c for c in fake.calls if c.name == name and not is_probe(c)]


def run_replayed(cfg: LlamaConfig, steps=STEPS, band_at_single_query: bool = True, eager: int | None = None):
    """The example model compiled on runtime "npu" (without `verify`, so every output is the replay's own)
    and eager, over `steps`; asserts each step equal to eager, replayed unless the device's S=1 band
    probe sent it eagerly (`eager_steps`, or `eager` steps where given); returns the artifacts."""
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
    eager = eager_steps(steps, band_at_single_query) if eager is None else eager
    assert sum(a.stats["replays"] for a in artifacts) == len(steps) - eager
    # the steps no full graph served: piecewise (the layers' attention run between the pieces), else eagerly
    assert sum(a.stats["eager_fallbacks"] + a.stats["piecewise_steps"] for a in artifacts) == eager
    return artifacts


def window_served(artifacts) -> set[str]:
    return {k["window_served"] for a in artifacts for g in a.describe()["graphs"].values() for k in g["kernels"]
            if "window_served" in k}


def band_of(call) -> tuple:
    return call.kwargs["sparse_mode"], call.kwargs.get("pre_tokens"), call.kwargs.get("next_tokens")


def test_a_sliding_window_model_on_npu_equals_eager_through_fias_band_mode(any_reading):
    fake_npu, applies = any_reading, any_reading.band_at_single_query
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK, layer_types=("full", "sliding"),
                      sliding_window=WINDOW)
    artifacts = run_replayed(cfg, band_at_single_query=applies)
    # The probes asked the device once each (one sequence of 4 query tokens, then of one, KV past the window,
    # both with the pre_tokens the first found), and decided.
    probe_pre = pre_tokens_of(fake_npu, npu_band_probe.PROBE_WINDOW)
    probes = [c for c in fake_npu.calls if c.name == V1 and is_band_probe(c)]
    assert [(c.kwargs["actual_seq_lengths"], c.kwargs["actual_seq_lengths_kv"], c.kwargs["pre_tokens"])
            for c in probes] == [([npu_band_probe.EDGE_QUERY_LEN], [npu_band_probe.PROBE_KV_LEN],
                                  npu_band_probe.PROBE_WINDOW - 1), ([1], [npu_band_probe.PROBE_KV_LEN], probe_pre)]
    [how] = window_served(artifacts)
    assert ("in every step" in how) == applies and ("run eagerly" in how) != applies
    assert f"pre_tokens {pre_tokens_of(fake_npu)}," in how
    calls = served(fake_npu, V1)
    # The full layer causal (bucket 8 and mixed steps), the sliding one in band mode of the pre_tokens the
    # edge probe found (W - 1 under the docs' reading, W under vLLM-Ascend's), none after the query's own;
    # its workspace asked in the same form.
    pre = pre_tokens_of(fake_npu)
    assert {band_of(c) for c in calls} == {(3, None, None), (4, pre, 0)}
    assert (4, pre, 0) in {band_of(c) for c in fake_npu.calls if c.name == V1_QUERY}
    assert all(c.kwargs["atten_mask"].shape == (2048, 2048) for c in calls)
    schemas = fake_torch_npu.schemas()
    for call in fake_npu.calls:
        check_call(schemas[call.name], call.args, call.kwargs)


def test_sinks_on_npu_are_fia_v2s_learnable_sink_and_equal_eager(any_reading):
    fake_npu = any_reading
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK, sinks=True,
                      layer_types=("sliding", "full"), sliding_window=WINDOW)
    run_replayed(cfg, band_at_single_query=fake_npu.band_at_single_query)
    calls = served(fake_npu, V2)
    assert calls and not fake_npu.count(V1, "_npu_paged_attention")  # sinks: FIA v2 in every bucket
    # vLLM-Ascend's call: band mode for the sliding layer, sparse 3 (pre_tokens at its default) for the full one
    assert {band_of(c) for c in calls} == {(4, pre_tokens_of(fake_npu), 0), (3, MAX_TOKENS, 0)}
    assert {(c.kwargs["learnable_sink"].dtype, tuple(c.kwargs["learnable_sink"].shape)) for c in calls} == {
        (torch.bfloat16, (4,))}
    asked = [c for c in fake_npu.calls if c.name == V2_QUERY]
    assert asked and all(c.kwargs["learnable_sink"] is not None for c in asked)
    schemas = fake_torch_npu.schemas()
    for call in fake_npu.calls:
        check_call(schemas[call.name], call.args, call.kwargs)


@pytest.mark.parametrize("reading", ["docs", "vllm-ascend"])
@pytest.mark.parametrize("sinks", [None, SINKS], ids=["fia", "fia-v2-sinks"])
@pytest.mark.parametrize("query_lens", [None, [1, 3, 1, 2, 4]], ids=["decode", "mixed"])
def test_a_window_off_by_one_differs_from_eager(monkeypatch, reading, sinks, query_lens):
    """The binding's window against the dense oracle, then with the other reading's `pre_tokens` forced
    (`W` where the device's band is the docs', `W - 1` where it is vLLM-Ascend's): on the fake, which
    computes the band as its reading defines it, that is a window one key wider or narrower, and it differs
    from eager (decode calls on a fake applying the band at S 1)."""
    fake = fake_torch_npu.install(monkeypatch, band_at_single_query=True, band_reading=reading)
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
    assert {c.kwargs["pre_tokens"] for c in served(fake, V2 if sinks is not None else V1)} == {
        pre_tokens_of(fake, window)}
    other = window if reading == "docs" else window - 1  # the other reading's pre_tokens
    monkeypatch.setattr(kernels, "pre_tokens", lambda w, s: None if w is None else other)
    off = attend()
    wrong = window + 1 if reading == "docs" else window - 1
    torch.testing.assert_close(off, prob.dense(window=wrong, sinks=sinks), **TOL)
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
    assert {band_of(c) for c in served(fake_npu, V1)} == {(3, None, None), (4, 499, 0), (4, MAX_LEN - 1, 0)}


@pytest.mark.parametrize("sinks", [None, SINKS], ids=["fia", "fia-v2-sinks"])
def test_the_fake_follows_the_docs_at_one_query_token_per_sequence_unless_told_otherwise(monkeypatch, sinks):
    """The docs: at Q_S 1 `pre_tokens` / `next_tokens` have no effect (L8110-8111, v2 L8629-8630): a decode
    call in band mode attends every key; with `band_at_single_query` the band applies, as vLLM-Ascend reads it."""
    prob = make_problem([300, 40], block_size=NPU_BLOCK, dtype=DTYPE, seed=1)
    sinks = None if sinks is None else sinks.to(DTYPE)
    for applies in (False, True):
        fake_torch_npu.install(monkeypatch, band_at_single_query=applies)
        v1, v2 = _valid_calls(prob)
        (args, kwargs), op = (v1, torch.ops.npu.npu_fused_infer_attention_score.out) if sinks is None else \
            (v2, torch.ops.npu.npu_fused_infer_attention_score_v2.out)
        if sinks is not None:
            kwargs = {**kwargs, "learnable_sink": sinks}
        out = torch.empty_like(prob.query)
        op(*args, **kwargs, workspace=None, out=[out, torch.empty(1)])
        torch.testing.assert_close(out.float(), prob.dense(window=WINDOW if applies else None, sinks=sinks), **TOL)


def test_the_s1_band_probe_asks_the_device_once_and_logs_its_answer(either_reading, caplog):
    applies = either_reading.band_at_single_query
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        answers = [kernels.band_at_single_query(band_form()), kernels.band_at_single_query(band_form()),
                   npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU).band_at_single_query(band_form())]
    assert answers == [applies] * 3
    assert either_reading.count(V1) == 2  # once per process and device, after the edge probe's one call
    assert [r.getMessage() for r in caplog.records if "S=1 band probe" in r.getMessage()] == [
        f"ascend_compile: FIA {band_form()} on cpu {'applies' if applies else 'does not apply'} the band (sparse_mode 4, "
        f"pre_tokens) to a call whose every sequence has one query token (the S=1 band probe): "
        f"{'windowed layers keep their decode graphs' if applies else 'decode steps with a sequence longer than a layer' + chr(39) + 's window run eagerly'}"]
    assert npu_band_probe.known(kernels) == {band_form(): applies}
    assert kernels.band_at_single_query(band_form(True)) == applies and either_reading.count(V2) == 2  # v2 asked apart


def test_the_binding_refuses_a_windowed_decode_call_past_the_window_the_device_would_not_band(fake_npu):
    """A backstop behind the step guard: on a device whose probe found the band not applied at S 1, a
    windowed call of one query token per sequence with one longer than the window is refused, naming why;
    one whose sequences all fit the window runs (the band cuts nothing there)."""
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    workspace = torch.empty(1 << 22, dtype=torch.uint8)
    long, short = (make_problem(lens, block_size=NPU_BLOCK, dtype=DTYPE) for lens in ([300, 9], [WINDOW, 9]))
    for prob, refused in ((long, True), (short, False)):
        out = torch.empty_like(prob.query)
        call = lambda: kernels.fused_infer_attention(prob.query, prob.key_cache, prob.value_cache,  # noqa: E731
                                                     prob.block_table, [1, 2], prob.seq_lens, prob.scale, workspace,
                                                     out, WINDOW)
        if refused:
            with pytest.raises(ValueError, match=r"window: a call of one query token per sequence with one longer "
                                                 r"than the window of 24 would attend the whole context: .*L8110"):
                call()
        else:
            call()
            torch.testing.assert_close(out.float(), prob.dense(window=WINDOW), **TOL)
    assert len(served(fake_npu, V1)) == 1  # the refused call never reached the device
