"""The vLLM integration on vLLM's own code, 0.23.0 or 0.33.0 (`tests/vllm_real.py`): vLLM's Llama and Gemma 2,
its `Attention` layer, `torch.ops.vllm.*`, `set_forward_context` and its mode-1 compile call
(`init_backend` + `model.compile(fullgraph=True)`), on the CPU simulator. Skipped where vLLM does not
import (the main venv); `.ci/run` runs this file in `.venv-vllm` (0.23) and `.venv-vllm33` (0.33)."""
from __future__ import annotations

import collections
import functools
import json
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: .ci/run runs this file in .venv-vllm and .venv-vllm33")

from ascend_compile import torch_support  # noqa: E402
from ascend_compile.integrations import vllm as integration  # noqa: E402
from tests import vllm_real as real  # noqa: E402

LAYER_0, LAYER_1 = real.LAYER.format(0), real.LAYER.format(1)
# decode and mixed steps, batch 1 included, inside, between and above the buckets (4, 8)
STEPS = [([5], [1]), ([9, 17, 4], [1, 1, 1]), ([12], [3]), ([30, 7], [2, 1]), ([6, 8, 10, 12, 14], [1] * 5),
         ([40], [1]), ([50, 60, 70], [3, 2, 4]), ([20] * 8, [1] * 8), ([11, 13], [1, 1])]


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    """(artifacts, backend calls, make): `make(**kwargs)` builds vLLM's model twice, the first
    compiled through vLLM's own mode-1 call with our backend by qualified name, the second eager."""
    artifacts, calls = [], []
    original = integration.backend

    def counting(*args, **kwargs):
        compile_fn = original(*args, on_compiled=artifacts.append, **kwargs)

        def call(gm, example_inputs):
            calls.append(len(example_inputs))
            return compile_fn(gm, example_inputs)
        return call

    monkeypatch.setattr(integration.dynamo_backend, "backend", counting)  # where configured_backend looks it up
    monkeypatch.delenv("ASCEND_COMPILE_OPTIONS", raising=False)
    torch._dynamo.reset()

    def make(hf_config=None, options=None, **config):
        return real.compiled_and_eager(monkeypatch, tmp_path, real.build, hf_config, options, **config)

    yield artifacts, calls, make
    torch._dynamo.reset()


def _equal_to_eager(models, steps) -> None:
    for seq_lens, query_lens in steps:
        step = real.Step(seq_lens, query_lens)
        got, expected = real.run(models[0], step), real.run(models[1], step)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    for got, expected in zip(models[0].caches(), models[1].caches()):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_vllms_prefill_and_chunked_prefill_steps_above_the_buckets_are_served_piecewise(compiled):
    """vLLM's Llama, buckets up to 8 tokens: a 64-token prefill, a chunked-prefill mix (a 40-token chunk
    beside decodes) and a 200-token prefill of three sequences run on captured pieces, vLLM's attention
    (adapted) and its cache writes eagerly between them, each equal to eager (outputs and caches); the
    decode steps in the buckets still replay full graphs; plan.json says which served what."""
    artifacts, _, make = compiled
    models = make(options={"capture_sizes": [4, 8]})
    real.profile_run(models[0], 16)
    steps = [([5, 9], [1, 1]), ([64], [64]), ([100, 20, 9], [40, 1, 1]), ([70, 80, 90], [60, 70, 70]), ([6, 7], [1, 1])]
    _equal_to_eager(models, steps)
    (art,) = artifacts
    assert art.stats["replays"] == 2 and art.stats["piecewise_steps"] == 3 and art.stats["eager_fallbacks"] == 0
    # piecewise sizes from the capture sizes in force up to vLLM's max_num_batched_tokens (2048 by default
    # at this max_model_len), the most tokens its scheduler puts in a step
    from vllm.config import SchedulerConfig

    largest = SchedulerConfig(max_model_len=256, is_encoder_decoder=False).max_num_batched_tokens
    assert art.config.piecewise_sizes == (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048) and largest == 2048
    assert {str(k) for k, _ in art.piecewise} == {"p64", "p256"}
    plan = art.describe()
    reasons = set(plan["piecewise"]["eager_nodes"].values())
    assert "attention kernel: takes the step's lengths" in reasons
    assert plan["served"]["steps"] == {"decode": {"full": 2}, "prefill": {"piecewise": 2}, "mixed": {"piecewise": 1}}


def test_vllms_llama_through_vllms_compile_call_equals_eager_with_one_artifact(compiled):
    """The profile run (no metadata, T=16) is handed over static; it is traced again general, so one
    dynamo graph and one artifact serve every step: decode and mixed, batch 1 included."""
    artifacts, calls, make = compiled
    models = make(options={"capture_sizes": [4, 8]})
    real.profile_run(models[0], 16)
    _equal_to_eager(models, STEPS)
    assert len(calls) == 2  # the profile run's static trace, then its general retrace
    assert len(artifacts) == 1
    stats = artifacts[0].stats
    assert stats["steps"] == len(STEPS)
    # above the largest bucket (8 tokens): the 9-token mixed step runs piecewise (vLLM's own attention ops,
    # adapted, between the pieces); every other step replays
    assert stats["replays"] == len(STEPS) - 1 and stats["piecewise_steps"] == 1 and stats["eager_fallbacks"] == 0



