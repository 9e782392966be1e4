"""`integrations/vllm/context.py`, what the vLLM binder reads from a forward context, on its own: which KV
caches count as bound, how each layout splits into key and value views, which per-step metadata asks for
attention other than causal, the per-step cuts of lengths, block tables and slots, and the passes that let
a layer's two cache readers check its cache once. Plain torch and namespaces (no vLLM, no compile).
`CacheViews` across steps: `tests/test_vllm_cache_views.py`."""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from ascend_compile.integrations.vllm import context
from ascend_compile.integrations.vllm.context import CacheViews

WHERE = "forward_context.no_compile_layers['l0'].kv_cache"


# ---------------------------------------------------------------- has_cache


@pytest.mark.parametrize("cache", [
    (torch.ones(2, 4), torch.ones(2, 4)),
    [torch.ones(2, 4), torch.ones(2, 4)],
    (torch.ones(2, 4), torch.ones(2, 4), "a third entry, not read"),
    torch.ones(3, 2, 4, 1, 8),  # vLLM 0.23's [num_blocks, 2, block_size, kv_heads, head_dim]
    torch.ones(3, 1, 4, 16),  # vLLM 0.33's page
    torch.ones(1, 1, 1, 1),  # one element is no empty cache
])
def test_a_pair_of_nonempty_tensors_or_a_nonempty_4_or_5_dim_tensor_is_a_bound_cache(cache):
    assert context.has_cache(cache) is True


@pytest.mark.parametrize("cache", [
    None, (), (torch.ones(2),), [torch.ones(2)],
    (torch.ones(2, 4), torch.empty(0)), (torch.empty(0), torch.ones(2, 4)),
    (torch.ones(2, 4), None), ("key", torch.ones(2, 4)),
    torch.empty(0, 2, 4, 1, 8), torch.empty(3, 0, 16), torch.ones(3, 4, 8), torch.ones(2, 2, 2, 2, 2, 2),
    torch.empty(0, 1, 4, 16), "kv_cache",
])
def test_anything_else_is_no_bound_cache(cache):
    assert context.has_cache(cache) is False


# ---------------------------------------------------------------- split_cache


def test_a_pair_is_taken_as_key_and_value():
    key, value = torch.ones(3, 4, 1, 8), torch.zeros(3, 4, 1, 8)
    for cache in ((key, value), [key, value], (key, value, torch.ones(1))):
        got = context.split_cache(cache, WHERE)
        assert got[0] is key and got[1] is value


def test_vllm_023s_cache_is_unbound_on_dim_1_as_views():
    cache = torch.arange(3 * 2 * 4 * 1 * 8, dtype=torch.float32).reshape(3, 2, 4, 1, 8)
    key, value = context.split_cache(cache, WHERE)
    assert key.shape == value.shape == (3, 4, 1, 8)
    assert torch.equal(key, cache[:, 0]) and torch.equal(value, cache[:, 1])
    assert key.data_ptr() == cache.data_ptr() and value.data_ptr() == cache[:, 1].data_ptr()


def test_vllm_033s_page_is_split_as_its_flash_attention_impl_splits_it():
    blocks, heads, block_size, head_size = 3, 2, 4, 8
    cache = torch.arange(blocks * heads * block_size * 2 * head_size, dtype=torch.float32).reshape(
        blocks, heads, block_size, 2 * head_size)
    key, value = context.split_cache(cache, WHERE, head_size)
    assert key.shape == value.shape == (blocks, block_size, heads, head_size)
    assert torch.equal(key, cache.permute(0, 2, 1, 3)[..., :head_size])
    assert torch.equal(value, cache.permute(0, 2, 1, 3)[..., head_size:])
    assert key.data_ptr() == cache.data_ptr()  # views, not copies


@pytest.mark.parametrize("cache, head_size, says", [
    (torch.ones(3, 3, 4, 1, 8), None, "(3, 3, 4, 1, 8)"),  # 5 dims, not 2 on dim 1
    (torch.ones(3, 1, 4, 16), None, "(3, 1, 4, 16)"),  # a page, but no head size to split it by
    (torch.ones(3, 1, 4, 16), 0, "(3, 1, 4, 16)"),
    (torch.ones(3, 1, 4, 16), 4, "(3, 1, 4, 16)"),  # not 2 * head_size
    (torch.ones(3, 4, 8), 4, "(3, 4, 8)"),
    ((torch.ones(2),), None, "tuple"),
    ("kv", None, "str"),
])
def test_any_other_cache_is_refused_naming_where_and_what_it_got(cache, head_size, says):
    with pytest.raises(ValueError) as err:
        context.split_cache(cache, WHERE, head_size)
    message = str(err.value)
    assert message.startswith(f"{WHERE}: expected a (key, value) pair") and message.endswith(says)
    assert f"head_size {head_size})" in message


