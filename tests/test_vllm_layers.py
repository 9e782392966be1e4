"""`integrations/vllm/layers.py` on its own: which vLLM attention layers the `ascend.attention` rewrite
serves and with which features (a causal window as the `W` keys attended, a soft-cap, sinks), and that
every other layer, metadata and cache is refused naming the layer and the feature. Layers are namespaces
shaped as vLLM 0.23's `Attention` / `FlashAttentionImpl` and vLLM-Ascend's impl keep their fields (the
docstrings of `layers.py`); backends are classes at vLLM's module paths. No vLLM, no compile."""
from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest
import torch

from ascend_compile.integrations.vllm import layers
from ascend_compile.integrations.vllm.layers import UnsupportedAttention
from ascend_compile.ops.features import AttentionFeatures


def _backend(path: str, name: str | None = None) -> type:
    module, _, qualname = path.rpartition(".")
    body = {"__module__": module, "__qualname__": qualname}
    if name is not None:
        body["get_name"] = staticmethod(lambda: name)
    return type(qualname, (), body)


FLASH_ATTN = _backend("vllm.v1.attention.backends.flash_attn.FlashAttentionBackend", "FLASH_ATTN")
ASCEND = _backend("vllm_ascend.attention.attention_v1.AscendAttentionBackend", "CUSTOM")


class AttentionType(str, enum.Enum):  # vLLM's is a str enum
    DECODER = "decoder"
    ENCODER = "encoder"


def _layer(backend: type = FLASH_ATTN, **impl) -> SimpleNamespace:
    return SimpleNamespace(attn_backend=backend, impl=SimpleNamespace(**impl))


# ---------------------------------------------------------------- backends


def test_a_backends_path_is_its_class_path_given_the_class_or_an_instance():
    assert layers.backend_path(FLASH_ATTN) == "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
    assert layers.backend_path(ASCEND()) == "vllm_ascend.attention.attention_v1.AscendAttentionBackend"


def test_a_supported_backend_is_no_refusal():
    for backend in (FLASH_ATTN, ASCEND):
        assert layers.backend_refusal(_layer(backend), layers.SUPPORTED_BACKENDS, "attention backend") is None


def test_another_backend_is_refused_by_path_and_name_listing_the_supported():
    other = _backend("vllm.v1.attention.backends.flashinfer.FlashInferBackend", "FLASHINFER")
    assert layers.backend_refusal(_layer(other), layers.SUPPORTED_BACKENDS, "attention backend") == (
        "attention backend vllm.v1.attention.backends.flashinfer.FlashInferBackend (get_name() 'FLASHINFER'); "
        "supported: FLASH_ATTN, vLLM-Ascend's AscendAttentionBackend")
    # the same name at another path is another backend (vLLM-Ascend's MLA backends answer "FLASH_ATTN" too)
    impostor = _backend("vllm_ascend.attention.mla_v1.AscendMLABackend", "FLASH_ATTN")
    assert "AscendMLABackend (get_name() 'FLASH_ATTN')" in layers.refusal("l0", _layer(impostor))


def test_a_backend_without_a_name_or_no_backend_at_all_is_refused():
    nameless = _backend("somewhere.Backend")
    assert layers.backend_refusal(_layer(nameless), {"x.Y": "Y"}, "MLA attention backend") == (
        "MLA attention backend somewhere.Backend (get_name() '?'); supported: Y")
    assert layers.backend_refusal(SimpleNamespace(), {"x.Y": "Y", "x.Z": "Z"}, "attention backend") == (
        "attention backend none (get_name() '?'); supported: Y, Z")


# ---------------------------------------------------------------- refusal


@pytest.mark.parametrize("layer", [
    _layer(), _layer(ASCEND), _layer(attn_type="decoder"), _layer(attn_type=AttentionType.DECODER),
    _layer(alibi_slopes=None, kv_cache_dtype="auto"), _layer(sliding_window=(7, 0), logits_soft_cap=30.0),
    SimpleNamespace(attn_backend=FLASH_ATTN, kv_cache_dtype="bfloat16", impl=SimpleNamespace(kv_cache_dtype="float16")),
])
def test_a_causal_decoder_layer_of_a_supported_backend_is_served(layer):
    assert layers.refusal("l0", layer) is None
    layers.refuse_unsupported({"l0": layer, "l1": layer})