def test_a_layers_cache_storage_moved_in_place_is_bound_anew(compiled):
    """`kv_cache.data = ...` (the same tensor object, another storage: a runtime re-allocating its caches
    in place, as around vLLM's sleep mode) between steps: the binder's per-step key and value views are
    split again from the new storage and the graphs holding the old one captured again; every step, and
    every cache (the new storage), equal to eager."""
    artifacts, _, make = compiled
    models = make(options={"capture_sizes": [4, 8]})
    real.profile_run(models[0], 16)
    _equal_to_eager(models, STEPS[:3])
    old = []
    for model in models:
        for layer in model.layers.values():
            old.append(layer.kv_cache)
            layer.kv_cache.data = layer.kv_cache.data.clone()
    before = [t.clone() for t in models[0].caches()]
    _equal_to_eager(models, STEPS[3:])
    assert all(not torch.equal(a, b) for a, b in zip(models[0].caches(), before))  # the steps wrote the new storage
    assert artifacts[0].stats["recaptures"] >= 1


def test_torch_compile_dynamic_batch_3_then_batch_1_equals_eager(monkeypatch, tmp_path):
    """Under `torch.compile(dynamic=True)` a batch-3 decode step is traced dynamic with sizes 0 and 1
    specialised; batch 1 recompiles the frame into a static trace, which the backend has dynamo trace
    again general. Automatic dynamic gave input_ids and positions distinct symbols in that retrace
    (no duck shaping for sizes it saw change), and vLLM's rotary `query.view(positions.shape[0], -1,
    head_size)` kept the unpadded one: capturing b4.decode failed (issue 36)."""
    from ascend_compile.config import CompileConfig

    monkeypatch.delenv("ASCEND_COMPILE_OPTIONS", raising=False)
    models = []
    for i in range(2):
        (tmp_path / f"m{i}").mkdir()
        models.append(real.build(real.vllm_config(tmp_path / f"m{i}"), seed=3))
    artifacts = []
    torch._dynamo.reset()
    compile_fn = integration.backend(CompileConfig(max_model_len=256, capture_sizes=(4, 8)), on_compiled=artifacts.append)
    fn = torch.compile(models[0].model, backend=compile_fn, dynamic=True)
    try:
        steps = [([9, 17, 4], [1, 1, 1]), ([5], [1]), ([12], [3]), ([6, 7], [1, 1]), ([21], [1])]
        for seq_lens, query_lens in steps:
            step = real.Step(seq_lens, query_lens)
            got, expected = real.run(models[0], step, lambda *args: fn(*args)), real.run(models[1], step)
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        for got, expected in zip(models[0].caches(), models[1].caches()):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()
    stats = collections.Counter()
    for art in artifacts:
        stats.update(art.stats)
        assert not art.signature.specialized  # input_ids and positions share the token symbol
    assert stats["replays"] == len(steps) and stats["eager_fallbacks"] == 0

def _direct(model):
    """The direct dispatcher in front of vLLM's compiled model (`fast_path.DirectCall`)."""
    direct = model.model._compiled_call_impl
    assert isinstance(direct, integration.fast_path.DirectCall), type(direct)
    return direct


def test_steps_after_the_first_compiled_one_skip_dynamo_and_a_failed_check_goes_through_it(compiled):
    """The fast path is the default: after the first compiled step (through vLLM's compiled call) and
    one through dynamo to arm the route, every step goes straight to the graph, equal to eager. A
    check that fails sends that step through dynamo's guards (a hook registered anywhere moves torch's
    hook count), and a weight assigned anew (on both models) is seen: the step goes through dynamo and
    dynamo compiles the frame again, still equal to eager."""
    artifacts, calls, make = compiled
    models = make(options={"capture_sizes": [4, 8]})
    real.profile_run(models[0], 16)
    _equal_to_eager(models, STEPS)
    if not torch_support.armed_fast_paths()["vllm_fast_path"]:  # not proven on this torch: dynamo's path
        assert not isinstance(models[0].model._compiled_call_impl, integration.fast_path.DirectCall)
        return
    direct = _direct(models[0])
    assert direct.dynamo_calls == 1  # the step that armed the route; the first compiled step came before
    assert artifacts[0].config.frozen_parameters  # the integrations' default
    handle = torch.nn.Linear(1, 1).register_forward_hook(lambda *args: None)  # not on the model: harmless
    _equal_to_eager(models, STEPS[:2])
    assert direct.dynamo_calls == 2  # the first step after it, which armed the route again
    assert len(artifacts) == 1 and len(calls) == 2  # dynamo's guards passed: nothing compiled again
    handle.remove()
    for model in models:
        norm = model.model.model.norm
        norm.weight = torch.nn.Parameter(torch.full_like(norm.weight, 0.5), requires_grad=False)
    _equal_to_eager(models, STEPS[:3])
    assert direct.dynamo_calls == 3  # dynamo compiled the frame again (its guards on the module tree)


