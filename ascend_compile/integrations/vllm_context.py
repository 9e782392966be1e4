"""What the vLLM binder reads from a forward context: a layer's KV cache as key and value, a step's
metadata cut to its requests, slots as the cache-write op takes them, whether a KV connector is set.

The readers run once per step (they are the provided inputs' `read`, `integrations/vllm.py`);
layouts and field names are vLLM 0.23.0's and vLLM-Ascend 0.23.0's.
"""
from __future__ import annotations

from typing import Any

import torch


def has_cache(kv_cache: Any) -> bool:
    if isinstance(kv_cache, (tuple, list)):
        return len(kv_cache) >= 2 and all(isinstance(t, torch.Tensor) and t.numel() for t in kv_cache[:2])
    return isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 5


def split_cache(kv_cache: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(kv_cache, (tuple, list)) and len(kv_cache) >= 2:
        return kv_cache[0], kv_cache[1]
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 5 and kv_cache.shape[1] == 2:
        return kv_cache[:, 0], kv_cache[:, 1]
    raise ValueError(f"{where}: expected a (key, value) pair or a [num_blocks, 2, block_size, kv_heads, head_dim] "
                     f"tensor (FLASH_ATTN's layout), got "
                     f"{tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__}")


def metadata_of(ctx: Any, layer: str) -> Any:
    metadata = ctx.attn_metadata
    if not isinstance(metadata, dict):
        raise ValueError("forward_context.attn_metadata: expected a dict of per-layer metadata, got "
                         + ("None" if metadata is None else type(metadata).__name__))
    return metadata[layer]


def query_start_loc(metadata: Any) -> torch.Tensor:
    return metadata.query_start_loc[: metadata.seq_lens.shape[0] + 1]


def block_table(metadata: Any, field: str) -> torch.Tensor:
    return getattr(metadata, field)[: metadata.seq_lens.shape[0]]


def attention_slots(metadata: Any) -> torch.Tensor:
    """vLLM-Ascend's slots of the real tokens (the attention op writes the cache itself), int32 as
    vLLM-Ascend keeps them: `ascend.reshape_and_cache` takes them as they are (`ops/library.py: SLOT_DTYPES`)."""
    return metadata.slot_mapping[: metadata.num_actual_tokens]


def kv_transfer_configured() -> bool:
    """Whether vLLM has a KV-transfer connector (disaggregated prefill, LMCache-style offload) set up."""
    try:
        from vllm.distributed.kv_transfer import has_kv_transfer_group
    except ImportError:  # no vLLM (the stand-in's tests): no connector
        return False
    return has_kv_transfer_group()


def cache_pair(ctx: Any, layer: str, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    return split_cache(ctx.no_compile_layers[layer].kv_cache, where)
