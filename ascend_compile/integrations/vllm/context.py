"""What the vLLM binder reads from a forward context: a layer's KV cache as key and value, a step's
metadata cut to its requests, slots as the cache-write op takes them, whether a KV connector is set.

The readers run once per step (they are the provided inputs' `read`, `binder.py`);
layouts and field names are vLLM 0.23.0's, vLLM 0.33.0's and vLLM-Ascend 0.23.0's. The layer caches
of FLASH_ATTN differ between the vLLM releases (docs/vllm.md, "vLLM 0.23 and 0.33"): 0.23 binds a
`[num_blocks, 2, block_size, kv_heads, head_dim]` tensor per layer, 0.33 a `[num_blocks, kv_heads,
block_size, 2 * head_dim]` page view of one allocation, in the physical order its KV-cache layout
gives, which `FlashAttentionImpl` splits with `kv_cache.transpose(1, 2).split(head_size, dim=-1)`.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch


def has_cache(kv_cache: Any) -> bool:
    """Whether a layer's KV cache is bound: a (key, value) pair, vLLM 0.23's 5-dim or 0.33's 4-dim tensor."""
    if isinstance(kv_cache, (tuple, list)):
        return len(kv_cache) >= 2 and all(isinstance(t, torch.Tensor) and t.numel() for t in kv_cache[:2])
    return isinstance(kv_cache, torch.Tensor) and kv_cache.dim() in (4, 5) and kv_cache.numel() > 0


def split_cache(kv_cache: Any, where: str, head_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's key and value caches, `[num_blocks, block_size, kv_heads, head_dim]` views each:
    vLLM-Ascend's `(key, value)` pair, vLLM 0.23's `[num_blocks, 2, ...]` tensor unbound on dim 1, or
    vLLM 0.33's `[num_blocks, kv_heads, block_size, 2 * head_size]` page split as its FlashAttentionImpl
    splits it (`head_size`: the layer's)."""
    if isinstance(kv_cache, (tuple, list)) and len(kv_cache) >= 2:
        return kv_cache[0], kv_cache[1]
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 5 and kv_cache.shape[1] == 2:
        return kv_cache[:, 0], kv_cache[:, 1]
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4 and head_size and kv_cache.shape[3] == 2 * head_size:
        key, value = kv_cache.transpose(1, 2).split(head_size, dim=-1)
        return key, value
    raise ValueError(f"{where}: expected a (key, value) pair or a [num_blocks, 2, block_size, kv_heads, head_dim] "
                     f"tensor (vLLM 0.23's FLASH_ATTN layout), or a [num_blocks, kv_heads, block_size, 2 * head_size] "
                     f"page (vLLM 0.33's; head_size {head_size}), got "
                     f"{tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__}")


#: Per-step metadata fields of vLLM 0.33 that ask for attention other than causal decoder attention
#: (None where unused): PrefixLM's bidirectional multimodal ranges and R-SWA's kept prompt prefix.
NON_CAUSAL_FIELDS = {"mm_prefix_query_range_tensor": "PrefixLM bidirectional ranges",
                     "rswa_prefix_lens": "R-SWA (the prompt kept beside a sliding window)"}


def step_semantics(metadata: Any) -> str | None:
    """Why one step's metadata asks for attention other than the causal attention `ascend.attention`
    computes (None: it does not): `causal` False, or a per-request tensor (vLLM 0.33), or a field of
    `NON_CAUSAL_FIELDS` set. Checked at the first compiled step (a refusal) and at every step after
    it (that step runs as traced: vLLM's kernels)."""
    causal = getattr(metadata, "causal", True)
    if causal is False:
        return "non-causal attention (attn_metadata.causal=False)"
    if causal is not True:
        return f"per-request causality (attn_metadata.causal is a {type(causal).__name__})"
    for field, what in NON_CAUSAL_FIELDS.items():
        if getattr(metadata, field, None) is not None:
            return f"{what} (attn_metadata.{field})"
    return None


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
    attn_layer = ctx.no_compile_layers[layer]
    return split_cache(attn_layer.kv_cache, where, getattr(attn_layer, "head_size", None))


class _Pass:
    """The step's read of its provided inputs under way (`binder._read_all`), a number no other read
    had; None between reads."""

    current: int | None = None


PASS = _Pass()
_passes = itertools.count()


def begin_pass() -> int:
    """A read of a step's provided inputs begins: what `CacheViews` checked in an earlier one is checked again."""
    PASS.current = token = next(_passes)
    return token


def end_pass(token: int) -> None:
    if PASS.current == token:
        PASS.current = None


class CacheViews:
    """One layer's key and value views (`cache_pair`), read every step: split again only when the
    layer's cache is another tensor than the last step's, or the same one moved or resized (a view
    made earlier would keep the old storage). The views hold that storage, so no other tensor can
    have its address meanwhile. A (key, value) pair is read as it is.

    The key's and the value's readers both call it in one read of the step's inputs (`begin_pass`):
    the second finds the cache checked in that read and takes the views as the first left them (no
    code runs between the two, so nothing could move the cache); a read that is not one's own (a new
    number, or none) checks again."""

    def __init__(self, layer: str, where: str) -> None:
        self.layer, self.where = layer, where
        self._cache: Any = None
        self._address: int | None = None
        self._shape: Any = None
        self._pair: tuple[torch.Tensor, torch.Tensor] | None = None
        self._checked: int | None = None  # the read the views were last checked in

    def __call__(self, ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self._checked is not None and self._checked == PASS.current:
            return self._pair
        cache = ctx.no_compile_layers[self.layer].kv_cache
        if not isinstance(cache, torch.Tensor):
            return cache_pair(ctx, self.layer, self.where)
        if cache is not self._cache or cache.data_ptr() != self._address or cache.shape != self._shape:
            self._pair = cache_pair(ctx, self.layer, self.where)
            self._cache, self._address, self._shape = cache, cache.data_ptr(), cache.shape
        self._checked = PASS.current
        return self._pair