def test_dispatch_dynamo_keeps_every_step_on_dynamos_guards(compiled):
    artifacts, calls, make = compiled
    models = make(options={"capture_sizes": [4, 8], "dispatch": "dynamo", "frozen_parameters": False})
    real.profile_run(models[0], 16)
    _equal_to_eager(models, STEPS[:3])
    assert not isinstance(models[0].model._compiled_call_impl, integration.fast_path.DirectCall)
    assert not artifacts[0].config.frozen_parameters


def test_the_guards_of_vllms_frame_are_all_of_kinds_the_fast_path_stands_in_for(compiled):
    """Every guard dynamo keeps on vLLM's Llama frame is one `fast_path.guard_refusal` accepts, and
    the same policy refuses the frame's guards once one of them is given another kind."""
    artifacts, calls, make = compiled
    models = make(options={"capture_sizes": [4, 8]})
    real.profile_run(models[0], 16)
    _equal_to_eager(models, STEPS[:2])
    forward = type(models[0].model).forward
    (entry,) = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(forward.__code__)
    refusal = integration.fast_path.guard_refusal(entry.guard_manager)
    print(f"torch {torch.__version__}: the guard policy says {refusal!r}")
    if torch_support.torch_release() in ((2, 10), (2, 11)):  # why the fast path is not armed there
        assert refusal == ("dynamo guards L['positions'] with NO_HASATTR, which no check of the direct path "
                           "stands in for")
    else:
        assert refusal is None
    kinds = {kind for kind, _, _ in integration.fast_path.guards_of(entry.guard_manager.root)}
    assert {"TENSOR_MATCH", "GLOBAL_STATE", "LAMBDA_GUARD", "ID_MATCH"} <= kinds


def test_max_model_len_and_capture_sizes_come_from_vllms_config(compiled):
    artifacts, calls, make = compiled
    models = make(max_model_len=128)
    real.profile_run(models[0])
    _equal_to_eager(models, STEPS[:2])
    assert artifacts[0].config.max_model_len == 128  # vLLM's; no ASCEND_COMPILE_OPTIONS


def test_our_options_override_vllms(compiled):
    artifacts, calls, make = compiled
    models = make(options={"max_model_len": 64, "capture_sizes": [2, 4]})
    real.profile_run(models[0])
    _equal_to_eager(models, STEPS[:1])
    assert artifacts[0].config.max_model_len == 64 and artifacts[0].config.capture_sizes == (2, 4)


def test_a_request_longer_than_our_max_model_len_runs_as_traced_not_failing_the_engine(compiled, caplog):
    artifacts, calls, make = compiled
    models = make(options={"max_model_len": 64, "capture_sizes": [4, 8]})
    real.profile_run(models[0])
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        _equal_to_eager(models, [([20, 30], [1, 1]), ([100, 30], [1, 1]), ([120], [1]), ([21, 31], [1, 1])])
    assert artifacts[0].stats["replays"] == 2  # the two short steps
    warnings = [r.getMessage() for r in caplog.records if "longer than max_model_len=64" in r.getMessage()]
    assert len(warnings) == 1  # logged once


def test_list_form_metadata_keeps_the_graph_uncompiled_and_says_why_once(compiled, caplog, monkeypatch):
    """DBO's list-form metadata: the step runs as traced (vLLM's ops), with one warning naming why."""
    artifacts, calls, make = compiled
    models = make()
    real.profile_run(models[0])
    metadata = real.Step.metadata

    def as_list(step, model):
        attn_metadata, slots = metadata(step, model)
        return ([attn_metadata] if model is models[0] else attn_metadata), slots

    monkeypatch.setattr(real.Step, "metadata", as_list)
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        for seq_lens in ([5], [6], [7]):
            real.run(models[0], real.Step(seq_lens, [1]))  # vLLM's own ops, as traced
    assert artifacts == []
    warnings = [r.getMessage() for r in caplog.records if "DBO / micro-batching" in r.getMessage()]
    assert len(warnings) == 1


# metadata fields vLLM 0.33 sets for attention other than causal (on 0.23, which lacks them, set as 0.33's
# builder sets them)
NON_CAUSAL_STEPS = {
    "causal": lambda step: torch.ones(len(step.seq_lens), dtype=torch.int32),  # per-request causality
    "mm_prefix_query_range_tensor": lambda step: torch.full((step.num_tokens, 2), -1, dtype=torch.int32),
    "rswa_prefix_lens": lambda step: torch.tensor(step.seq_lens, dtype=torch.int32),
}


