"""`integrations/vllm/mla.py`'s checks and per-step readers on their own: which vLLM MLA layers the rewrite
serves (and each refusal, naming the feature), what counts as a bound latent cache, the metadata an MLA
layer needs, and how a step's `MLACommonMetadata` becomes one request order (decodes first): KV lengths
(a prefill's query length plus its cached context, vLLM 0.23's chunks summed or 0.33's context lengths),
block-table rows and query starts; the latent and rope halves of the cache as views. Layers and metadata
are namespaces with vLLM 0.23's / 0.33's field names (no vLLM, no compile: on vLLM's own DeepSeek-V2,
`tests/test_vllm_mla_real.py`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ascend_compile.integrations.vllm import mla
from ascend_compile.integrations.vllm.layers import UnsupportedAttention

TRITON_MLA = type("TritonMLABackend", (), {"__module__": "vllm.v1.attention.backends.mla.triton_mla",
                                            "__qualname__": "TritonMLABackend",
                                            "get_name": staticmethod(lambda: "TRITON_MLA")})


def _layer(**fields) -> SimpleNamespace:
    base = {"attn_backend": TRITON_MLA, "W_UK_T": torch.zeros(2, 4, 8), "W_UV": torch.zeros(2, 8, 4)}
    return SimpleNamespace(**{**base, **fields})


# ---------------------------------------------------------------- refusal


@pytest.mark.parametrize("layer", [
    _layer(), _layer(use_sparse=False, indexer=None, kv_cache_dtype="auto", calculate_kv_scales=False, use_pcp=False,
                     hisparse_cache=None),
    _layer(kv_cache_dtype="bfloat16"),
    _layer(_vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1))),
    _layer(_vllm_config=SimpleNamespace()),  # no parallel config: no context parallelism
])
def test_a_dense_mla_layer_with_its_absorbed_weights_is_served(layer):
    assert mla.refusal(layer) is None
    mla.refuse_unsupported({"l0": layer, "l1": layer})


def test_every_supported_mla_backend_is_served_by_its_class_path():
    for path in mla.SUPPORTED_MLA_BACKENDS:
        module, _, name = path.rpartition(".")
        assert mla.refusal(_layer(attn_backend=type(name, (), {"__module__": module, "__qualname__": name}))) is None


@pytest.mark.parametrize("layer, says", [
    (_layer(attn_backend=type("AscendMLABackend", (), {"__module__": "vllm_ascend.attention.mla_v1",
                                                        "__qualname__": "AscendMLABackend"})),
     "MLA attention backend vllm_ascend.attention.mla_v1.AscendMLABackend (get_name() '?'); supported: TRITON_MLA, "
     "FLASH_ATTN_MLA, FLASHMLA, CUTLASS_MLA, FLASHINFER_MLA"),
    (_layer(use_sparse=True), "sparse MLA (layer.use_sparse: DeepSeek-V3.2's top-k indexer)"),
    (_layer(indexer=object()), "sparse MLA (layer.use_sparse: DeepSeek-V3.2's top-k indexer)"),
    (_layer(kv_cache_dtype="fp8"), "quantized KV cache (kv_cache_dtype='fp8')"),
    (_layer(calculate_kv_scales=True), "computed KV scales (layer.calculate_kv_scales)"),
    (_layer(_vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=2))),
     "decode context parallelism (decode_context_parallel_size=2)"),
    (_layer(use_pcp=True), "prefill context parallelism (layer.use_pcp: prefill_context_parallel_size > 1)"),
    (_layer(hisparse_cache=object()), "a HiSparse host-backed cache (layer.hisparse_cache)"),
    (_layer(W_UK_T=None), "no absorbed weights (layer.W_UK_T / layer.W_UV: quantized kv_b_proj bmm, or weights "
                          "not loaded)"),
    (_layer(W_UV=None), "no absorbed weights (layer.W_UK_T / layer.W_UV"),
    (SimpleNamespace(attn_backend=TRITON_MLA), "no absorbed weights"),
])
def test_an_mla_layer_asking_for_what_the_rewrite_does_not_compute_is_refused_naming_it(layer, says):
    assert mla.refusal(layer).startswith(says)
    with pytest.raises(UnsupportedAttention) as err:
        mla.refuse_unsupported({"fine": _layer(), "model.layers.3.self_attn.attn": layer})
    assert err.value.layer == "model.layers.3.self_attn.attn" and err.value.feature.startswith(says)


def test_the_backend_is_checked_first_then_sparsity_then_the_cache():
    other = type("B", (), {"__module__": "x", "__qualname__": "B"})
    assert mla.refusal(_layer(attn_backend=other, use_sparse=True)).startswith("MLA attention backend x.B")
    assert mla.refusal(_layer(use_sparse=True, kv_cache_dtype="fp8")).startswith("sparse MLA")
    assert mla.refusal(_layer(kv_cache_dtype="fp8", W_UV=None)).startswith("quantized KV cache")


# ---------------------------------------------------------------- caches


@pytest.mark.parametrize("cache, bound", [
    (torch.zeros(4, 16, 40), True), (torch.zeros(1, 1, 1), True), (torch.zeros(0, 16, 40), False), (torch.zeros(4, 16), False),
    (torch.zeros(4, 2, 16, 40), False), (None, False), ((torch.zeros(4, 16, 40),), False),
])
def test_a_latent_cache_is_bound_as_one_nonempty_3_dim_tensor(cache, bound):
    assert mla.has_latent_cache(cache) is bound


def test_the_latent_and_rope_halves_are_views_of_each_row():
    cache = torch.arange(2 * 3 * 10, dtype=torch.float32).reshape(2, 3, 10)
    latent, rope = mla.latent_caches(cache, 8, "where")
    assert latent.shape == (2, 3, 8) and rope.shape == (2, 3, 2)
    assert torch.equal(latent, cache[..., :8]) and torch.equal(rope, cache[..., 8:])
    assert latent.data_ptr() == cache.data_ptr() and rope.data_ptr() == cache[..., 8:].data_ptr()


@pytest.mark.parametrize("cache, got", [
    (torch.zeros(2, 3, 8), "got (2, 3, 8)"),  # no room for the rope key
    (torch.zeros(2, 3, 4), "got (2, 3, 4)"),
    (torch.zeros(2, 1, 3, 10), "got (2, 1, 3, 10)"),  # vLLM 0.33's page before the layer squeezes it
    ((torch.zeros(2, 3, 10),), "got tuple"),
])
def test_any_other_cache_is_refused_naming_where_and_the_rank(cache, got):
    with pytest.raises(ValueError) as err:
        mla.latent_caches(cache, 8, "forward_context.no_compile_layers['l0'].kv_cache")
    assert str(err.value) == ("forward_context.no_compile_layers['l0'].kv_cache: expected a [num_blocks, block_size, "
                              f"kv_lora_rank + rope] tensor (kv_lora_rank 8), {got}")


# ---------------------------------------------------------------- metadata


def _prefill(query_lens: list[int], chunked: object = None, table_rows: int | None = None) -> SimpleNamespace:
    loc = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()) + [99], dtype=torch.int32)
    rows = table_rows or len(query_lens)
    return SimpleNamespace(query_start_loc=loc, chunked_context=chunked,
                           block_table=torch.arange(100, 100 + rows * 2, dtype=torch.int32).reshape(rows, 2))


def _metadata(decode_lens: list[int] | None, prefill: SimpleNamespace | None, num_prefills: int = 0,
              **fields) -> SimpleNamespace:
    decode = None
    if decode_lens is not None:  # padded past the decodes, as vLLM's persistent buffers are
        decode = SimpleNamespace(seq_lens=torch.tensor(decode_lens + [77], dtype=torch.int32),
                                 block_table=torch.arange(2 * len(decode_lens) + 2, dtype=torch.int32).reshape(-1, 2))
    num_decodes = len(decode_lens or [])
    return SimpleNamespace(num_reqs=num_decodes + num_prefills, num_decodes=num_decodes, num_prefills=num_prefills,
                           decode=decode, prefill=prefill,
                           query_start_loc=torch.arange(num_decodes + num_prefills + 3, dtype=torch.int32), **fields)


def test_decodes_only_take_their_lengths_and_rows():
    metadata = _metadata([5, 9, 3], None)
    assert mla.seq_lens(metadata).tolist() == [5, 9, 3]
    assert mla.block_table(metadata).tolist() == [[0, 1], [2, 3], [4, 5]]
    assert mla.query_start_loc(metadata).tolist() == [0, 1, 2, 3]


def test_a_prefill_without_cached_context_is_its_query_length():
    metadata = _metadata(None, _prefill([4, 6], table_rows=3), num_prefills=2)
    lens = mla.seq_lens(metadata)
    assert lens.tolist() == [4, 6] and lens.dtype == torch.int32
    assert mla.block_table(metadata).tolist() == [[100, 101], [102, 103]]


def test_vllm_023s_chunked_context_is_summed_over_the_chunks():
    chunks = SimpleNamespace(seq_lens=torch.tensor([[8, 16, 5], [2, 4, 5]]))  # [num_chunks, prefills + padding]
    metadata = _metadata([7], _prefill([3, 1], chunks), num_prefills=2)
    assert mla.seq_lens(metadata).tolist() == [7, 3 + 10, 1 + 20]
    assert mla.block_table(metadata).tolist() == [[0, 1], [100, 101], [102, 103]]


def test_vllm_033s_context_lengths_are_added_per_prefill():
    chunks = SimpleNamespace(context_lens=torch.tensor([11, 0, 50]), seq_lens=torch.tensor([[1000, 1000, 1000]]))
    metadata = _metadata([7, 2], _prefill([3, 5], chunks), num_prefills=2)
    lens = mla.seq_lens(metadata)
    assert lens.tolist() == [7, 2, 14, 5] and lens.dtype == torch.int32
    assert mla.query_start_loc(metadata).tolist() == [0, 1, 2, 3, 4]


def test_the_metadata_an_mla_layer_needs_is_there_or_refused_naming_it():
    mla._refuse_metadata("l0", _metadata([1], None))
    mla._refuse_metadata("l0", _metadata([1], None, causal=True))
    for field in ("num_reqs", "num_decodes", "num_prefills", "decode", "prefill", "query_start_loc"):
        metadata = _metadata([1], None)
        delattr(metadata, field)
        with pytest.raises(UnsupportedAttention) as err:
            mla._refuse_metadata("model.layers.0.self_attn.attn", metadata)
        assert err.value.layer == "model.layers.0.self_attn.attn"
        assert err.value.feature == f"MLA attention metadata SimpleNamespace without {[field]!r}"
    with pytest.raises(UnsupportedAttention) as err:
        mla._refuse_metadata("l0", SimpleNamespace(num_reqs=1))
    assert err.value.feature.endswith("without ['num_decodes', 'num_prefills', 'decode', 'prefill', 'query_start_loc']")
    with pytest.raises(UnsupportedAttention) as err:
        mla._refuse_metadata("model.layers.5.self_attn.attn", _metadata([1], None, causal=False))
    assert (err.value.layer, err.value.feature) == ("model.layers.5.self_attn.attn",
                                                    "non-causal attention (attn_metadata.causal=False)")


@pytest.mark.parametrize("chunked", [SimpleNamespace(seq_lens=torch.tensor([[4, 2]])),  # vLLM 0.23: host copies
                                     SimpleNamespace(context_lens=torch.tensor([4, 2]))])
def test_context_lengths_kept_on_the_host_are_moved_to_the_device_of_the_query_starts(chunked):
    prefill = SimpleNamespace(query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32, device="meta"),
                              chunked_context=chunked)
    lens = mla.seq_lens(_metadata(None, prefill, num_prefills=2))  # "meta" stands in for the accelerator
    assert lens.device.type == "meta" and lens.shape == (2,) and lens.dtype == torch.int32
