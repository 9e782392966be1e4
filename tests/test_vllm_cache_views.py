"""`integrations/vllm/context.py: CacheViews`: a layer's key and value views, checked once per read of a
step's provided inputs (`begin_pass` / `end_pass`), never carried from one read to the next. Plain torch:
the forward context is a stand-in holding vLLM 0.23's `[num_blocks, 2, block_size, kv_heads, head_dim]`
cache per layer."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ascend_compile.integrations.vllm.context import CacheViews, begin_pass, end_pass


def _context() -> SimpleNamespace:
    return SimpleNamespace(no_compile_layers={"layers.0.attn": SimpleNamespace(kv_cache=torch.zeros(4, 2, 16, 1, 8))})


def _read(views: CacheViews, ctx: SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's read: the key's reader, then the value's."""
    token = begin_pass()
    try:
        return views(ctx)[0], views(ctx)[1]
    finally:
        end_pass(token)


def test_a_cache_moved_between_two_steps_reads_is_split_again():
    ctx = _context()
    views = CacheViews("layers.0.attn", "forward_context.no_compile_layers['layers.0.attn'].kv_cache")
    key, value = _read(views, ctx)
    layer = ctx.no_compile_layers["layers.0.attn"]
    assert key.data_ptr() == layer.kv_cache.data_ptr()
    layer.kv_cache.data = layer.kv_cache.data.clone()  # the same tensor, another storage
    key, value = _read(views, ctx)
    assert key.data_ptr() == layer.kv_cache.data_ptr()
    assert value.data_ptr() == layer.kv_cache[:, 1].data_ptr()
    layer.kv_cache = torch.ones(4, 2, 16, 1, 8)  # another tensor
    assert _read(views, ctx)[1].data_ptr() == layer.kv_cache[:, 1].data_ptr()


def test_within_one_read_the_second_half_takes_the_views_the_first_checked():
    ctx = _context()
    views = CacheViews("layers.0.attn", "forward_context.no_compile_layers['layers.0.attn'].kv_cache")
    token = begin_pass()
    try:
        first = views(ctx)
        del ctx.no_compile_layers["layers.0.attn"]  # not read again in this read
        assert views(ctx) is first
    finally:
        end_pass(token)


def test_outside_a_read_every_call_checks():
    ctx = _context()
    views = CacheViews("layers.0.attn", "forward_context.no_compile_layers['layers.0.attn'].kv_cache")
    _read(views, ctx)
    layer = ctx.no_compile_layers["layers.0.attn"]
    layer.kv_cache.data = layer.kv_cache.data.clone()
    assert views(ctx)[0].data_ptr() == layer.kv_cache.data_ptr()
