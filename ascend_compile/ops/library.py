"""The `ascend` torch library: op schemas, fake impls and the default (reference) kernels.

Every op is a `torch.library.custom_op`, so dynamo keeps each as one opaque FX node. Device
modules (`ops/cuda.py`, `ops/npu/kernels.py`) register faster kernels for their device type on the same
ops; the reference kernels here serve every other device.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import reference, tiling, validate
from .features import PLAIN, AttentionFeatures
from .kernel_policy import KernelPolicy, choose_kernel

#: The policy `ascend.attention` uses in eager: the compiler's default one.
EAGER_POLICY = KernelPolicy()
#: Slot-mapping dtypes the cache write takes: vLLM's int64 and vLLM-Ascend's int32
#: (`vllm_ascend/worker/block_table.py`), both of which torch_npu's `npu_scatter_pa_kv_cache` accepts
#: ("slot_mapping...数据类型支持int32和int64", torch_npu 2.14 `_op_plugin_docs.py`).
SLOT_DTYPES = (torch.int32, torch.int64)


def _check_out(query: torch.Tensor, workspace: torch.Tensor, out: torch.Tensor) -> None:
    if workspace.dtype != torch.uint8 or workspace.dim() != 1:
        raise ValueError(f"workspace: expected a 1-D torch.uint8 tensor, got {workspace.dtype} {tuple(workspace.shape)}")
    if workspace.device != query.device:
        raise ValueError(f"workspace: expected device {query.device} (the query's), got {workspace.device}")
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"out: expected {tuple(query.shape)} {query.dtype} on {query.device} (like query), "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )


def check_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: list[int],
    workspace: torch.Tensor,
    out: torch.Tensor,
    check_data: bool = True,
) -> None:
    """All argument checks of PA; `check_data` False skips the one that reads the block table."""
    validate.check_attention_tensors(query, key_cache, value_cache, block_table, len(context_lens))
    if query.shape[0] != len(context_lens):
        raise ValueError(
            f"query: PA is decode-only and expects one query token per sequence "
            f"({len(context_lens)} context_lens), got {query.shape[0]} tokens"
        )
    _check_out(query, workspace, out)
    validate.check_lengths(context_lens, [1] * len(context_lens), block_table.shape[1], key_cache.shape[1], "context_lens")
    if check_data:
        validate.check_block_ids(block_table, context_lens, key_cache.shape[1], key_cache.shape[0], "block_table")


def check_fused_infer_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    actual_seq_lengths: list[int],
    actual_seq_lengths_kv: list[int],
    workspace: torch.Tensor,
    out: torch.Tensor,
    check_data: bool = True,
    features: AttentionFeatures = PLAIN,
) -> list[int]:
    """All argument checks of FIA; returns the per-sequence query lengths. With a window, only the
    blocks a sequence reads must be valid."""
    if len(actual_seq_lengths) != len(actual_seq_lengths_kv):
        raise ValueError(
            f"actual_seq_lengths_kv: expected one length per sequence ({len(actual_seq_lengths)}), "
            f"got {len(actual_seq_lengths_kv)}"
        )
    validate.check_attention_tensors(query, key_cache, value_cache, block_table, len(actual_seq_lengths_kv))
    _check_out(query, workspace, out)
    query_lens = validate.query_lens_from_ends(actual_seq_lengths, query.shape[0], "actual_seq_lengths")
    validate.check_lengths(
        actual_seq_lengths_kv, query_lens, block_table.shape[1], key_cache.shape[1], "actual_seq_lengths_kv"
    )
    if check_data:
        spans = [features.span(n, q) for n, q in zip(actual_seq_lengths_kv, query_lens)]
        validate.check_block_ids(block_table, actual_seq_lengths_kv, key_cache.shape[1], key_cache.shape[0],
                                 "block_table", spans)
    return query_lens


@torch.library.custom_op("ascend::paged_attention", mutates_args=("workspace", "out"))
def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: list[int],
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """PA: decode attention over the paged cache into `out`; `context_lens` are host-side lengths."""
    check_paged_attention(query, key_cache, value_cache, block_table, context_lens, workspace, out)
    reference.paged_attention(query, key_cache, value_cache, block_table, context_lens, scale, workspace, out)


@paged_attention.register_fake
def _(query, key_cache, value_cache, block_table, context_lens, scale, workspace, out) -> None:
    return None


@torch.library.custom_op("ascend::fused_infer_attention", mutates_args=("workspace", "out"))
def fused_infer_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    actual_seq_lengths: list[int],
    actual_seq_lengths_kv: list[int],
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
    window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> None:
    """FIA: TND attention (cumulative query ends, per-sequence KV lengths, host-side) into `out`,
    with a left window, a logit soft-cap and per-head sinks (`features.py`). Its batch is its lists'
    length; `block_table` may hold more rows, of which it reads the first."""
    features = check_features(query, window, soft_cap, sinks)
    block_table = validate.sequence_rows(block_table, len(actual_seq_lengths_kv))
    query_lens = check_fused_infer_attention(
        query, key_cache, value_cache, block_table, actual_seq_lengths, actual_seq_lengths_kv, workspace, out,
        features=features,
    )
    reference.fused_infer_attention(
        query, key_cache, value_cache, block_table,
        actual_seq_lengths, actual_seq_lengths_kv, query_lens, scale, workspace, out, features, sinks,
    )


@fused_infer_attention.register_fake
def _(query, key_cache, value_cache, block_table, actual_seq_lengths, actual_seq_lengths_kv, scale, workspace, out,
      window=None, soft_cap=None, sinks=None) -> None:
    return None


def check_features(query: torch.Tensor, window: int | None, soft_cap: float | None,
                   sinks: torch.Tensor | None) -> AttentionFeatures:
    """The features of a call, checked: a positive window and soft-cap, sinks a floating `[H]`
    tensor on the query's device (the kernels compute with it in float32)."""
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != query.shape[1] or not sinks.is_floating_point()
                              or sinks.device != query.device):
        raise ValueError(f"sinks: expected a floating [{query.shape[1]}] tensor (one logit per query head) on "
                         f"{query.device}, got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")
    return AttentionFeatures(window, soft_cap, sinks is not None)


