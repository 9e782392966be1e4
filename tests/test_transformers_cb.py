"""transformers' continuous batching (`model.generate_batch`) served through `ascend_graph`.

Greedy tokens must equal `model.generate`'s token for token, logprobs must match continuous batching
run without the backend, steps mixing prefill chunks and decodes must all replay captured graphs,
with no graph break; what the integration cannot serve is refused clearly.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402

from ascend_compile.integrations import transformers as ac_hf  # noqa: E402
from ascend_compile.lowering.runner import CompiledArtifact  # noqa: E402
from ascend_compile.torch_support import torch_release  # noqa: E402

#: torch 2.10 cannot trace continuous batching's sampler: the integration refuses it (the last test)
needs_cb_torch = pytest.mark.skipif(torch_release() < ac_hf.OLDEST_TORCH,
                                    reason=f"continuous batching is refused on torch {torch.__version__}")

PROMPT_LENGTHS = [5, 12, 3, 21, 9, 30]
WINDOW = 8  # shorter than most prompts: the window decides the tokens
NEW_TOKENS = 6
CAPTURE_SIZES = [1, 2, 4, 8, 16]


def tiny(family: str):
    """A tiny random model of `family`, float32, in eval mode."""
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=False)).eval()
    windowed = dict(common, sliding_window=WINDOW)
    if family == "mistral":  # every layer sliding
        return transformers.MistralForCausalLM(transformers.MistralConfig(**windowed)).eval()
    if family == "gemma3":  # sliding layers around a full one
        layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
        config = transformers.Gemma3TextConfig(**dict(windowed, num_hidden_layers=3), head_dim=16, layer_types=layer_types)
        return transformers.Gemma3ForCausalLM(config).eval()
    if family == "gpt_oss":  # sinks in every layer, a sliding and a full one
        config = transformers.GptOssConfig(**dict(windowed, intermediate_size=64), head_dim=16, num_local_experts=4,
                                           num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
        config._experts_implementation = "batched_mm"  # its grouped-mm CPU fallback reads lengths on the host
        model = transformers.GptOssForCausalLM(config).eval()
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "sinks"):
                    module.sinks.normal_()  # zeros at init: make the sinks matter
        return model
    if family == "deepseek_v3":  # multi-head latent attention; both layers dense (first_k_dense_replace)
        config = transformers.DeepseekV3Config(**dict(common, num_key_value_heads=4), moe_intermediate_size=32,
                                               kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                                               qk_nope_head_dim=32, v_head_dim=16, n_routed_experts=4,
                                               num_experts_per_tok=2, first_k_dense_replace=2, n_group=1, topk_group=1)
        return transformers.DeepseekV3ForCausalLM(config).eval()
    raise ValueError(family)


def prompts():
    return [[1 + (i * 7 + j * 3) % 120 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]


def greedy():
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


def cb_config(**kw):
    # max_batch_tokens 16: the 21- and 30-token prompts are prefilled in chunks, beside other requests' decodes
    return ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=16, **kw)


def in_order(outputs):
    return [outputs[k] for k in sorted(outputs, key=lambda k: int(k.rsplit("_", 1)[-1]))]


def greedy_tokens(model):
    """Each prompt's tokens from plain greedy `model.generate`."""
    expected = []
    with torch.no_grad():
        for p in prompts():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 generation_config=greedy())
            expected.append(out[0, len(p):].tolist())
    return expected


@needs_cb_torch
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3", "gpt_oss"])
def test_generate_batch_equals_greedy_generate_with_graphs_replayed(family):
    model = tiny(family)
    expected = greedy_tokens(model)
    artifacts = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cb = ac_hf.continuous_batching(model, cb_config(), on_compiled=artifacts.append, capture_sizes=CAPTURE_SIZES)
    outputs = in_order(model.generate_batch(prompts(), generation_config=greedy(), continuous_batching_config=cb))
    assert [o.generated_tokens for o in outputs] == expected
    stats = sum((a.stats for a in artifacts), start=__import__("collections").Counter())
    assert stats["eager_fallbacks"] == 0  # every step fits a bucket (max_batch_tokens <= the largest)
    assert stats["replays"] == stats["steps"] and stats["captures"] >= 2
    assert not torch._dynamo.utils.counters["graph_break"]
    if family in ("llama", "qwen2"):  # PA-eligible layers: mixed steps get graphs of their own
        mixed = [a for a in artifacts if any(not g.key.decode for g in a.graphs.values())]
        assert mixed, "no step mixed prefill chunks with decodes"