@pytest.mark.parametrize("field", sorted(NON_CAUSAL_STEPS))
def test_a_step_asking_for_other_than_causal_attention_runs_as_traced_and_says_why_once(compiled, caplog, monkeypatch,
                                                                                        field):
    """After the compile, a step whose metadata has vLLM 0.33's per-request `causal`, PrefixLM ranges or R-SWA
    prompt lengths runs as traced (vLLM's own op: what the graph would compute wrongly), logged once; the
    steps around it replay. At the first compiled step the same metadata is refused, naming the layer."""
    artifacts, calls, make = compiled
    models = make(options={"capture_sizes": [4, 8]})
    real.profile_run(models[0])
    metadata = real.Step.metadata
    marked = {"on": False}

    def with_field(step, model):
        attn_metadata, slots = metadata(step, model)
        if marked["on"]:
            meta = next(iter(attn_metadata.values()))
            setattr(meta, field, NON_CAUSAL_STEPS[field](step))
        return attn_metadata, slots

    monkeypatch.setattr(real.Step, "metadata", with_field)
    _equal_to_eager(models, STEPS[:1])
    marked["on"] = True
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        _equal_to_eager(models, [([7], [1]), ([8], [1])])
    marked["on"] = False
    _equal_to_eager(models, STEPS[1:2])
    assert len(artifacts) == 1 and artifacts[0].stats["steps"] == 2 and artifacts[0].stats["replays"] == 2
    warnings = [r.getMessage() for r in caplog.records if f"attn_metadata.{field}" in r.getMessage()]
    assert len(warnings) == 1 and f"layer {LAYER_0!r}'s metadata asks for" in warnings[0]

    fresh = make(options={"capture_sizes": [4, 8]})[0]
    real.profile_run(fresh)
    marked["on"] = True
    with pytest.raises(Exception, match=rf"vLLM attention layer '{LAYER_0}': .*attn_metadata\.{field}"):
        real.run(fresh, real.Step([7], [1]))


# ---------------------------------------------------------------- attention features served

WINDOW = 32
# every sequence longer than the window: decode and mixed, batch 1 included
LONG_STEPS = [([40], [1]), ([50, 60, 70], [1, 1, 1]), ([100], [3]), ([45, 80], [2, 1]), ([33, 90, 120, 64], [1] * 4),
              ([130], [1])]


def _feature_matters(models, step, layers, **off) -> None:
    """The eager model's output for `step` changes when `layers`' impls are given `off` (the feature
    switched off): the steps exercise the feature. The step's cache writes are the same again."""
    impls = [models[1].layers[name].impl for name in layers]
    kept = [{name: getattr(impl, name) for name in off} for impl in impls]
    expected = real.run(models[1], step)
    for impl in impls:
        vars(impl).update(off)
    try:
        plain = real.run(models[1], step)
    finally:
        for impl, values in zip(impls, kept):
            vars(impl).update(values)
    assert (plain - expected).abs().max() > 1e-3


def _kernel_features(artifact) -> list:
    return [[kernel.get("features") for kernel in graph["kernels"]] for graph in artifact.describe()["graphs"].values()]


def test_a_sliding_window_llama_layer_is_served_equal_to_eager(compiled):
    """vLLM's Llama takes sliding layers from `layer_types` (llama.py, `per_layer_sliding_window`);
    FlashAttentionImpl keeps `(W - 1, 0)`, which the rewrite passes on as `window=W`."""
    artifacts, calls, make = compiled
    hf = dict(real.TINY_LLAMA, layer_types=["full_attention", "sliding_attention"], sliding_window=WINDOW)
    models = make(hf_config=hf, options={"capture_sizes": [4, 8]})
    assert models[0].layers[LAYER_1].impl.sliding_window == (WINDOW - 1, 0)
    real.profile_run(models[0])
    _equal_to_eager(models, LONG_STEPS)
    assert len(artifacts) == 1 and artifacts[0].stats["replays"] == len(LONG_STEPS)
    window = {"window": WINDOW, "soft_cap": None, "sinks": False}
    assert all(kernels == [None, window] for kernels in _kernel_features(artifacts[0]))
    _feature_matters(models, real.Step(*LONG_STEPS[-1]), [LAYER_1], sliding_window=(-1, -1))


def test_gemma2s_soft_capped_layers_are_served_equal_to_eager(compiled):
    """Gemma 2's `attn_logit_softcapping` reaches FlashAttentionImpl as `logits_soft_cap`, and the
    rewrite passes it on; its sliding layer (`layer_types`) gets its window too."""
    artifacts, calls, make = compiled
    models = make(hf_config=real.gemma2(attn_logit_softcapping=1.5, layer_types=["full_attention",
                                                                                 "sliding_attention"]),
                  options={"capture_sizes": [4, 8]})
    real.profile_run(models[0])
    _equal_to_eager(models, LONG_STEPS)
    assert len(artifacts) == 1 and artifacts[0].stats["replays"] == len(LONG_STEPS)
    capped = {"window": None, "soft_cap": 1.5, "sinks": False}
    assert all(kernels == [capped, dict(capped, window=WINDOW)] for kernels in _kernel_features(artifacts[0]))
    _feature_matters(models, real.Step(*LONG_STEPS[-1]), [LAYER_0, LAYER_1], logits_soft_cap=0)


