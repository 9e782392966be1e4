"""The vLLM integration's MLA binding on vLLM's own DeepSeek-V2, 0.23.0 or 0.33.0 (`tests/vllm_mla_real.py`): its
`MLAAttention` layer, `torch.ops.vllm.unified_mla_*`, TRITON_MLA's metadata builder, the combined
latent cache, and vLLM's mode-1 compile call, on the CPU simulator. vLLM runs decodes absorbed and
prefills un-absorbed (per-head K/V from `kv_b_proj`); the compiled graph runs every token through
`ascend.mla_attention`, absorbed: equal to eager says the two forms agree. Skipped where vLLM does not
import (the main venv)."""
from __future__ import annotations

import collections

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: .ci/run runs this file in .venv-vllm and .venv-vllm33")

from ascend_compile.integrations import vllm as integration  # noqa: E402
from tests import vllm_mla_real as mla  # noqa: E402
from tests import vllm_real as real  # noqa: E402

LAYER_0 = mla.LAYER.format(0)
# decodes first, as vLLM's runner orders MLA batches: decode, mixed (a fresh prefill, a chunked
# prefill with cached context), batch 1 included, inside, between and above the buckets (4, 8)
STEPS = [([5], [1]), ([9, 17, 4], [1, 1, 1]), ([12], [3]), ([7, 30], [1, 2]), ([6, 8, 10, 12, 14], [1] * 5),
         ([40], [1]), ([7, 8, 20], [1, 3, 5]), ([20] * 8, [1] * 8), ([11, 13], [1, 1])]


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    """(artifacts, make): `make(**kwargs)` builds vLLM's DeepSeek-V2 twice on TRITON_MLA, the first
    compiled through vLLM's own mode-1 call with our backend by qualified name, the second eager."""
    artifacts = []
    original = integration.backend
    monkeypatch.setattr(integration.dynamo_backend, "backend",  # where configured_backend looks it up
                        lambda *a, **k: original(*a, on_compiled=artifacts.append, **k))
    monkeypatch.setattr(real.CpuFlashAttnPlatform, "attention_backend", mla.TRITON_MLA)
    monkeypatch.delenv("ASCEND_COMPILE_OPTIONS", raising=False)
    torch._dynamo.reset()

    def make(hf_config=None, options=None, **config):
        return real.compiled_and_eager(monkeypatch, tmp_path, mla.build, hf_config or mla.TINY_DEEPSEEK_V2, options, **config)

    yield artifacts, make
    torch._dynamo.reset()


def _equal_to_eager(models, steps) -> None:
    for seq_lens, query_lens in steps:
        step = mla.Step(seq_lens, query_lens)
        got, expected = mla.run(models[0], step), mla.run(models[1], step)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    for got, expected in zip(models[0].caches(), models[1].caches()):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_vllms_deepseek_v2_through_vllms_compile_call_equals_eager(compiled):
    """Decode and mixed steps (chunked prefill with cached context included) through one artifact,
    every step in a bucket replayed from a captured graph; the latent caches written as vLLM writes them."""
    artifacts, make = compiled
    models = make(options={"capture_sizes": [4, 8]})
    real.profile_run(models[0], 16)
    _equal_to_eager(models, STEPS)
    # two artifacts, each general in T: dynamo's retrace guards T >= 2 (the MLA wrapper writes the rotated
    # query into `q[..., qk_nope:]` in place, and torch's `meta_copy_` overlap check on that view, traced
    # size-oblivious, assumes T != 1), so the first one-token step has dynamo trace the frame once more
    assert len(artifacts) == 2
    stats = sum((a.stats for a in artifacts), collections.Counter())
    assert stats["steps"] == len(STEPS)
    # above the largest bucket (8 tokens): the 9-token mixed step runs piecewise (vLLM's own attention ops,
    # adapted, between the pieces); every other step replays
    assert stats["replays"] == len(STEPS) - 1 and stats["piecewise_steps"] == 1 and stats["eager_fallbacks"] == 0