@needs_cb_torch
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefill_steps_above_the_largest_bucket_are_served_piecewise(family):
    """Buckets up to 4 tokens, steps of up to 32 (`max_batch_tokens`): every prefill step and the
    chunked mixes above 4 tokens run on captured pieces, the attention, the cache writes and CB's
    writes of the sampled tokens into its output buffer eagerly between them; greedy tokens still
    equal `model.generate`'s, and nothing runs eagerly whole."""
    model = tiny(family)
    expected = greedy_tokens(model)
    artifacts = []
    torch._dynamo.reset()
    config = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=32)
    cb = ac_hf.continuous_batching(model, config, on_compiled=artifacts.append, capture_sizes=[1, 2, 4])
    outputs = in_order(model.generate_batch(prompts(), generation_config=greedy(), continuous_batching_config=cb))
    assert [o.generated_tokens for o in outputs] == expected
    stats = sum((a.stats for a in artifacts), start=__import__("collections").Counter())
    assert stats["eager_fallbacks"] == 0 and stats["piecewise_steps"] >= 2
    assert stats["replays"] + stats["piecewise_steps"] == stats["steps"]
    served = {path for a in artifacts for (kind, path) in a.served if kind != "decode"}
    assert "piecewise" in served


@needs_cb_torch
@pytest.mark.parametrize("dispatch", ["dynamo", "direct"])
def test_one_dynamo_graph_serves_every_step(dispatch, monkeypatch):
    """The runner's step is compiled with its step dims named: one dynamo graph for decode and mixed
    steps of every size; with dispatch="direct" the steps after the first two skip dynamo (the
    second finds the constants transformers' output capturing stores already in place). Steps run
    on continuous batching's own thread: direct calls are counted at the artifact."""
    direct = []
    call_direct = CompiledArtifact.call_direct
    monkeypatch.setattr(CompiledArtifact, "call_direct", lambda self, args, fixed=None: (direct.append(1), call_direct(self, args, fixed))[1])
    model = tiny("llama")
    expected = greedy_tokens(model)
    artifacts = []
    torch._dynamo.reset()
    cb = ac_hf.continuous_batching(model, cb_config(), on_compiled=artifacts.append, capture_sizes=CAPTURE_SIZES,
                                   dispatch=dispatch)
    outputs = in_order(model.generate_batch(prompts(), generation_config=greedy(), continuous_batching_config=cb))
    assert [o.generated_tokens for o in outputs] == expected
    assert len(artifacts) == 1
    steps = artifacts[0].stats["steps"]
    assert artifacts[0].stats["replays"] == steps and steps > 2
    assert len(direct) == (steps - 2 if dispatch == "direct" else 0)


@needs_cb_torch
def test_logprobs_match_continuous_batching_without_the_backend():
    model = tiny("llama")
    plain = in_order(model.generate_batch(prompts(), generation_config=greedy(),
                                          continuous_batching_config=cb_config(return_logprobs=True)))
    torch._dynamo.reset()
    cb = ac_hf.continuous_batching(model, cb_config(return_logprobs=True), capture_sizes=CAPTURE_SIZES)
    compiled = in_order(model.generate_batch(prompts(), generation_config=greedy(), continuous_batching_config=cb))
    assert [o.generated_tokens for o in compiled] == [o.generated_tokens for o in plain]
    for a, b in zip(compiled, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)


