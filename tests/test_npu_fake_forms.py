"""What the fake torch_npu says the device may do, and the binding's answer to each (issue 46, area 5): FIA's
workspace answered per form (`install(..., fia_workspace=)`: the older kernel source's sum, in which a call whose every
sequence has one query token asks more; or a device sizing v1, its band and v2 with sinks apart), a one-query-token
band that is neither applied nor ignored (`band_at_single_query="broken"`, or refused: `"refused"`), and a query and
caches of different half dtypes (the device's RuntimeError: no kernel is built for the pair). The sources each follows
are cited in `tests/fake_torch_npu_sources.py` and `tests/fake_torch_npu_features.py`."""
from __future__ import annotations

import logging

import pytest
import torch

from ascend_compile.ops import tiling
from ascend_compile.ops.features import PLAIN, AttentionFeatures
from ascend_compile.ops.npu import band_probe as npu_band_probe
from ascend_compile.ops.npu import form_probe as npu_form_probe
from ascend_compile.ops.npu import kernels as npu_ops
from ascend_compile.ops.npu import rules as npu_rules
from ascend_compile.ops.npu.workspace_queries import NpuWorkspaceQuery
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu, fake_torch_npu_sources as sources
from tests.helpers import make_problem
from tests.test_backend import compiled_model
from tests.test_npu import CPU, DTYPE, MAX_LEN, NPU_BLOCK, TOL
from tests.test_npu_features import SINKS, WINDOW, band_form, run_replayed

SHAPE = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=NPU_BLOCK)
TABLE = MAX_LEN // NPU_BLOCK
FORMS = {"v1": PLAIN, "band": AttentionFeatures(WINDOW), "v2-sinks": AttentionFeatures(None, None, True),
         "v2-sinks-band": AttentionFeatures(WINDOW, None, True)}


def _kernels() -> npu_ops.NpuKernels:
    return npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)


def _need(mode: str, tokens: int, sequences: int, features: AttentionFeatures) -> int:
    """The fake's workspace for a call of `tokens` query tokens in `sequences` sequences, of `features`' form."""
    query = torch.empty(tokens, SHAPE.num_heads, SHAPE.head_dim, dtype=DTYPE)
    return sources.fia_workspace_nbytes(mode, query, SHAPE.num_kv_heads, sequences, TABLE * NPU_BLOCK,
                                        features.window is not None, features.sinks)


# ----------------------------------------------------------------------------- FIA's workspace, per form


def test_the_fake_answers_fias_workspace_per_form_as_the_sources_say(monkeypatch):
    # The older source: a one-query-token call (as many sequences as tokens) of a GQA layer (G 2) asks more than
    # one of the same tokens packed; band and sinks do not enter its sum. "per-form": each form its own answer.
    fake_torch_npu.install(monkeypatch, fia_workspace=sources.OLDER)
    older = {name: _need(sources.OLDER, 8, n, f) for name, f in FORMS.items() for n in (1, 8)}
    assert _need(sources.OLDER, 8, 8, PLAIN) > _need(sources.OLDER, 8, 1, PLAIN)
    assert len({_need(sources.OLDER, 8, 8, f) for f in FORMS.values()}) == 1
    per_form = {name: _need(sources.PER_FORM, 8, 8, f) for name, f in FORMS.items()}
    assert len(set(per_form.values())) == 4 and min(per_form.values()) == per_form["v1"]
    # the fake's query answers that sum, in its form (v1's query, or v2's with sinks)
    queries = NpuWorkspaceQuery(_kernels(), DTYPE)
    for name, features in FORMS.items():
        asked = queries._fia_asked(SHAPE, 8, TABLE, features, [1] * 8, [1] + [0] * 7)
        assert older[name] == _need(sources.OLDER, 8, 8, features) <= asked < older[name] + 2, name


@pytest.mark.parametrize("applies", [True, False], ids=["band-at-s1", "no-band-at-s1"])
@pytest.mark.parametrize("mode", [sources.OLDER, sources.PER_FORM])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("tokens", [1, 8, 512])
def test_fias_workspace_plan_holds_every_form_its_graph_calls(monkeypatch, mode, form, tokens, applies):
    # A graph of `tokens` tokens is called with its tokens packed (a mixed step) or one per sequence (a decode step),
    # in its layer's form (a windowed layer's decode calls in band mode only where the device applies the band at
    # S 1): the plan's answer holds each, on a device sizing them apart.
    fake_torch_npu.install(monkeypatch, fia_workspace=mode, band_at_single_query=applies)
    features = FORMS[form]
    planned = NpuWorkspaceQuery(_kernels(), DTYPE).fused_infer_attention_max(SHAPE, tokens, TABLE, features)
    decode = features if applies else AttentionFeatures(None, None, features.sinks)
    needs = {n: _need(mode, tokens, n, decode if n == tokens else features) for n in (1, tokens)}
    assert planned >= max(needs.values()), (planned, needs)
    assert planned < max(needs.values()) + 2  # no more than the largest form's answer