def test_every_mla_layer_becomes_latent_attention_on_the_combined_cache(compiled):
    """The rewritten graph: one `ascend.mla_attention` kernel per layer, reading the two halves of
    vLLM's `[num_blocks, block_size, kv_lora_rank + rope]` cache and the layer's absorbed weights."""
    artifacts, make = compiled
    models = make(options={"capture_sizes": [4]})
    real.profile_run(models[0])
    _equal_to_eager(models, STEPS[:2])
    plan = artifacts[0].describe()
    provided = {p["name"]: p["source"] for p in plan["provided_inputs"]}
    name = LAYER_0.replace(".", "_")
    assert provided[f"vllm_kv_c_cache_{name}"] == (
        f"forward_context.no_compile_layers[{LAYER_0!r}].kv_cache[..., :{mla.KV_LORA_RANK}] (latent)")
    assert provided[f"vllm_w_uk_t_{name}"] == f"forward_context.no_compile_layers[{LAYER_0!r}].W_UK_T"
    roles = {i["name"]: i["role"] for i in plan["inputs"]}
    assert roles[f"vllm_kv_c_cache_{name}"] == roles[f"vllm_k_pe_cache_{name}"] == "kv_cache"
    assert roles["vllm_mla_seq_lens_0"] == "seq_lens" and roles["vllm_mla_block_table_0"] == "block_table"
    assert roles[f"vllm_w_uv_{name}"] == "static"
    table = plan["graphs"]["b4.decode"]["update_table"]
    assert len(table) == 2  # one MLA kernel per layer, its host lengths refreshed each step
    assert table[0]["refresh"] == {"actual_seq_qlen": {"input": "vllm_mla_query_start_loc_0", "conversion": "ends"},
                                   "actual_seq_kvlen": {"input": "vllm_mla_seq_lens_0", "conversion": "list"}}


def test_a_sparse_mla_layer_is_refused_at_compile_time(compiled, monkeypatch):
    artifacts, make = compiled
    models = make()
    for layer in models[0].layers.values():
        monkeypatch.setattr(layer, "use_sparse", True)
    with pytest.raises(Exception, match=rf"vLLM attention layer '{LAYER_0}': sparse MLA") as err:
        real.profile_run(models[0])
    assert "is not supported by ascend_graph" in str(err.value)


def test_a_quantized_latent_cache_is_refused_at_compile_time(compiled):
    artifacts, make = compiled
    models = make(cache_dtype="fp8")
    with pytest.raises(Exception, match=rf"'{LAYER_0}': quantized KV cache \(kv_cache_dtype='fp8'\)"):
        real.profile_run(models[0])


def test_another_mla_backend_is_refused_by_name(compiled, monkeypatch):
    artifacts, make = compiled
    models = make()
    monkeypatch.delitem(integration.mla.SUPPORTED_MLA_BACKENDS, mla.TRITON_MLA)
    with pytest.raises(Exception, match=rf"'{LAYER_0}': MLA attention backend {mla.TRITON_MLA} "
                                        rf"\(get_name\(\) 'TRITON_MLA'\)"):
        real.profile_run(models[0])


def test_the_graph_memory_estimate_bounds_what_the_mla_captures_take(compiled, monkeypatch):
    """MLA layers' figure made at the profiling run (the rewrite's absorbed projections traced, its
    workspace plan the compile's) bounds what the captures of every decode graph then take, and is at
    most 1.25x of it (64 KiB simulator segments)."""
    import ascend_compile.runtime.sim as sim
    from ascend_compile.integrations.vllm import memory

    class SmallSegments(sim.SimRuntime):
        def __init__(self, **kwargs):
            super().__init__(segment_bytes=1 << 16, **kwargs)

    monkeypatch.setattr(sim, "SimRuntime", SmallSegments)
    artifacts, make = compiled
    since = memory.handed_over()
    models = make(options={"capture_sizes": [4, 8, 16], "capture_all": True, "piecewise_sizes": []})  # full graphs
    real.profile_run(models[0], 16)
    graphs = memory.tracked(since)
    assert len(graphs) == 1
    figure = memory.estimate(graphs[0], models[0].config)
    _equal_to_eager(models, [([9, 17, 4], [1, 1, 1])])
    assert len(artifacts) == 1 and artifacts[0].stats["captures"] == 3
    parts = memory.graph_memory(artifacts[0].memory_report())
    assert parts["workspaces"] == figure.workspaces > 0  # the compile's own plan
    measured = sum(parts.values())
    assert 0.8 * figure.total <= measured <= figure.total, (measured, figure)