@needs_cb_torch
def test_sliding_layers_attend_through_a_ring_of_whole_pages_with_their_window():
    """Continuous batching keeps a sliding layer's keys in a ring; this module's ring holds what a
    chunk reads (window + max_batch_tokens - 1, whole pages) and each windowed layer takes FIA."""
    assert ac_hf.ring_length(8, 16, 16) == 32 and ac_hf.ring_length(4096, 256, 128) == 4352
    model = tiny("gemma3")
    artifacts = []
    torch._dynamo.reset()
    cb = ac_hf.continuous_batching(model, cb_config(), on_compiled=artifacts.append, capture_sizes=CAPTURE_SIZES)
    model.generate_batch(prompts()[:2], generation_config=greedy(), continuous_batching_config=cb)
    kernels = [k for a in artifacts for g in a.describe()["graphs"].values() for k in g["kernels"]]
    windows = {k.get("features", {}).get("window") for k in kernels}
    assert windows == {None, WINDOW}
    assert all(k["kernel"] == "fused_infer_attention" for k in kernels if k.get("features"))


@needs_cb_torch
def test_layer_types_the_integration_cannot_serve_are_refused():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    model.config.layer_types = ["chunked_attention"]
    with pytest.raises(ValueError, match=r"layer types \['chunked_attention'\] are not supported"):
        ac_hf.continuous_batching(model, cb_config(), capture_sizes=CAPTURE_SIZES)


@needs_cb_torch
def test_deepseek_v3s_latent_attention_is_refused_naming_the_layer_and_head_dims():
    """DeepSeek-V3's attention has a query/key head dim (nope + rope) unlike its value head dim, which
    `ascend.attention` does not take; and transformers caches its compressed latent, which the paged
    cache does not hold (its own continuous batching fails on it, below). Refused before anything runs."""
    model = tiny("deepseek_v3")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn: multi-head latent attention \(query/key head dim "
                                         r"48 = qk_nope 32 \+ rope 16, value head dim 16, kv_lora_rank 32\)") as err:
        ac_hf.continuous_batching(model, cb_config(), capture_sizes=CAPTURE_SIZES)
    assert "integrations.vllm" in str(err.value)  # what to do instead
    assert model.config._attn_implementation != ac_hf.ATTENTION  # the model is left as it was


def test_transformers_own_continuous_batching_does_not_hold_deepseek_v3s_latent():
    """Why the refusal above names the cache: transformers 5.24 pages hold `num_key_value_heads x head_dim`
    (the rope dim) per token, the model writes `[1, kv_lora_rank]` latents; every request fails."""
    model = tiny("deepseek_v3")
    with torch.no_grad():
        outputs = model.generate_batch(prompts()[:2], generation_config=greedy(), continuous_batching_config=cb_config())
    assert [o.generated_tokens for o in in_order(outputs)] == [[], []]


@needs_cb_torch
def test_an_unsupported_transformers_version_is_refused(monkeypatch):
    monkeypatch.setattr(ac_hf, "installed_version", lambda: "5.30.0")
    with pytest.raises(RuntimeError, match="transformers 5.30.0: .* supports transformers 5.24.x"):
        ac_hf.continuous_batching(tiny("llama"), cb_config())


@needs_cb_torch
def test_the_attention_function_refuses_use_outside_continuous_batching():
    model = tiny("llama")
    ac_hf.continuous_batching(model, cb_config())
    with pytest.raises(RuntimeError, match="serves continuous batching only"):
        model(torch.tensor([[1, 2, 3]]))


def test_an_older_torch_is_refused_naming_what_it_cannot_trace(monkeypatch):
    """On a torch older than `OLDEST_TORCH` (CI's torch 2.10 for real), a clear refusal, not a server
    that serves nothing (transformers logs the trace error and returns empty generations)."""
    monkeypatch.setattr(ac_hf, "torch_release", lambda: (2, 10))
    with pytest.raises(RuntimeError, match=r"needs torch 2\.11 or later.*output_ids\[0, :tokens\]"):
        ac_hf.continuous_batching(tiny("llama"))