@pytest.mark.parametrize("layer, says", [
    (_layer(alibi_slopes=torch.ones(4)), "ALiBi (impl.alibi_slopes)"),
    (_layer(attn_type="encoder"), "attention type 'encoder' (only decoder self-attention)"),
    (_layer(attn_type=AttentionType.ENCODER), "attention type 'encoder' (only decoder self-attention)"),
    (_layer(attn_type="encoder_decoder"), "attention type 'encoder_decoder' (only decoder self-attention)"),
    (_layer(sliding_window=(3, 2)), "sliding window impl.sliding_window=(3, 2) (only causal windows (left, 0) "
                                    "are computed: a window reaching right of the query is not)"),
    (_layer(kv_cache_dtype="fp8"), "quantized KV cache (kv_cache_dtype='fp8')"),
    (SimpleNamespace(attn_backend=FLASH_ATTN, kv_cache_dtype="fp8_e4m3", impl=SimpleNamespace()),
     "quantized KV cache (kv_cache_dtype='fp8_e4m3')"),
    (SimpleNamespace(attn_backend=FLASH_ATTN, kv_cache_dtype="auto", impl=SimpleNamespace(kv_cache_dtype="int8")),
     "quantized KV cache (kv_cache_dtype='int8')"),
])
def test_a_layer_asking_for_what_the_rewrite_does_not_compute_is_refused_naming_it(layer, says):
    assert layers.refusal("l0", layer) == says
    with pytest.raises(UnsupportedAttention) as err:
        layers.refuse_unsupported({"fine": _layer(), "model.layers.1.attn": layer})
    assert (err.value.layer, err.value.feature) == ("model.layers.1.attn", says)
    assert str(err.value) == (f"vLLM attention layer 'model.layers.1.attn': {says} is not supported by ascend_graph "
                              f"(ascend.attention would compute this layer wrongly); serve this model without the "
                              f"ascend_graph backend")


def test_the_backend_is_checked_before_the_impl():
    other = _backend("elsewhere.Backend", "OTHER")
    assert layers.refusal("l0", _layer(other, alibi_slopes=torch.ones(2))).startswith("attention backend elsewhere")


def test_every_unquantized_cache_dtype_is_served():
    for dtype in ("auto", "bfloat16", "float16", "half", "float", "float32"):
        assert layers.refusal("l0", _layer(kv_cache_dtype=dtype)) is None


# ---------------------------------------------------------------- layer_features


@pytest.mark.parametrize("impl, layer_fields, features", [
    ({}, {}, AttentionFeatures()),
    ({"sliding_window": None}, {}, AttentionFeatures()),
    ({"sliding_window": (-1, -1)}, {}, AttentionFeatures()),  # FlashAttention's "none"
    ({"sliding_window": (7, 0)}, {}, AttentionFeatures(window=8)),  # built with sliding_window=8
    ({"sliding_window": [0, 0]}, {}, AttentionFeatures(window=1)),
    ({"sliding_window": (7, 0)}, {"sliding_window": 8}, AttentionFeatures(window=8)),
    ({"sliding_window": 8}, {"sliding_window": 8}, AttentionFeatures(window=8)),  # vLLM-Ascend keeps W
    ({"logits_soft_cap": 0}, {}, AttentionFeatures()),  # FlashAttention's "none"
    ({"logits_soft_cap": 30}, {}, AttentionFeatures(soft_cap=30.0)),
    ({"sinks": torch.zeros(4)}, {"has_sink": True}, AttentionFeatures(sinks=True)),
    ({"sinks": torch.zeros(4)}, {}, AttentionFeatures(sinks=True)),
    ({"sliding_window": (127, 0), "logits_soft_cap": 50.0, "sinks": torch.zeros(2)}, {"sliding_window": 128},
     AttentionFeatures(128, 50.0, True)),
])
def test_a_layers_features_are_what_its_impl_applies(impl, layer_fields, features):
    got = layers.layer_features("l0", SimpleNamespace(impl=SimpleNamespace(**impl), **layer_fields))
    assert got == features
    assert type(got.window) is type(features.window) and type(got.soft_cap) is type(features.soft_cap)