def test_cache_pair_splits_the_layers_own_cache_by_its_head_size():
    cache = torch.arange(2 * 1 * 4 * 8, dtype=torch.float32).reshape(2, 1, 4, 8)
    ctx = SimpleNamespace(no_compile_layers={"l0": SimpleNamespace(kv_cache=cache, head_size=4)})
    key, value = context.cache_pair(ctx, "l0", WHERE)
    assert torch.equal(key, cache.transpose(1, 2)[..., :4]) and torch.equal(value, cache.transpose(1, 2)[..., 4:])
    ctx.no_compile_layers["l0"] = SimpleNamespace(kv_cache=cache)  # no head size: a page cannot be split
    with pytest.raises(ValueError) as err:
        context.cache_pair(ctx, "l0", WHERE)
    assert str(err.value).startswith(f"{WHERE}: expected") and "head_size None" in str(err.value)


# ---------------------------------------------------------------- step_semantics


@pytest.mark.parametrize("metadata", [
    SimpleNamespace(), SimpleNamespace(causal=True),
    SimpleNamespace(causal=True, mm_prefix_query_range_tensor=None, rswa_prefix_lens=None),
])
def test_causal_decoder_metadata_asks_for_nothing_else(metadata):
    assert context.step_semantics(metadata) is None


@pytest.mark.parametrize("metadata, says", [
    (SimpleNamespace(causal=False), "non-causal attention (attn_metadata.causal=False)"),
    (SimpleNamespace(causal=torch.tensor([True, False])), "per-request causality (attn_metadata.causal is a Tensor)"),
    (SimpleNamespace(causal=1), "per-request causality (attn_metadata.causal is a int)"),
    (SimpleNamespace(causal=None), "per-request causality (attn_metadata.causal is a NoneType)"),
    (SimpleNamespace(mm_prefix_query_range_tensor=torch.zeros(1, 2)),
     "PrefixLM bidirectional ranges (attn_metadata.mm_prefix_query_range_tensor)"),
    (SimpleNamespace(causal=True, rswa_prefix_lens=torch.zeros(2)),
     "R-SWA (the prompt kept beside a sliding window) (attn_metadata.rswa_prefix_lens)"),
    (SimpleNamespace(rswa_prefix_lens=0), "R-SWA (the prompt kept beside a sliding window) (attn_metadata.rswa_prefix_lens)"),
])
def test_metadata_asking_for_other_attention_says_what(metadata, says):
    assert context.step_semantics(metadata) == says


# ---------------------------------------------------------------- the per-step cuts


def test_metadata_of_a_layer_is_its_entry_of_the_per_layer_dict():
    entry = SimpleNamespace()
    assert context.metadata_of(SimpleNamespace(attn_metadata={"l0": entry}), "l0") is entry


@pytest.mark.parametrize("metadata, says", [(None, "got None"), ([{}], "got list"), ("m", "got str")])
def test_metadata_that_is_no_dict_is_refused(metadata, says):
    with pytest.raises(ValueError) as err:
        context.metadata_of(SimpleNamespace(attn_metadata=metadata), "l0")
    assert str(err.value) == f"forward_context.attn_metadata: expected a dict of per-layer metadata, {says}"


def test_lengths_and_block_tables_are_cut_to_the_steps_requests():
    metadata = SimpleNamespace(seq_lens=torch.tensor([5, 7, 9]), query_start_loc=torch.arange(8),
                               block_table=torch.arange(12).reshape(6, 2), block_tables=torch.arange(10).reshape(5, 2),
                               slot_mapping=torch.arange(20, dtype=torch.int32), num_actual_tokens=4)
    assert context.query_start_loc(metadata).tolist() == [0, 1, 2, 3]
    assert context.block_table(metadata, "block_table").tolist() == [[0, 1], [2, 3], [4, 5]]
    assert context.block_table(metadata, "block_tables").tolist() == [[0, 1], [2, 3], [4, 5]]
    slots = context.attention_slots(metadata)
    assert slots.tolist() == [0, 1, 2, 3] and slots.dtype == torch.int32
    assert slots.data_ptr() == metadata.slot_mapping.data_ptr()  # a view: read each step, never copied


