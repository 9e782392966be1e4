"""A forward context to rewrite a vLLM graph against before any step exists: vLLM's layers, with
stand-in metadata and KV caches made of fake tensors.

The graph memory of our captures has to be known at vLLM's profiling run (`memory.py`), when there
is no metadata and no KV cache yet; what the captures allocate is that of the graph as the binder
rewrites it (MLA's absorbed projections, the attention result copied into vLLM's output). So the
binder's rewrite runs once more, on a copy, against this context: the layers are vLLM's own (their
heads, features, weights); each metadata group (one per distinct KV-cache spec, as vLLM groups its
layers) is an object with the fields the rewrite reads, with one slot mapping, one request long, its block table
`max_blocks` wide (FLASH_ATTN's `block_table`, or vLLM-Ascend's `block_tables` and `slot_mapping`
where the backend writes the cache inside its attention op; MLA's `decode` part); each layer's cache
a fake tensor of one block in the layout the binder splits (`[1, 2, block_size, kv_heads,
head_size]`, MLA's `[1, block_size, kv_lora_rank + rope]`). Nothing is allocated on the device.
"""
from __future__ import annotations

import types
from typing import Any, Sequence

import torch


class _WithCache:
    """A vLLM layer seen with another `kv_cache` (everything else is the layer's)."""

    def __init__(self, layer: Any, kv_cache: torch.Tensor) -> None:
        self._layer, self.kv_cache = layer, kv_cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def _spec(layer: Any, vllm_config: Any) -> Any:
    """The layer's KV-cache spec (vLLM groups layers by it), or `id(layer)`: a layer whose spec cannot
    be had, or cannot key a group (not hashable), is a group of its own."""
    try:
        spec = layer.get_kv_cache_spec(vllm_config)
        hash(spec)
    except Exception:  # noqa: BLE001 - a layer without a (hashable) spec: a group of its own
        return id(layer)
    return spec


def planning_context(names: Sequence[str], vllm_config: Any, device: torch.device, fake_mode: Any,
                     max_blocks: int) -> Any:
    """The context (see the module docstring) for the layers `names` of `vllm_config`."""
    block_size = int(vllm_config.cache_config.block_size)
    layers = vllm_config.compilation_config.static_forward_context
    groups: dict[Any, Any] = {}
    metadata, caches, slots = {}, {}, {}
    with fake_mode:
        def fake(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(tuple(shape), dtype=dtype, device=device)

        for name in names:
            layer = layers[name]
            spec = _spec(layer, vllm_config)
            dtype = getattr(spec, "dtype", None) or vllm_config.model_config.dtype
            if hasattr(layer, "kv_lora_rank"):
                cache = fake((1, block_size, int(layer.kv_lora_rank) + int(layer.qk_rope_head_dim)), dtype)
            else:
                cache = fake((1, 2, block_size, int(layer.num_kv_heads), int(layer.head_size)), dtype)
            caches[name] = _WithCache(layer, cache)
            if spec not in groups:  # one metadata object and one slot mapping per group, as vLLM's runner passes
                groups[spec] = _metadata(layer, fake, max_blocks), fake((1,), torch.int64)
            metadata[name], slots[name] = groups[spec]
    return types.SimpleNamespace(attn_metadata=metadata, no_compile_layers=caches, slot_mapping=slots)


def _metadata(layer: Any, fake: Any, max_blocks: int) -> Any:
    """One request's metadata with the fields the binder's rewrite reads for `layer`'s backend."""
    lens, loc, table = fake((1,), torch.int32), fake((2,), torch.int32), fake((1, max_blocks), torch.int32)
    if hasattr(layer, "kv_lora_rank"):  # MLA: decodes and prefills apart (`mla.py`)
        return types.SimpleNamespace(num_reqs=1, num_decodes=1, num_prefills=0, num_actual_tokens=1,
                                     query_start_loc=loc, prefill=None,
                                     decode=types.SimpleNamespace(seq_lens=lens, block_table=table))
    if getattr(layer.attn_backend, "forward_includes_kv_cache_update", True):  # vLLM-Ascend's form
        return types.SimpleNamespace(seq_lens=lens, query_start_loc=loc, block_tables=table, num_actual_tokens=1,
                                     slot_mapping=fake((1,), torch.int64))
    return types.SimpleNamespace(seq_lens=lens, query_start_loc=loc, block_table=table, num_actual_tokens=1)