@pytest.mark.parametrize("impl, layer_fields, says", [
    ({"sliding_window": (3, 1)}, {}, "sliding window impl.sliding_window=(3, 1) (only causal windows"),
    ({"sliding_window": (-2, 0)}, {}, "sliding window impl.sliding_window=(-2, 0)"),
    ({"sliding_window": (3, 0, 0)}, {}, "sliding window impl.sliding_window=(3, 0, 0)"),
    ({"sliding_window": (3,)}, {}, "sliding window impl.sliding_window=(3,)"),
    ({"sliding_window": True}, {}, "sliding window impl.sliding_window=True"),
    ({"sliding_window": "8"}, {}, "sliding window impl.sliding_window='8'"),
    ({"sliding_window": (7, 0)}, {"sliding_window": 7},
     "sliding window layer.sliding_window=7 that the impl does not apply as such (impl.sliding_window=(7, 0))"),
    ({}, {"sliding_window": 8}, "sliding window layer.sliding_window=8 that the impl does not apply as such "
                                "(impl.sliding_window=None)"),
    ({"sinks": None}, {"has_sink": True}, "attention sinks the impl does not hold (layer.has_sink, impl.sinks None)"),
    ({}, {"has_sink": True}, "attention sinks the impl does not hold"),
    ({"sliding_window": 0}, {}, "attention features window: expected a positive int"),
    ({"logits_soft_cap": -1.0}, {}, "attention features soft_cap: expected a positive float"),
])
def test_a_window_or_sinks_the_rewrite_cannot_pass_on_are_refused(impl, layer_fields, says):
    layer = SimpleNamespace(impl=SimpleNamespace(**impl), **layer_fields)
    with pytest.raises(UnsupportedAttention) as err:
        layers.layer_features("model.layers.0.attn", layer)
    assert err.value.layer == "model.layers.0.attn" and err.value.feature.startswith(says)
    assert layers.refusal("model.layers.0.attn", SimpleNamespace(attn_backend=FLASH_ATTN, **vars(layer))) == \
        err.value.feature


def test_a_layer_without_sinks_has_none_unless_built_with_them():
    layer = SimpleNamespace(impl=SimpleNamespace(sinks=None), has_sink=False)
    assert layers.layer_features("l0", layer).sinks is False


# ---------------------------------------------------------------- per-step metadata and cache dtypes


def _metadata(**fields) -> SimpleNamespace:
    base = {"seq_lens": torch.ones(2), "query_start_loc": torch.arange(3), "block_table": torch.zeros(2, 4)}
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("metadata", [
    _metadata(), _metadata(causal=True),
    SimpleNamespace(seq_lens=1, query_start_loc=1, block_tables=1),  # vLLM-Ascend's name
])
def test_causal_metadata_with_lengths_and_a_block_table_is_served(metadata):
    layers.refuse_metadata("l0", metadata)


@pytest.mark.parametrize("metadata, says", [
    (_metadata(causal=False), "non-causal attention (attn_metadata.causal=False)"),
    (_metadata(rswa_prefix_lens=torch.ones(2)), "R-SWA"),
    (SimpleNamespace(query_start_loc=1, block_table=1), "attention metadata SimpleNamespace without ['seq_lens']"),
    (SimpleNamespace(seq_lens=1, block_table=1), "attention metadata SimpleNamespace without ['query_start_loc']"),
    (SimpleNamespace(seq_lens=1, query_start_loc=1), "attention metadata SimpleNamespace without ['block_table']"),
    (SimpleNamespace(), "attention metadata SimpleNamespace without ['seq_lens', 'query_start_loc', 'block_table']"),
])
def test_other_metadata_is_refused_naming_the_layer_and_what_it_lacks(metadata, says):
    with pytest.raises(UnsupportedAttention) as err:
        layers.refuse_metadata("model.layers.2.attn", metadata)
    assert err.value.layer == "model.layers.2.attn" and err.value.feature.startswith(says)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_cache_of_the_models_dtype_is_served(dtype):
    layers.refuse_cache_dtype("l0", torch.zeros(2, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float64])
def test_a_cache_of_any_other_element_type_is_refused(dtype):
    with pytest.raises(UnsupportedAttention) as err:
        layers.refuse_cache_dtype("l3", torch.zeros(2, dtype=dtype))
    assert (err.value.layer, err.value.feature) == ("l3", f"quantized KV cache (cache dtype {dtype})")