@pytest.mark.parametrize("mode, sinks", [(sources.OLDER, False), (sources.PER_FORM, False), (sources.PER_FORM, True)],
                         ids=["older-source", "per-form", "per-form-sinks"])
def test_a_model_served_on_a_device_sizing_fias_workspace_per_form_equals_eager(monkeypatch, mode, sinks):
    # The fake's kernel refuses a workspace smaller than its call's form needs: every decode (one query token per
    # sequence) and mixed step of a windowed GQA model, on FIA, replayed and equal to eager.
    fake = fake_torch_npu.install(monkeypatch, band_at_single_query=True, fia_workspace=mode)
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK, sinks=sinks,
                      layer_types=("full", "sliding"), sliding_window=WINDOW)
    steps = [[30, 7, 12, 9, 5, 3], [40, 41, 2], ([90, 23, 30], [3, 1, 2]), [31, 33, 20, 21, 22, 23, 24, 25]]
    model, reference = build(cfg), build(cfg)
    for layer in [*model.layers, *reference.layers] if sinks else []:
        layer.attn.sinks.data.copy_(SINKS.to(cfg.dtype))
    fn, artifacts = compiled_model(model, runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4, 8),
                                   kernel_policy="fia", verify=False, piecewise_sizes=())
    batch = PagedBatch(cfg, seed=3, table_width=TABLE)  # block tables as wide as the plan's, as vLLM's are
    with torch.no_grad():
        for step in steps:
            lens, qlens = step if isinstance(step, tuple) else (step, None)
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
    assert sum(a.stats["replays"] for a in artifacts) == len(steps)
    decode = [c for c in fake.calls if c.name.endswith(".out") and "fused_infer" in c.name
              and list(c.kwargs.get("actual_seq_lengths", c.kwargs.get("actual_seq_qlen")) or []) == list(range(1, 9))]
    assert decode, "a decode graph of 8 sequences on FIA"


# ----------------------------------------------------------------------------- a broken one-query-token band


@pytest.mark.parametrize("how", ["broken", "refused"])
@pytest.mark.parametrize("sinks", [False, True], ids=["fia", "fia-v2-sinks"])
def test_a_broken_one_query_token_band_is_read_as_not_applied(monkeypatch, caplog, how, sinks):
    # A device whose band at one query token per sequence attends the wrong keys, or refuses the call: the S=1
    # probe answers "not applied" (a WARNING naming why), the edge probe (several query tokens) is untouched, and
    # the binding refuses a decode call with a sequence longer than the window instead of computing it.
    fake_torch_npu.install(monkeypatch, band_at_single_query=how)
    kernels, form = _kernels(), band_form(sinks)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        assert npu_band_probe.band_at_single_query(kernels, form) is False
    assert npu_band_probe.band_edge(kernels, form) == 1
    warned = [r.getMessage() for r in caplog.records]
    expect = "matches neither the windowed reference" if how == "broken" else "refused a band probe's FIA call"
    assert any(expect in m for m in warned), warned
    prob = make_problem([300, 9], block_size=NPU_BLOCK, dtype=DTYPE)
    with pytest.raises(ValueError, match="would attend the whole context"):
        kernels.fused_infer_attention(prob.query, prob.key_cache, prob.value_cache, prob.block_table, [1, 2],
                                      prob.seq_lens, prob.scale, torch.empty(1 << 22, dtype=torch.uint8),
                                      torch.empty_like(prob.query), WINDOW, None, SINKS.to(DTYPE) if sinks else None)
    # within the window such a call is made without the band: exact whatever the device's band does at S 1, and the
    # form probe asks that call, so the windowed form is served (its S=1 band refused is the band probe's answer)
    within = make_problem([20, 9], block_size=NPU_BLOCK, dtype=DTYPE)
    out = torch.empty_like(within.query)
    kernels.fused_infer_attention(within.query, within.key_cache, within.value_cache, within.block_table, [1, 2],
                                  within.seq_lens, within.scale, torch.empty(1 << 24, dtype=torch.uint8), out, WINDOW,
                                  None, SINKS.to(DTYPE) if sinks else None)
    full = torch.empty_like(out)
    kernels.fused_infer_attention(within.query, within.key_cache, within.value_cache, within.block_table, [1, 2],
                                  within.seq_lens, within.scale, torch.empty(1 << 24, dtype=torch.uint8), full, None,
                                  None, SINKS.to(DTYPE) if sinks else None)
    torch.testing.assert_close(out, full, rtol=0, atol=0)
    assert npu_form_probe.refusal(kernels, SHAPE, DTYPE, WINDOW, sinks) is None