def test_a_layer_with_sinks_is_served_equal_to_eager(compiled):
    """gpt-oss passes `Attention(sinks=...)`, which FlashAttentionImpl keeps as `impl.sinks` and the
    layer as `has_sink`. gpt-oss itself builds here but its FusedMoE forward needs a kernel backend
    (`UnquantizedFusedMoEMethod` gets no `moe_kernel` on this platform), so vLLM's Llama gets the
    sinks gpt-oss's constructor would give its layer 1."""
    artifacts, calls, make = compiled
    models = make(options={"capture_sizes": [4, 8]})
    for model in models:
        layer = model.layers[LAYER_1]
        layer.impl.sinks, layer.has_sink = torch.tensor([3.0, 6.0, 4.0, 5.0]), True
    real.profile_run(models[0])
    _equal_to_eager(models, LONG_STEPS)
    assert len(artifacts) == 1 and artifacts[0].stats["replays"] == len(LONG_STEPS)
    sinks = {"window": None, "soft_cap": None, "sinks": True}
    assert all(kernels == [None, sinks] for kernels in _kernel_features(artifacts[0]))
    _feature_matters(models, real.Step(*LONG_STEPS[-1]), [LAYER_1], sinks=None)


# ---------------------------------------------------------------- refused at compile time


def _refused_at_the_profile_run(models, match: str) -> None:
    with pytest.raises(Exception, match=match) as err:
        real.profile_run(models[0])
    assert "is not supported by ascend_graph" in str(err.value)


def test_a_quantized_kv_cache_is_refused_at_compile_time(compiled, monkeypatch):
    """vLLM 0.33's FlashAttentionImpl takes an fp8 cache where its FlashAttention does (FA3 on SM90,
    FA4): this platform answers as such a GPU does (0.23's refuses it only at selection, not here)."""
    artifacts, calls, make = compiled
    if hasattr(real.flash_attn, "flash_attn_supports_kv_cache_dtype"):
        monkeypatch.setattr(real.flash_attn, "flash_attn_supports_kv_cache_dtype", lambda *args, **kwargs: True)
    models = make(cache_dtype="fp8")
    _refused_at_the_profile_run(models, rf"vLLM attention layer '{LAYER_0}': quantized KV cache "
                                        rf"\(kv_cache_dtype='fp8'\)")


def test_another_attention_backend_is_refused_by_name_at_compile_time(compiled, monkeypatch):
    artifacts, calls, make = compiled
    monkeypatch.setattr(real.CpuFlashAttnPlatform, "attention_backend",
                        "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend")
    models = make()
    _refused_at_the_profile_run(models, rf"'{LAYER_0}': attention backend "
                                        rf"vllm.v1.attention.backends.flex_attention.FlexAttentionBackend "
                                        rf"\(get_name\(\) 'FLEX_ATTENTION'\)")


def test_a_layer_built_with_sinks_its_impl_does_not_hold_is_refused_at_compile_time(compiled):
    """vLLM's `Attention` says `has_sink` when built with sinks; an impl holding none (`impl.sinks`
    None: another impl, or a version keeping them elsewhere) would be served as plain attention, its
    sinks dropped: refused naming the layer."""
    artifacts, calls, make = compiled
    models = make()
    layer = models[0].layers[LAYER_1]
    assert layer.has_sink is False and layer.impl.sinks is None  # vLLM's as built without sinks
    layer.has_sink = True
    _refused_at_the_profile_run(models, rf"'{LAYER_1}': attention sinks the impl does not hold "
                                        rf"\(layer.has_sink, impl.sinks None\)")


def test_a_kv_transfer_connector_is_refused_at_compile_time(compiled, monkeypatch):
    """vLLM's `maybe_transfer_kv_layer` calls the connector around `unified_attention_with_output`."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    artifacts, calls, make = compiled
    models = make()
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", object())
    _refused_at_the_profile_run(models, "a KV-transfer connector")


# ---------------------------------------------------------------- vLLM-Ascend: the plug-in


class NPUModelRunner:
    """A stand-in for vLLM-Ascend's `NPUModelRunner` as far as the plug-in touches it (its
    `vllm_config`, `load_model` setting `self.model`): the real one does not import here (docs/vllm.md).
    The model it loads is vLLM's own."""

    def __init__(self, vllm_config, seed: int = 3) -> None:
        self.vllm_config, self.seed = vllm_config, seed
        self.model = None

    def load_model(self) -> None:
        self.loaded = real.build(self.vllm_config, seed=self.seed)
        self.model = self.loaded.model


