"""Multi-head latent attention (DeepSeek's MLA) in the `ascend` library: the op pair a model calls
and the kernel the passes rewrite it into.

- `torch.ops.ascend.mla_attention(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, seq_lens, query_start_loc, scale) -> Tensor`
  The absorbed form of MLA: every query head attends one latent KV head. `q_nope [T, H, kv_lora_rank]`
  is the query's non-rope part with W_UK already absorbed into it, `q_pe [T, H, rope_dim]` its rope
  part; `kv_c_cache [num_blocks, block_size, kv_lora_rank]` holds each token's compressed latent and
  `k_pe_cache [num_blocks, block_size, rope_dim]` its (shared, rotated) rope key. The score of a query
  token against a cached token is `scale * (q_nope . kv_c + q_pe . k_pe)`, the value is `kv_c`, so the
  output is `[T, H, kv_lora_rank]`, still latent: the model up-projects it with W_UV afterwards.
  `block_table`, `seq_lens`, `query_start_loc` and `scale` are those of `ascend.attention`: query tokens
  are the last `q_len` positions of their sequence, causal among themselves; a sequence with
  `seq_len == 0` (padding) yields zeros.
- `torch.ops.ascend.mla_cache_write(kv_c, k_pe, kv_c_cache, k_pe_cache, slot_mapping) -> ()`
  Writes `kv_c [T, kv_lora_rank]` and `k_pe [T, rope_dim]` into the caches at `slot_mapping [T]`
  (int32 or int64; slot = block * block_size + offset); slot `-1` is skipped (padding rows never write
  the cache). Mutates the caches.
- The kernel: `torch.ops.ascend.mla_fused_infer_attention(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, actual_seq_qlen, actual_seq_kvlen, scale, workspace, out)`
  FIA v2's MLA form (`query_rope` / `key_rope`, one KV head, TND): `actual_seq_qlen` cumulative query
  ends (last == T), `actual_seq_kvlen` per-sequence KV lengths, both host-side lists of ints, with a
  caller-provided `workspace` (uint8, sized by `tiling.workspace_nbytes(tiling.MLA, ...)`) and `out`.

The reference kernel (`reference.mla_fused_infer_attention`) is split-K attention with a real
workspace, like PA's and FIA's. On CUDA the kernel runs in its device-length form, Triton kernels
reading the lengths on the device (`ops/cuda_mla.py`, `ops/cuda_triton_mla.py`).
"""
from __future__ import annotations

import torch

from . import reference, tiling, validate
from .library import _check_out