@torch.library.custom_op("ascend::workspace", mutates_args=())
def workspace(nbytes: int, device: torch.device) -> torch.Tensor:
    """A fresh, zeroed uint8 scratch buffer of `nbytes` for the attention kernels."""
    if nbytes < 0:
        raise ValueError(f"nbytes: expected a non-negative byte count, got {nbytes}")
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


@workspace.register_fake
def _(nbytes, device):
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def check_attention_metadata(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """The unified op's checks that need no data, so tracing (fake tensors) reports them too.
    `seq_lens` may live on the host: torch_npu's PA reads its lengths there, and the torchair pass
    hands this very input to it."""
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected a 1-D [B] torch.int32 tensor, got shape {tuple(seq_lens.shape)}")
    num_seqs = seq_lens.shape[0]
    if seq_lens.device.type != "cpu" and seq_lens.device != query.device:
        raise ValueError(
            f"seq_lens: expected device {query.device} (the query's), got {seq_lens.device}; host lengths on the "
            f"CPU are accepted too (as vLLM-Ascend keeps PA's context_lens)"
        )
    validate.check_int32_vector("seq_lens", seq_lens, num_seqs, seq_lens.device)
    validate.check_int32_vector("query_start_loc", query_start_loc, num_seqs + 1, query.device)
    validate.check_attention_tensors(query, key_cache, value_cache, block_table, num_seqs)


def choose_eager_kernel(query_lens: list[int], shape: tiling.AttentionShape,
                        features: AttentionFeatures = PLAIN) -> str:
    """The kernel `ascend.attention` uses in eager: the default policy's, for this batch."""
    decode = all(n == 1 for n in query_lens)
    return choose_kernel(EAGER_POLICY, len(query_lens), decode, shape, features).kernel


@torch.library.custom_op("ascend::attention", mutates_args=())
def attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The unified attention op a model calls; picks PA or FIA and allocates its own workspace.
    `window`, `soft_cap` and `sinks` (`features.py`) default to plain causal attention; a call with
    any of them runs FIA (PA has none of them)."""
    check_attention_metadata(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    features = check_features(query, window, soft_cap, sinks)
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    query_lens = validate.query_lens_from_start_loc(starts, query.shape[0])
    shape = tiling.AttentionShape.of(query, key_cache)
    kernel = choose_eager_kernel(query_lens, shape, features)
    spans = [features.span(n, q) for n, q in zip(lens, query_lens)]
    scratch = torch.empty(
        tiling.workspace_nbytes(kernel, shape, spans, query_lens), dtype=torch.uint8, device=query.device
    )
    out = torch.empty_like(query)
    if kernel == tiling.PA:
        paged_attention(query, key_cache, value_cache, block_table, lens, scale, scratch, out)
    else:
        fused_infer_attention(query, key_cache, value_cache, block_table, starts[1:], lens, scale, scratch, out,
                              window, soft_cap, sinks)
    return out


@attention.register_fake
def _(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, window=None, soft_cap=None,
      sinks=None):
    check_attention_metadata(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    check_features(query, window, soft_cap, sinks)
    return torch.empty_like(query)


@torch.library.custom_op("ascend::reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value [T, KVH, D]` into the caches at `slot_mapping`; slot -1 is skipped."""
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if slots.numel() and int(slots.max()) >= key_cache.shape[0] * key_cache.shape[1]:
        raise ValueError(
            f"slot_mapping: expected slots below {key_cache.shape[0] * key_cache.shape[1]} "
            f"(num_blocks * block_size) or -1, got {int(slots.max())}"
        )
    # by block and offset, so caches that are strided views (vLLM's [num_blocks, 2, ...] cache unbound) work too
    blocks, offsets = slots // key_cache.shape[1], slots % key_cache.shape[1]
    key_cache[blocks, offsets] = key[valid]
    value_cache[blocks, offsets] = value[valid]


def check_cache_write(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The checks of `reshape_and_cache` that read no device data: shapes, dtypes, devices."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value: expected two [T, KVH, D] tensors of one shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"key_cache/value_cache: expected [num_blocks, block_size, {key.shape[1]}, {key.shape[2]}], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype != key.dtype:
            raise ValueError(f"{name}: expected dtype {key.dtype} (the key's), got {t.dtype}")
    if slot_mapping.dtype not in SLOT_DTYPES or slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping: expected a [{key.shape[0]}] torch.int32 or torch.int64 tensor, got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        if t.device != key.device:
            raise ValueError(f"{name}: expected device {key.device} (the key's), got {t.device}")


def check_reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """All checks of `reshape_and_cache`: `check_cache_write` and the lower bound of the slots."""
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    if slot_mapping.numel() and int(slot_mapping.min()) < -1:
        raise ValueError(f"slot_mapping: expected slots >= 0 or -1 (skip), got {int(slot_mapping.min())}")


@reshape_and_cache.register_fake
def _(key, value, key_cache, value_cache, slot_mapping) -> None:
    return None