# ---------------------------------------------------------------- kv_transfer_configured


def test_without_vllm_there_is_no_kv_transfer_connector(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer", None)  # the import fails
    assert context.kv_transfer_configured() is False


@pytest.mark.parametrize("configured", [True, False])
def test_with_vllm_the_connector_is_vllms_answer(monkeypatch, configured):
    module = types.ModuleType("vllm.distributed.kv_transfer")
    module.has_kv_transfer_group = lambda: configured
    for name in ("vllm", "vllm.distributed"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer", module)
    monkeypatch.setattr(sys.modules["vllm.distributed"], "kv_transfer", module, raising=False)
    assert context.kv_transfer_configured() is configured


# ---------------------------------------------------------------- passes and CacheViews


def test_each_pass_has_its_own_number_and_only_its_own_end_clears_it():
    first = context.begin_pass()
    assert context.PASS.current == first
    second = context.begin_pass()
    assert second != first and context.PASS.current == second
    context.end_pass(first)  # not the read under way: it stays
    assert context.PASS.current == second
    context.end_pass(second)
    assert context.PASS.current is None


def _ctx(cache) -> SimpleNamespace:
    return SimpleNamespace(no_compile_layers={"l0": SimpleNamespace(kv_cache=cache, head_size=4)})


def test_a_pair_cache_is_read_as_it_is_every_call():
    ctx = _ctx((torch.ones(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)))
    views = CacheViews("l0", WHERE)
    token = context.begin_pass()
    try:
        assert views(ctx)[0] is ctx.no_compile_layers["l0"].kv_cache[0]
        ctx.no_compile_layers["l0"].kv_cache = pair = (torch.ones(3, 4, 1, 8), torch.zeros(3, 4, 1, 8))
        assert views(ctx)[1] is pair[1]  # no views kept for a pair
    finally:
        context.end_pass(token)


def test_the_same_cache_tensor_reshaped_in_place_is_split_again():
    cache = torch.arange(4 * 1 * 4 * 8, dtype=torch.float32).reshape(4, 1, 4, 8)
    ctx, views = _ctx(cache), CacheViews("l0", WHERE)
    assert views(ctx)[0].shape == (4, 4, 1, 4)
    cache.data = cache.data.view(2, 2, 4, 8)  # the same tensor at the same address, another shape
    key, value = views(ctx)
    assert key.shape == (2, 4, 2, 4) and torch.equal(value, cache.transpose(1, 2)[..., 4:])


def test_an_unchanged_cache_keeps_its_views_across_reads():
    ctx, views = _ctx(torch.zeros(4, 1, 4, 8)), CacheViews("l0", WHERE)
    first = views(ctx)
    assert views(ctx) is first  # outside a read: checked, unchanged, the same views
    token = context.begin_pass()
    try:
        assert views(ctx) is first
    finally:
        context.end_pass(token)


def test_a_cache_replaced_by_a_pair_is_read_as_the_pair():
    ctx, views = _ctx(torch.zeros(4, 1, 4, 8)), CacheViews("l0", WHERE)
    views(ctx)
    ctx.no_compile_layers["l0"].kv_cache = pair = (torch.ones(3, 4, 1, 8), torch.zeros(3, 4, 1, 8))
    got = views(ctx)
    assert got[0] is pair[0] and got[1] is pair[1]


def test_a_cache_that_is_neither_a_tensor_nor_a_pair_is_refused_naming_where():
    views = CacheViews("l0", WHERE)
    with pytest.raises(ValueError) as err:
        views(_ctx((torch.ones(2, 4, 1, 8),)))  # one half only
    assert str(err.value).startswith(f"{WHERE}: expected a (key, value) pair") and str(err.value).endswith("got tuple")


def test_a_cache_tensor_of_no_known_layout_is_refused_naming_where():
    views = CacheViews("l0", WHERE)
    with pytest.raises(ValueError) as err:
        views(_ctx(torch.ones(4, 16, 8)))  # an MLA-style latent cache on a plain attention layer
    assert str(err.value).startswith(f"{WHERE}: expected a (key, value) pair") and str(err.value).endswith("(4, 16, 8)")