def check_mla_metadata(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_cache: torch.Tensor, k_pe_cache: torch.Tensor,
                       block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    """The checks of `mla_attention` that read no data (so tracing reports them too)."""
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected a 1-D [B] torch.int32 tensor, got shape {tuple(seq_lens.shape)}")
    num_seqs = seq_lens.shape[0]
    validate.check_int32_vector("seq_lens", seq_lens, num_seqs, q_nope.device)
    validate.check_int32_vector("query_start_loc", query_start_loc, num_seqs + 1, q_nope.device)
    validate.check_mla_tensors(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, num_seqs)


def check_mla_kernel(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_cache: torch.Tensor, k_pe_cache: torch.Tensor,
                     block_table: torch.Tensor, actual_seq_qlen: list[int], actual_seq_kvlen: list[int],
                     workspace: torch.Tensor, out: torch.Tensor, check_data: bool = True) -> list[int]:
    """All argument checks of the MLA kernel; returns the per-sequence query lengths. Without
    `check_data` the block ids are not read (a device kernel's binding reads no tensor on the host)."""
    if len(actual_seq_qlen) != len(actual_seq_kvlen):
        raise ValueError(f"actual_seq_kvlen: expected one length per sequence ({len(actual_seq_qlen)}), "
                         f"got {len(actual_seq_kvlen)}")
    validate.check_mla_tensors(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, len(actual_seq_kvlen))
    _check_out(q_nope, workspace, out)
    query_lens = validate.query_lens_from_ends(actual_seq_qlen, q_nope.shape[0], "actual_seq_qlen")
    block_size = kv_c_cache.shape[1]
    validate.check_lengths(actual_seq_kvlen, query_lens, block_table.shape[1], block_size, "actual_seq_kvlen")
    if check_data:
        validate.check_block_ids(block_table, actual_seq_kvlen, block_size, kv_c_cache.shape[0], "block_table")
    return query_lens


@torch.library.custom_op("ascend::mla_fused_infer_attention", mutates_args=("workspace", "out"))
def mla_fused_infer_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_cache: torch.Tensor,
    k_pe_cache: torch.Tensor,
    block_table: torch.Tensor,
    actual_seq_qlen: list[int],
    actual_seq_kvlen: list[int],
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The MLA kernel: absorbed latent attention, TND, host-side lengths, into `out`. Its batch is
    its lists' length; `block_table` may hold more rows, of which it reads the first."""
    block_table = validate.sequence_rows(block_table, len(actual_seq_kvlen))
    query_lens = check_mla_kernel(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, actual_seq_qlen,
                                  actual_seq_kvlen, workspace, out)
    reference.mla_fused_infer_attention(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, actual_seq_qlen,
                                        actual_seq_kvlen, query_lens, scale, workspace, out)


@mla_fused_infer_attention.register_fake
def _(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, actual_seq_qlen, actual_seq_kvlen, scale, workspace,
      out) -> None:
    return None


@torch.library.custom_op("ascend::mla_attention", mutates_args=())
def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_cache: torch.Tensor,
    k_pe_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The MLA op a model calls (see the module docstring); runs the MLA kernel with its own workspace."""
    check_mla_metadata(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, seq_lens, query_start_loc)
    return attend_with_host_lengths(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, seq_lens, query_start_loc,
                                    scale)


def attend_with_host_lengths(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_cache: torch.Tensor,
                             k_pe_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                             query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """`mla_attention` through the host-length kernel (its reference), its lengths read on the host."""
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    query_lens = validate.query_lens_from_start_loc(starts, q_nope.shape[0])
    shape = tiling.AttentionShape.of_mla(q_nope, q_pe, kv_c_cache)
    scratch = torch.empty(tiling.workspace_nbytes(tiling.MLA, shape, lens, query_lens), dtype=torch.uint8,
                          device=q_nope.device)
    out = torch.empty_like(q_nope)
    mla_fused_infer_attention(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, starts[1:], lens, scale, scratch, out)
    return out


@mla_attention.register_fake
def _(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, seq_lens, query_start_loc, scale):
    check_mla_metadata(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, seq_lens, query_start_loc)
    return torch.empty_like(q_nope)


def check_mla_cache_write(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_c_cache: torch.Tensor, k_pe_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """The checks of `mla_cache_write` that read no device data: shapes, dtypes, devices."""
    if kv_c.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != kv_c.shape[0]:
        raise ValueError(f"kv_c/k_pe: expected [T, kv_lora_rank] and [T, rope_dim] tensors, got "
                         f"{tuple(kv_c.shape)} and {tuple(k_pe.shape)}")
    for name, cache, row in (("kv_c_cache", kv_c_cache, kv_c), ("k_pe_cache", k_pe_cache, k_pe)):
        if cache.dim() != 3 or cache.shape[2] != row.shape[1] or cache.shape[:2] != kv_c_cache.shape[:2]:
            raise ValueError(f"{name}: expected [num_blocks, block_size, {row.shape[1]}] (the blocks of kv_c_cache), "
                             f"got {tuple(cache.shape)}")
    for name, t in (("k_pe", k_pe), ("kv_c_cache", kv_c_cache), ("k_pe_cache", k_pe_cache)):
        if t.dtype != kv_c.dtype:
            raise ValueError(f"{name}: expected dtype {kv_c.dtype} (kv_c's), got {t.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != (kv_c.shape[0],):
        raise ValueError(f"slot_mapping: expected a [{kv_c.shape[0]}] torch.int32 or torch.int64 tensor, got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in (("k_pe", k_pe), ("kv_c_cache", kv_c_cache), ("k_pe_cache", k_pe_cache),
                    ("slot_mapping", slot_mapping)):
        if t.device != kv_c.device:
            raise ValueError(f"{name}: expected device {kv_c.device} (kv_c's), got {t.device}")


@torch.library.custom_op("ascend::mla_cache_write", mutates_args=("kv_c_cache", "k_pe_cache"))
def mla_cache_write(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_c_cache: torch.Tensor, k_pe_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Write each token's latent and rope key into the caches at `slot_mapping`; slot -1 is skipped."""
    check_mla_cache_write(kv_c, k_pe, kv_c_cache, k_pe_cache, slot_mapping)
    slots = slot_mapping.long()
    if slots.numel() and int(slots.min()) < -1:
        raise ValueError(f"slot_mapping: expected slots >= 0 or -1 (skip), got {int(slots.min())}")
    valid = slots >= 0
    slots = slots[valid]
    capacity = kv_c_cache.shape[0] * kv_c_cache.shape[1]
    if slots.numel() and int(slots.max()) >= capacity:
        raise ValueError(f"slot_mapping: expected slots below {capacity} (num_blocks * block_size) or -1, "
                         f"got {int(slots.max())}")
    blocks, offsets = slots // kv_c_cache.shape[1], slots % kv_c_cache.shape[1]
    kv_c_cache[blocks, offsets] = kv_c[valid]
    k_pe_cache[blocks, offsets] = k_pe[valid]


@mla_cache_write.register_fake
def _(kv_c, k_pe, kv_c_cache, k_pe_cache, slot_mapping) -> None:
    check_mla_cache_write(kv_c, k_pe, kv_c_cache, k_pe_cache, slot_mapping)
    return None
