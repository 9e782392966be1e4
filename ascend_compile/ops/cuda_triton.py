"""Triton kernels of the CUDA runtime: split-K paged attention and the KV-cache write.

This module imports triton at import time; `ops/cuda.py` imports it only when a CUDA kernel first
runs, so the package works without triton. Kernels are decided by `TRITON_INTERPRET` when this
module is imported: set to 1, they run in Triton's interpreter on CPU tensors (the CPU tests).

Attention (`attention_dev`) reads every length from device buffers, so one launch configuration
(grid, split count, workspace) serves every length up to the block table's capacity, which is
what a captured CUDA graph needs:

- the split kernel runs one program per (query tile, KV head, split). A query tile holds
  `BLOCK_Q` query tokens of one sequence and, for each, the `GROUP` query heads sharing the KV
  head, so each KV block is read once for all of them (GQA); decode (PA) tiles hold one token.
  Each split covers an equal share of the sequence's keys, walked `KEY_TILE` keys at a time (each
  key's block looked up in the block table, so any block size works) with an online softmax.
  With one split the program writes the output directly; otherwise it writes its normalised
  partial output and log-sum-exp (base 2) to the workspace;
- the reduce kernel combines the splits of each (token, head) from the workspace.

Workspace layout (float32): partials `[T, S, H, D]`, then log-sum-exps `[T, S, H]`, so a call
needs `T * S * H * (D + 1) * 4` bytes whatever the lengths (none with `S == 1`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
#: Rows (query tokens x heads) of one attention tile: the smallest `tl.dot` operand.
TILE_ROWS = 16
#: Keys per step of the split kernel's loop, from any blocks (each key finds its own block), so
#: every block size works. 64 keys of 128 dims keep a Hopper program at ~120 registers, no spills.
KEY_TILE = 64


@triton.jit
def _sequence_of_tile(query_start_loc, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles include `tile`: sequence b owns the tiles from
    `query_start_loc[b] // BLOCK_Q + b` on (a binary search over the device offsets)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _split_kernel(
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc, workspace, out,
    scale_log2, num_seqs, lse_base, num_splits, block_size,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    DECODE: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        seq = tile
        q_start = tile
        q_len = 1
        q_first = 0
    else:
        seq = _sequence_of_tile(query_start_loc, tile, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc + seq)
        q_len = tl.load(query_start_loc + seq + 1) - q_start
        q_first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_first < q_len:
        kv_len = tl.load(seq_lens + seq)

        rows = tl.arange(0, BLOCK_M)
        local = q_first + rows // GROUP  # query token of each row, within its sequence
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (local < q_len)
        token = q_start + local
        position = kv_len - q_len + local  # the last key position each row may attend
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM

        q = tl.load(
            query + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
            mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
        )
        if DOT_FP32:
            q = q.to(tl.float32)

        # This split's share of the sequence's key tiles, up to the last position the tile's rows see.
        num_tiles = tl.cdiv(kv_len, BLOCK_N)
        per_split = tl.cdiv(num_tiles, num_splits)
        first_tile = split * per_split
        last_position = kv_len - q_len + tl.minimum(q_first + BLOCK_Q, q_len) - 1
        end_tile = tl.minimum(tl.minimum(first_tile + per_split, num_tiles), last_position // BLOCK_N + 1)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        offsets = tl.arange(0, BLOCK_N)
        for t in range(first_tile, end_tile):
            key_pos = t * BLOCK_N + offsets
            kv_ok = key_pos < kv_len
            physical = tl.load(block_table + seq * stride_bt + key_pos // block_size, mask=kv_ok, other=0).to(tl.int64)
            slot = key_pos % block_size
            tile_ok = kv_ok[:, None] & dim_ok[None, :]
            k = tl.load(
                key_cache + kv_head * stride_kh + (physical * stride_kb + slot * stride_ks)[:, None]
                + dims[None, :] * stride_kd,
                mask=tile_ok, other=0.0,
            )
            v = tl.load(
                value_cache + kv_head * stride_vh + (physical * stride_vb + slot * stride_vs)[:, None]
                + dims[None, :] * stride_vd,
                mask=tile_ok, other=0.0,
            )
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            allowed = row_ok[:, None] & kv_ok[None, :] & (key_pos[None, :] <= position[:, None])
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        has_keys = l_i > 0
        result = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        store_ok = row_ok[:, None] & dim_ok[None, :]
        if DIRECT:
            tl.store(
                out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
                result.to(out.dtype.element_ty), mask=store_ok,
            )
        else:
            record = (token.to(tl.int64) * num_splits + split) * NUM_HEADS + head
            tl.store(workspace + record[:, None] * HEAD_DIM + dims[None, :], result, mask=store_ok)
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(workspace + lse_base + record, lse, mask=row_ok)


@triton.jit
def _reduce_kernel(
    workspace, out, lse_base, num_splits,
    stride_ot, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    record = (token * num_splits + splits) * NUM_HEADS + head
    lse = tl.load(workspace + lse_base + record, mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(lse - m_safe)
    total = tl.sum(weight, 0)
    partial = tl.load(
        workspace + record[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :], other=0.0
    )
    result = tl.sum(weight[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + token * stride_ot + head * stride_oh + dims * stride_od, result.to(out.dtype.element_ty), mask=dim_ok)


@triton.jit
def _cache_write_kernel(
    key, value, key_cache, value_cache, slot_mapping, num_slots, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, NUM_ELEMENTS: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token)
    if (slot >= 0) & (slot < num_slots):
        block = slot // block_size
        offset = slot % block_size
        idx = tl.arange(0, BLOCK)
        ok = idx < NUM_ELEMENTS
        head = idx // HEAD_DIM
        dim = idx % HEAD_DIM
        k = tl.load(key + token * stride_kt + head * stride_kh + dim * stride_kd, mask=ok)
        v = tl.load(value + token * stride_vt + head * stride_vh + dim * stride_vd, mask=ok)
        tl.store(key_cache + block * stride_kcb + offset * stride_kcs + head * stride_kch + dim * stride_kcd, k, mask=ok)
        tl.store(
            value_cache + block * stride_vcb + offset * stride_vcs + head * stride_vch + dim * stride_vcd, v, mask=ok
        )


def tile_tokens(group: int) -> int:
    """Query tokens per FIA tile: enough that a tile's rows (tokens x grouped heads) reach `TILE_ROWS`."""
    return max(1, TILE_ROWS // group)


def attention_dev(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
) -> None:
    """Split-K paged attention into `out`, lengths read on the device; no host synchronisation.

    `query_start_loc None` is decode (PA): token i is sequence i's only query token. Otherwise
    (FIA) each sequence's query tokens are the last ones of its sequence, causal among them, and
    `query_start_loc[B]` must be T (tokens outside every sequence are not written: checking it
    would need the offsets on the host). Arguments are checked by the caller (`ops/cuda.py`).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        out.zero_()
        return
    group = num_heads // num_kv_heads
    decode = query_start_loc is None
    block_q = 1 if decode else tile_tokens(group)
    block_m = max(TILE_ROWS, triton.next_power_of_2(block_q * group))
    tiles = num_seqs if decode else num_tokens // block_q + num_seqs
    direct = num_splits == 1
    lse_base = num_tokens * num_splits * num_heads * head_dim  # where the log-sum-exps start (floats)
    partials = workspace.view(torch.float32) if not direct else out
    # Triton's interpreter (CPU tensors) multiplies bfloat16 operands wrongly: upcast there.
    dot_fp32 = query.device.type == "cpu"
    precision = "ieee" if query.dtype == torch.float32 or dot_fp32 else "tf32"
    _split_kernel[(tiles, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_table, seq_lens,
        seq_lens if decode else query_start_loc, partials, out,
        scale * LOG2E, num_seqs, lse_base, num_splits, block_size,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), block_table.stride(0), *out.stride(),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=KEY_TILE,
        BLOCK_Q=block_q, BLOCK_M=block_m, DECODE=decode, DIRECT=direct, PRECISION=precision, DOT_FP32=dot_fp32,
        num_warps=4, num_stages=3,
    )
    if not direct:
        _reduce_kernel[(num_tokens, num_heads)](
            partials, out, lse_base, num_splits, *out.stride(),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value [T, KVH, D]` at `slot_mapping`; slots -1 (and any outside the cache) are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    elements = num_kv_heads * head_dim
    _cache_write_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key_cache.shape[0] * key_cache.shape[1], key_cache.shape[1],
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(elements), NUM_ELEMENTS=elements,
    )
