"""What differs between vLLM 0.23 and 0.33 in what the binder reads, without vLLM installed (the main
venv): 0.33's FLASH_ATTN cache page, split into the key and value views vLLM itself writes, in both
layouts vLLM 0.33 allocates FLASH_ATTN's caches in, and the per-step metadata that asks for other
than causal attention. vLLM's own code runs these paths in tests/test_vllm_real.py (both releases)."""
from __future__ import annotations

import types

import pytest
import torch

from ascend_compile.integrations.vllm import context
from ascend_compile.ops import library  # noqa: F401  (registers torch.ops.ascend)

NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_SIZE = 3, 2, 4, 8
WHERE = "forward_context.no_compile_layers['l'].kv_cache"
# vLLM 0.33's logical per-layer page [B, H, N, C] in physical order: LBNHC (FLASH_ATTN's default, NHD) keeps
# a block's tokens outermost, LBHNC (HND) its heads (`vllm/v1/kv_cache_layout.py`)
LAYOUTS = {"LBNHC": (0, 2, 1, 3), "LBHNC": (0, 1, 2, 3)}


def _page(layout: str) -> torch.Tensor:
    """A float32 `[num_blocks, kv_heads, block_size, 2 * head_size]` view of one flat buffer, strided in
    `layout`'s physical order, as `create_kv_cache_views` makes it; every element holds its own offset."""
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    order = LAYOUTS[layout]
    strides, step = [0] * 4, 1
    for dim in reversed(order):
        strides[dim], step = step, step * shape[dim]
    flat = torch.arange(step, dtype=torch.float32)
    return torch.as_strided(flat, shape, strides)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_033_page_splits_into_the_views_flash_attention_reads(layout):
    """Key and value `[num_blocks, block_size, kv_heads, head_size]`: token n of block b, head h, is
    `page[b, h, n, :head_size]` and `page[b, h, n, head_size:]` (FlashAttentionImpl: `(B, H, N, 2*D) ->
    ((B, N, H, D), (B, N, H, D))`)."""
    page = _page(layout)
    assert context.has_cache(page)
    key, value = context.split_cache(page, WHERE, HEAD_SIZE)
    assert key.shape == value.shape == (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    for b, n, h in ((0, 0, 0), (1, 3, 1), (2, 1, 0)):
        assert torch.equal(key[b, n, h], page[b, h, n, :HEAD_SIZE])
        assert torch.equal(value[b, n, h], page[b, h, n, HEAD_SIZE:])
    assert key.untyped_storage().data_ptr() == page.untyped_storage().data_ptr()  # views: written in place


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_cache_write_lands_where_vllm_033_reads_its_page(layout):
    page = _page(layout)
    key_cache, value_cache = context.split_cache(page, WHERE, HEAD_SIZE)
    key = torch.full((2, KV_HEADS, HEAD_SIZE), -1.0)
    value = torch.full((2, KV_HEADS, HEAD_SIZE), -2.0)
    torch.ops.ascend.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([5, -1]))
    block, offset = divmod(5, BLOCK_SIZE)
    written = page[block, :, offset]  # [kv_heads, 2 * head_size]
    assert torch.equal(written[:, :HEAD_SIZE], key[0]) and torch.equal(written[:, HEAD_SIZE:], value[0])
    assert int((page < 0).sum()) == 2 * KV_HEADS * HEAD_SIZE  # one token's key and value, nothing else


def test_a_cache_of_no_known_layout_is_refused_naming_both_releases():
    with pytest.raises(ValueError, match=r"\[num_blocks, 2, block_size, kv_heads, head_dim\] tensor \(vLLM 0\.23's "
                                         r"FLASH_ATTN layout\), or a \[num_blocks, kv_heads, block_size, "
                                         r"2 \* head_size\] page \(vLLM 0\.33's; head_size 6\), got \(3, 2, 4, 16\)"):
        context.split_cache(_page("LBNHC"), WHERE, 6)  # a head size the page does not hold


@pytest.mark.parametrize("fields, reason", [
    ({"causal": False}, "non-causal attention (attn_metadata.causal=False)"),
    ({"causal": torch.ones(2, dtype=torch.int32)}, "per-request causality (attn_metadata.causal is a Tensor)"),
    ({"mm_prefix_query_range_tensor": torch.full((3, 2), -1)},
     "PrefixLM bidirectional ranges (attn_metadata.mm_prefix_query_range_tensor)"),
    ({"rswa_prefix_lens": torch.tensor([4, 5])},
     "R-SWA (the prompt kept beside a sliding window) (attn_metadata.rswa_prefix_lens)"),
])
def test_metadata_asking_for_other_than_causal_attention_is_named(fields, reason):
    assert context.step_semantics(types.SimpleNamespace(**fields)) == reason


@pytest.mark.parametrize("fields", [{}, {"causal": True}, {"causal": True, "mm_prefix_query_range_tensor": None,
                                                            "rswa_prefix_lens": None}])
def test_causal_metadata_is_served(fields):
    assert context.step_semantics(types.SimpleNamespace(**fields)) is None