@pytest.mark.parametrize("how", ["broken", "refused"])
@pytest.mark.parametrize("sinks", [False, True], ids=["fia", "fia-v2-sinks"])
def test_a_windowed_model_on_a_broken_one_query_token_band_runs_its_long_decode_steps_eagerly(monkeypatch, how,
                                                                                                sinks):
    # The plan falls to what a device that ignores the band at S 1 gets: decode steps with a sequence longer than
    # the window eagerly (through the model's own attention), every other step replayed, each equal to eager.
    fake_torch_npu.install(monkeypatch, band_at_single_query=how)
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK, layer_types=("full", "sliding"),
                      sliding_window=WINDOW, sinks=sinks)
    run_replayed(cfg, band_at_single_query=False)


# ----------------------------------------------------------------------------- query and caches of two half dtypes


PAIRS = [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("query_dtype, cache_dtype", PAIRS, ids=["fp16-query-bf16-cache", "bf16-query-fp16-cache"])
@pytest.mark.parametrize("sinks", [False, True], ids=["fia", "fia-v2-sinks"])
def test_fia_refuses_a_query_and_caches_of_different_half_dtypes_as_the_device(monkeypatch, query_dtype, cache_dtype,
                                                                                sinks):
    # No kernel is built for the pair (c29bc106 fused_infer_attention_score_template_tilingkey.h L125, L337): the
    # kernel and its workspace query fail with the device's RuntimeError, not a docs rule's ValueError.
    if sinks and query_dtype != torch.bfloat16:
        pytest.skip("FIA v2 with sinks takes a bfloat16 query only (L8733): refused before the pair is looked at")
    fake_torch_npu.install(monkeypatch)
    kernels = _kernels()
    prob = make_problem([40, 9], block_size=NPU_BLOCK, dtype=query_dtype)
    cache = prob.key_cache.to(cache_dtype)
    sink = SINKS.to(torch.bfloat16) if sinks else None
    args = (prob.query, cache, cache, prob.block_table, [1, 2], prob.seq_lens, prob.scale)
    with pytest.raises(RuntimeError, match=r"EZ9999: .*key and value of the query's dtype.*L125, L337"):
        kernels.band_workspace_nbytes(*args, prob.query, None, sink)
    with pytest.raises(RuntimeError, match=r"EZ9999: .*key and value of the query's dtype"):
        kernels.launch_fia(*args, torch.empty(1 << 24, dtype=torch.uint8), torch.empty_like(prob.query), None, sink)


@pytest.mark.parametrize("query_dtype, cache_dtype", PAIRS, ids=["fp16-query-bf16-cache", "bf16-query-fp16-cache"])
@pytest.mark.parametrize("policy", ["fia", "pa"])
def test_a_model_whose_caches_are_another_half_dtype_is_refused_at_compile(monkeypatch, query_dtype, cache_dtype,
                                                                           policy):
    # A model run in one half dtype over caches of the other: refused while dynamo traces it (the `ascend.attention`
    # op's own argument check, `ops/validate.py`, at the layer's attention call), before any kernel or workspace query
    # is asked: the device would refuse it at the first capture or warm-up. The npu rules refuse the pair too
    # (`passes/npu_checks.py` naming the layer), for a call that reaches them by another op.
    fake = fake_torch_npu.install(monkeypatch)
    cfg = LlamaConfig(dtype=query_dtype, num_layers=1, num_blocks=64, block_size=NPU_BLOCK)
    model = build(cfg)
    for layer in model.layers:
        layer.attn.key_cache, layer.attn.value_cache = (c.to(cache_dtype) for c in (layer.attn.key_cache,
                                                                                 layer.attn.value_cache))
    fn, artifacts = compiled_model(model, runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4, 8),
                                   kernel_policy=policy, verify=False)
    inputs = PagedBatch(cfg, seed=2, table_width=TABLE).step([30, 7])
    with pytest.raises(Exception, match=rf"key_cache: expected dtype {query_dtype} \(the query's\), got {cache_dtype}"):
        with torch.no_grad():
            fn(**inputs)
    assert not artifacts and not [c.name for c in fake.calls if "attention" in c.name]
    kernel = npu_rules.FIA_KERNEL if policy == "fia" else npu_rules.PA_KERNEL
    with pytest.raises(ValueError, match=rf"caches of the query's dtype .* got a {query_dtype} query and {cache_dtype}"):
        npu_rules.check_attention_dtype(kernel, query_dtype, cache_dtype)