@pytest.fixture
def ascend_runner(monkeypatch):
    """`vllm_ascend.worker.model_runner_v1` holding the stand-in runner class (a fresh class per test)."""
    import sys
    import types

    module = types.ModuleType("vllm_ascend.worker.model_runner_v1")
    module.NPUModelRunner = type("NPUModelRunner", (NPUModelRunner,), {})
    for name in ("vllm_ascend", "vllm_ascend.worker"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.NPUModelRunner


def _plugin():
    """Our `vllm.general_plugins` entry point, as vLLM's plugin loader finds it (package metadata)."""
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(group=DEFAULT_PLUGINS_GROUP)
    assert "ascend_compile" in plugins, f"entry point not installed: {sorted(plugins)}"
    return plugins["ascend_compile"]


def test_the_plugin_compiles_the_model_after_load_model(compiled, ascend_runner, monkeypatch, tmp_path, caplog):
    """Opted in, the entry point wraps `NPUModelRunner.load_model`, which then compiles vLLM's model
    with our backend, although the config's compilation mode is NONE (what NPUPlatform resets it to):
    the mode no longer decides. One artifact serves the steps, equal to eager."""
    artifacts = compiled[0]
    monkeypatch.setenv("ASCEND_COMPILE_VLLM_ASCEND", "1")
    monkeypatch.setenv("ASCEND_COMPILE_OPTIONS", json.dumps({"capture_sizes": [4, 8]}))
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        _plugin()()
        config = real.vllm_config(tmp_path, compile_mode=0)  # mode NONE, cudagraph_mode NONE
        runner = ascend_runner(config)
        runner.load_model()
    assert any("ascend_graph in use for vLLM-Ascend's NPUModelRunner" in r.getMessage() for r in caplog.records)
    (tmp_path / "eager").mkdir()
    eager = real.build(real.vllm_config(tmp_path / "eager"), seed=3)
    real.profile_run(runner.loaded)
    _equal_to_eager([runner.loaded, eager], STEPS[:4])
    assert len(artifacts) == 1 and artifacts[0].stats["replays"] == 4
    assert artifacts[0].config.max_model_len == 256  # from the runner's vllm_config


def test_the_plugin_says_why_it_is_not_in_use(ascend_runner, monkeypatch, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        _plugin()()  # not opted in
    assert "ASCEND_COMPILE_VLLM_ASCEND is not 1" in caplog.text
    assert not hasattr(ascend_runner.load_model, "_ascend_compile_wrapped")
    monkeypatch.setenv("ASCEND_COMPILE_VLLM_ASCEND", "1")
    _plugin()()
    config = real.vllm_config(tmp_path, compile_mode=0)
    config.compilation_config.cudagraph_mode = type(config.compilation_config.cudagraph_mode).FULL
    runner = ascend_runner(config)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        runner.load_model()
    assert "vLLM-Ascend captures ACL graphs itself (compilation_config.cudagraph_mode=FULL)" in caplog.text
    assert runner.model._compiled_call_impl is None  # not compiled (nn.Module.compile sets it)


def test_the_plugin_without_vllm_ascend_says_so(monkeypatch, caplog):
    monkeypatch.setenv("ASCEND_COMPILE_VLLM_ASCEND", "1")
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        _plugin()()
    assert "vllm_ascend.worker.model_runner_v1.NPUModelRunner does not import" in caplog.text


# ---------------------------------------------------------------- graph memory before the KV cache is sized

BIGGER = {**real.TINY_LLAMA, "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
          "num_key_value_heads": 4}
SIZES = [4, 8, 16, 32]


@pytest.fixture
def small_segments(monkeypatch):
    """The simulator's pools in 64 KiB segments (not 64 MiB), so that the graph pool's size follows
    what the captures allocate rather than one segment."""
    import ascend_compile.runtime.sim as sim

    class SmallSegments(sim.SimRuntime):
        def __init__(self, **kwargs):
            super().__init__(segment_bytes=1 << 16, **kwargs)

    monkeypatch.setattr(sim, "SimRuntime", SmallSegments)  # where create_runtime looks it up


def _handed_over(since):
    from ascend_compile.integrations.vllm import memory

    graphs = memory.tracked(since)
    assert len(graphs) == 1, graphs
    return graphs[0]


def test_the_estimate_made_at_the_profile_run_bounds_the_graph_memory_capture_all_takes(compiled, small_segments):
    """The figure made from the profiling run's graph (no metadata, no KV cache, nothing compiled)
    is at least what every decode graph, captured by `capture_all`, then takes (workspaces, static
    buffers, the measured simulator pool), and that is at least 0.8x the figure; so is what every
    graph takes once the mixed ones are captured too."""
    from ascend_compile.integrations.vllm import memory

    artifacts, _, make = compiled
    since = memory.handed_over()
    # full graphs only: the piecewise graphs' part of the figure is the next test's
    models = make(hf_config=BIGGER, options={"capture_sizes": SIZES, "capture_all": True, "piecewise_sizes": []})
    real.profile_run(models[0], 16)
    graph = _handed_over(since)
    figure = memory.estimate(graph, models[0].config)
    assert figure.graphs == 2 * len(SIZES)  # every decode graph, and a mixed one each (their decode kernel is PA)
    assert figure.pool > 8 * (1 << 16)  # the pool part is more than a rounding
    _equal_to_eager(models, STEPS[:2])
    assert artifacts[0].stats["captures"] == len(SIZES)
    measured = sum(memory.graph_memory(artifacts[0].memory_report()).values())
    assert 0.8 * figure.total <= measured <= figure.total, (measured, figure)
    # then every bucket's mixed graph, smallest first (the order least kind to a shared pool)
    _equal_to_eager(models, [([20] * (b - 1), [2] + [1] * (b - 2)) for b in SIZES])
    assert artifacts[0].stats["captures"] == 2 * len(SIZES)
    parts = memory.graph_memory(artifacts[0].memory_report())
    assert (parts["workspaces"], parts["buffers"]) == (figure.workspaces, figure.buffers)  # the compile's own
    measured = sum(parts.values())
    assert 0.8 * figure.total <= measured <= figure.total, (measured, figure)


def test_the_estimate_covers_the_piecewise_graphs_of_the_largest_step_vllm_schedules(compiled, small_segments):
    """With piecewise graphs, the figure adds the pieces of the largest size (their pool peak) and every
    size's static buffers: after `capture_all` it bounds what the decode graphs take; after a prefill
    step of the largest size, whose pieces are captured into the same pool, it bounds what every graph
    takes, and that is at least 0.8x the figure."""
    from ascend_compile.integrations.vllm import memory

    artifacts, _, make = compiled
    since = memory.handed_over()
    models = make(hf_config=BIGGER, options={"capture_sizes": SIZES, "capture_all": True,
                                             "piecewise_sizes": [64, 1024]})
    real.profile_run(models[0], 16)
    figure = memory.estimate(_handed_over(since), models[0].config)
    _equal_to_eager(models, STEPS[:2])
    assert sum(memory.graph_memory(artifacts[0].memory_report()).values()) <= figure.total
    _equal_to_eager(models, [([250] * 4, [250] * 4)])  # 1000 tokens: the largest piecewise size
    art = artifacts[0]
    assert art.stats["piecewise_steps"] == 1 and {str(k) for k, _ in art.piecewise} == {"p1024"}
    parts = memory.graph_memory(art.memory_report())
    measured = sum(parts.values())
    assert 0.8 * figure.total <= measured <= figure.total, (parts, figure)


class StandInWorker:
    """vLLM's `Worker` as far as `determine_available_memory` goes (0.23 / 0.33
    `vllm/v1/worker/gpu_worker.py`: the explicit `kv_cache_memory_bytes` path runs `profile_run` and
    returns it; else `profile_run` under the profiler, then `peak_activation_memory` and
    `available_kv_cache_memory_bytes` = requested - non-KV memory, returned). vLLM's module does not
    import here (its structured-output imports need xgrammar and tvm_ffi, not installed), so the
    device figures are made up; the profiling run is vLLM's own forward, where dynamo hands the graph over."""

    requested, non_kv, peak = 72 << 30, 3 << 30, 1 << 30

    def __init__(self, model):
        self.vllm_config, self.cache_config, self.model = model.config, model.config.cache_config, model

    def determine_available_memory(self) -> int:
        if kv_cache_memory_bytes := self.cache_config.kv_cache_memory_bytes:
            real.profile_run(self.model, 16)
            return kv_cache_memory_bytes
        real.profile_run(self.model, 16)
        self.peak_activation_memory = self.peak
        self.available_kv_cache_memory_bytes = self.requested - self.non_kv
        return int(self.available_kv_cache_memory_bytes)


def _worker_class(monkeypatch, model):
    """A fresh stand-in worker class, named as vLLM's `parallel_config.worker_cls` (as the CUDA
    platform names vLLM's `Worker`)."""
    import sys
    import types

    module = types.ModuleType("standin_worker")
    module.Worker = type("Worker", (StandInWorker,), {})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    model.config.parallel_config.worker_cls = "standin_worker.Worker"
    return module.Worker


def test_the_worker_sizes_the_kv_cache_with_our_graph_memory_taken_out(compiled, small_segments, monkeypatch, caplog):
    """The worker class vLLM runs, wrapped when our backend is configured in it, answers with the
    figure estimated from its profiling run taken out, and keeps the figures vLLM's `--kv-cache-memory`
    suggestion and 0.33's startup plan are built from consistent; the captures then take at most it."""
    from ascend_compile.integrations.vllm import memory

    artifacts, _, make = compiled
    monkeypatch.delenv(memory.ENV, raising=False)
    # full graphs only: the piecewise graphs' part of the figure is the next test's
    models = make(hf_config=BIGGER, options={"capture_sizes": SIZES, "capture_all": True, "piecewise_sizes": []})
    cls = _worker_class(monkeypatch, models[0])
    torch._dynamo.reset()
    models[0].model._compiled_call_impl = None
    real.compile_as_vllm(models[0])  # init_backend under the config naming the worker class: wrapped
    since = memory.handed_over()
    worker = cls(models[0])
    available = cls.determine_available_memory(worker)
    figure = memory.estimate(_handed_over(since), models[0].config).total
    assert figure > 0 and available == cls.requested - cls.non_kv - figure
    assert worker.available_kv_cache_memory_bytes == available
    assert worker.peak_activation_memory == cls.peak + figure
    _equal_to_eager(models, STEPS[:2])
    assert artifacts[-1].stats["captures"] == len(SIZES)
    measured = sum(memory.graph_memory(artifacts[-1].memory_report()).values())
    assert 0.8 * figure <= measured <= figure
    # a graph handed over after the KV cache was sized (dynamo compiling again) is in no reservation: said so
    torch._dynamo.reset()
    models[0].model._compiled_call_impl = None
    real.compile_as_vllm(models[0])
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        _equal_to_eager(models, STEPS[:1])
    assert "a vLLM graph handed over after the KV cache was sized" in caplog.text


def test_a_user_set_kv_cache_size_an_override_and_too_little_memory(compiled, small_segments, monkeypatch, caplog):
    """`kv_cache_memory_bytes` set by the user is answered unchanged (a warning gives our figure);
    `ASCEND_COMPILE_GRAPH_MEMORY` bytes replace the estimate (0: nothing taken out); a figure above
    what vLLM has for the KV cache fails start-up naming it."""
    from ascend_compile.integrations.vllm import kv_budget, memory

    _, _, make = compiled
    models = make(hf_config=BIGGER, options={"capture_sizes": SIZES})
    cls = _worker_class(monkeypatch, models[0])
    kv_budget.wrap(cls)
    worker = cls(models[0])

    def answer():
        torch._dynamo.reset()
        models[0].model._compiled_call_impl = None
        real.compile_as_vllm(models[0])
        return cls.determine_available_memory(worker)

    worker.cache_config.kv_cache_memory_bytes = 5 << 30
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        assert answer() == 5 << 30
    assert "kv_cache_memory_bytes=5368709120 is set" in caplog.text
    worker.cache_config.kv_cache_memory_bytes = None
    for value, taken in (("0", 0), ("1048576", 1 << 20)):
        monkeypatch.setenv(memory.ENV, value)
        assert answer() == cls.requested - cls.non_kv - taken
    monkeypatch.setenv(memory.ENV, str(80 << 30))
    with pytest.raises(ValueError, match="our graphs need 85899345920 bytes"):
        answer()
    monkeypatch.setenv(memory.ENV, "lots")
    with pytest.raises(ValueError, match="ASCEND_COMPILE_GRAPH_MEMORY: expected 'auto' or a number of bytes"):
        memory.override()
    monkeypatch.delenv(memory.ENV)

    def broken(graph, vllm_config):
        raise KeyError("a metadata field the planning context lacks")

    monkeypatch.setattr(memory, "estimate", broken)  # an estimate that fails leaves vLLM's answer, says why
    with caplog.at_level(logging.WARNING, logger="ascend_compile"):
        assert answer() == cls.requested - cls.non_kv
    assert "no graph memory estimate (KeyError" in caplog.text and "set ASCEND_COMPILE_GRAPH_MEMORY" in caplog.text


def test_vllm_033s_startup_plan_is_answered_unchanged(compiled, small_segments, monkeypatch, caplog):
    """vLLM 0.33's `maybe_apply_startup_plan` sets `kv_cache_memory_bytes` from a plan an earlier boot
    saved, inside `determine_available_memory`: that plan was saved from `peak_activation_memory`,
    which already counted our graphs, so the answer is not reduced again."""
    from ascend_compile.integrations.vllm import kv_budget

    _, _, make = compiled
    models = make(hf_config=BIGGER, options={"capture_sizes": SIZES})

    class PlannedWorker(StandInWorker):
        def determine_available_memory(self) -> int:
            self.cache_config.kv_cache_memory_bytes = 7 << 30  # the saved plan, applied
            return super().determine_available_memory()

    models[0].config.cache_config.kv_cache_memory_bytes = None
    kv_budget.wrap(PlannedWorker)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        assert PlannedWorker.determine_available_memory(PlannedWorker(models[0])) == 7 << 30
    assert "vLLM applied its startup plan (kv_cache_memory_bytes=7516192768)" in caplog.text


def test_the_plugin_reserves_graph_memory_in_vllm_ascends_npu_worker(compiled, ascend_runner, small_segments,
                                                                     monkeypatch, tmp_path):
    """On vLLM-Ascend the worker class is `NPUWorker` (`parallel_config.worker_cls`, set by
    NPUPlatform): the plug-in's compile configures our backend, which wraps it; its answer (no
    `available_kv_cache_memory_bytes`, as NPUWorker's) has our figure taken out."""
    import sys
    import types

    from ascend_compile.integrations.vllm import memory

    monkeypatch.setenv("ASCEND_COMPILE_VLLM_ASCEND", "1")
    monkeypatch.setenv("ASCEND_COMPILE_OPTIONS", json.dumps({"capture_sizes": SIZES}))
    module = types.ModuleType("vllm_ascend.worker.worker")

    class NPUWorker(StandInWorker):
        def determine_available_memory(self) -> int:
            real.profile_run(self.model, 16)
            self.peak_activation_memory = self.peak
            return self.requested - self.non_kv

    module.NPUWorker = NPUWorker
    monkeypatch.setitem(sys.modules, module.__name__, module)
    _plugin()()
    config = real.vllm_config(tmp_path, compile_mode=0, hf_config=BIGGER)
    config.parallel_config.worker_cls = "vllm_ascend.worker.worker.NPUWorker"
    runner = ascend_runner(config)
    runner.load_model()
    since = memory.handed_over()
    worker = NPUWorker(runner.loaded)
    available = NPUWorker.determine_available_memory(worker)
    figure = memory.estimate(_handed_over(since), config).total
    assert figure > 0 and available == NPUWorker.requested - NPUWorker.non_kv - figure
    assert worker.peak_activation_memory == NPUWorker.peak + figure
