"""Triton kernels of MLA on CUDA (`ops/mla.py`'s absorbed latent attention) and its cache write.

One latent KV head serves every query head: a cached token is its latent `kv_c [L]` (kv_lora_rank,
512 in DeepSeek-V2/V3) and its rope key `k_pe [R]` (64). The score of a query row is
`scale * (q_nope . kv_c + q_pe . k_pe)` and the value is `kv_c`, so the output `[T, H, L]` stays
latent. What makes these kernels MLA kernels rather than FIA with one KV head: each key tile of
`kv_c` is loaded once per program and used twice, as the keys of the scores and as the values of
the output, for all the query rows the program holds; and those rows are query heads (up to
`MLA_TILE_ROWS` of them, or several query tokens of a sequence times all its heads when there are
fewer heads), so one KV read serves many heads.

The launch follows `ops/cuda_triton.py`'s FIA (lengths read on the device, so one launch
configuration serves every length up to the block table's capacity, which CUDA graphs need):

- one program per (query tile, head group, split): a query tile holds `BLOCK_Q` query tokens of one
  sequence (`_sequence_of_tile`) and, for each, `HEAD_ROWS` heads of the head group; decode steps
  (one token per sequence) are the same kernel with tiles of one token's heads;
- each sequence uses `min(S, ceil(kv_tiles / min_split_tiles), ceil(S / query_tiles))` splits
  (`_fia_num_splits`, decided on the device), S = `num_splits` fixed on the host, which sizes the
  workspace; a sequence of one split writes its output directly;
- causal among a sequence's query tokens (its last `q_len` positions); a sequence of no keys
  (padding) writes zeros; tokens outside every sequence (`query_start_loc[B] < T`) are not written.

Workspace layout (float32), as FIA's, so FIA's reduce kernel (`_reduce_kernel`, decode off, no
features) combines it: partials `[T * S, H, L]`, then log-sum-exps `[T * S, H]`, a record per
(token, split, head): `T * S * H * (L + 1) * 4` bytes (`ops.cuda.dev_workspace_nbytes` of the MLA
shape, whose `head_dim` is the latent's), none with `S == 1`.

Tiles for Hopper (compiled for sm_90 by `tests/test_triton_mla.py`, which asserts no spills, the
shared memory and the pipelined loop): 16 rows, 32 keys of 512 + 64 dims per step, two stages (the
next tile is copied asynchronously into one shared buffer), 8 warps. A K tile is 36 KB in bfloat16
(72 KB in float32), the accumulator 16 x 512 float32: ~84 registers a thread in bfloat16 (~94 in
float32), so three programs share an SM and hide each other's loads. Four warps spill in float32;
a third stage (two buffers) doubles the registers, one program per SM; 64-key tiles spill in
float32. These are compile-time figures: the kernels have not been timed on a GPU yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cuda import MLA_TILE_ROWS, mla_head_groups, mla_tile
from .cuda_launch import REDUCE_SPLITS
from .cuda_triton import _reduce_kernel
from .cuda_triton_device import LOG2E, _fia_num_splits, _online_softmax_step, _sequence_of_tile, _tile_blocks

#: Keys per step of the key loop (a 32 x 576 tile in shared memory per stage).
MLA_KEY_TILE = 32
#: A split covers at least this many key tiles (256 tokens), as FIA's.
MLA_MIN_SPLIT_TILES = 8
#: Software-pipeline depth of the key loop: two stages, one 36 KB (bf16) / 72 KB (fp32) K tile in flight.
MLA_NUM_STAGES = 2
#: Warps of a split program: eight keep the 512-wide accumulator and operands in registers.
MLA_NUM_WARPS = 8

#: Runtime ints left unspecialised: those varying with the batch (one compiled kernel per shape).
_VARYING = ["num_seqs", "lse_base"]


@triton.jit
def _mla_attend(
    q, q_pe, kv_c_cache, k_pe_cache, table, kv_len, first_tile, end_tile, position, row_ok, scale_log2,
    stride_cb, stride_cs, stride_cd, stride_pb, stride_ps, stride_pd,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Online softmax of the rows of `q [BLOCK_M, BLOCK_L]` / `q_pe [BLOCK_M, BLOCK_R]` over the
    keys of key tiles [first_tile, end_tile) below `kv_len`, causal (a row sees keys up to its
    `position`): (unnormalised output [BLOCK_M, BLOCK_L], row max, row sum), base-2 exponents. Each
    latent tile is loaded once, as keys and as values."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    lat = tl.arange(0, BLOCK_L)
    rope = tl.arange(0, BLOCK_R)
    # a tile's block-table entries one iteration ahead (as in `_attend`: the loads then pipeline)
    physical = _tile_blocks(table, first_tile, 0, kv_len, offsets, BLOCK_N, BLOCK_SIZE, False)
    for t in tl.range(first_tile, end_tile, num_stages=NUM_STAGES):
        key_pos = t * BLOCK_N + offsets
        kv_ok = key_pos < kv_len
        if BLOCK_SIZE % BLOCK_N == 0:  # the tile lies in one block: contiguous rows
            slot = (t * BLOCK_N) % BLOCK_SIZE + offsets
        else:
            slot = key_pos % BLOCK_SIZE
        c_rows = physical * stride_cb + slot * stride_cs
        p_rows = physical * stride_pb + slot * stride_ps
        physical = _tile_blocks(table, t + 1, 0, kv_len, offsets, BLOCK_N, BLOCK_SIZE, False)
        if BLOCK_L == LATENT:
            c_ok = kv_ok[:, None]
        else:
            c_ok = kv_ok[:, None] & (lat < LATENT)[None, :]
        kv = tl.load(kv_c_cache + c_rows[:, None] + lat[None, :] * stride_cd, mask=c_ok, other=0.0)
        k_pe = tl.load(k_pe_cache + p_rows[:, None] + rope[None, :] * stride_pd,
                       mask=kv_ok[:, None] & (rope < ROPE)[None, :], other=0.0)
        if DOT_FP32:
            kv = kv.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        scores = tl.dot(q, tl.trans(kv), input_precision=PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=PRECISION) * scale_log2
        allowed = row_ok[:, None] & kv_ok[None, :] & (key_pos[None, :] <= position[:, None])
        acc, m_i, l_i = _online_softmax_step(scores, allowed, m_i, l_i, acc, kv, PRECISION)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=_VARYING)
def _mla_split_kernel(
    q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, seq_lens, query_start_loc, workspace, out,
    scale_log2, num_seqs, lse_base, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_rt, stride_rh, stride_rd,
    stride_cb, stride_cs, stride_cd,
    stride_pb, stride_ps, stride_pd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, HEAD_ROWS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, MIN_TILES: tl.constexpr, DIRECT: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """One (query tile, head group, split): its keys' partial softmax into the workspace, or the
    output itself when its sequence used one split."""
    tile = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    seq = _sequence_of_tile(query_start_loc, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    q_first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_first < q_len:
        kv_len = tl.load(seq_lens + seq)
        num_tiles = (kv_len + BLOCK_N - 1) // BLOCK_N
        n = 1
        if not DIRECT:
            n = _fia_num_splits(num_tiles, q_len, num_splits, BLOCK_Q, MIN_TILES)
        per_split = (num_tiles + n - 1) // n
        first_tile = split * per_split
        last_position = kv_len - q_len + tl.minimum(q_first + BLOCK_Q, q_len) - 1  # the tile's last token's
        end_tile = tl.minimum(tl.minimum(first_tile + per_split, num_tiles), last_position // BLOCK_N + 1)
        if split < n:
            rows = tl.arange(0, BLOCK_M)
            local = q_first + rows // HEAD_ROWS  # query token of each row, within its sequence
            head = head_group * HEAD_ROWS + rows % HEAD_ROWS
            row_ok = (rows < BLOCK_Q * HEAD_ROWS) & (local < q_len) & (head < NUM_HEADS)
            token = q_start + local
            position = kv_len - q_len + local  # the last key position each row may attend
            lat = tl.arange(0, BLOCK_L)
            lat_ok = lat < LATENT
            rope = tl.arange(0, BLOCK_R)
            q = tl.load(q_nope + token[:, None] * stride_qt + head[:, None] * stride_qh + lat[None, :] * stride_qd,
                        mask=row_ok[:, None] & lat_ok[None, :], other=0.0)
            qr = tl.load(q_pe + token[:, None] * stride_rt + head[:, None] * stride_rh + rope[None, :] * stride_rd,
                         mask=row_ok[:, None] & (rope < ROPE)[None, :], other=0.0)
            if DOT_FP32:
                q = q.to(tl.float32)
                qr = qr.to(tl.float32)
            acc, m_i, l_i = _mla_attend(
                q, qr, kv_c_cache, k_pe_cache, block_table + seq * stride_bt, kv_len, first_tile, end_tile,
                position, row_ok, scale_log2, stride_cb, stride_cs, stride_cd, stride_pb, stride_ps, stride_pd,
                LATENT, ROPE, BLOCK_L, BLOCK_R, BLOCK_N, BLOCK_M, BLOCK_SIZE, PRECISION, DOT_FP32, NUM_STAGES,
            )
            has_keys = l_i > 0
            result = acc / tl.where(has_keys, l_i, 1.0)[:, None]
            store_ok = row_ok[:, None] & lat_ok[None, :]
            if n == 1:
                tl.store(out + token[:, None] * stride_ot + head[:, None] * stride_oh + lat[None, :] * stride_od,
                         result.to(out.dtype.element_ty), mask=store_ok)
            else:
                record = (token.to(tl.int64) * num_splits + split) * NUM_HEADS + head
                tl.store(workspace + record[:, None] * LATENT + lat[None, :], result, mask=store_ok)
                lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
                tl.store(workspace + lse_base + record, lse, mask=row_ok)


@triton.jit
def _mla_cache_write_kernel(
    kv_c, k_pe, kv_c_cache, k_pe_cache, slot_mapping, num_slots, block_size,
    stride_ct, stride_cd, stride_pt, stride_pd,
    stride_ccb, stride_ccs, stride_ccd, stride_pcb, stride_pcs, stride_pcd,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One token's latent and rope key into its slot; slot -1 (and any outside the cache) skipped."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        block = slot // block_size
        offset = slot % block_size
        lat = tl.arange(0, BLOCK_L)
        rope = tl.arange(0, BLOCK_R)
        c = tl.load(kv_c + token * stride_ct + lat * stride_cd, mask=lat < LATENT)
        tl.store(kv_c_cache + block * stride_ccb + offset * stride_ccs + lat * stride_ccd, c, mask=lat < LATENT)
        p = tl.load(k_pe + token * stride_pt + rope * stride_pd, mask=rope < ROPE)
        tl.store(k_pe_cache + block * stride_pcb + offset * stride_pcs + rope * stride_pcd, p, mask=rope < ROPE)


def mla_attention_dev(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_cache: torch.Tensor,
    k_pe_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    *,
    key_tile: int = MLA_KEY_TILE,
    min_split_tiles: int = MLA_MIN_SPLIT_TILES,
    tile_rows: int = MLA_TILE_ROWS,
    num_stages: int = MLA_NUM_STAGES,
) -> None:
    """Split-K MLA into `out [T, H, L]`, lengths read on the device; no host synchronisation.

    Each sequence's query tokens are its last ones, causal among them, and `query_start_loc[B]`
    must be T. `num_splits` is the most splits per query token, which sizes the workspace; the
    splits used are decided on the device (module docstring). Arguments are checked by the caller
    (`ops/cuda_mla.py`). The keyword arguments are tuning knobs (the tests shrink `key_tile` and
    `min_split_tiles` to split short sequences, and `tile_rows` to split the heads into groups).
    """
    num_tokens, num_heads, latent = q_nope.shape
    rope_dim = q_pe.shape[2]
    num_seqs = seq_lens.shape[0]
    block_size = kv_c_cache.shape[1]
    if num_tokens == 0 or num_seqs == 0:
        out.zero_()
        return
    head_rows, block_q = mla_tile(num_heads, tile_rows)
    block_m = max(16, triton.next_power_of_2(block_q * head_rows))
    block_l = max(16, triton.next_power_of_2(latent))
    block_r = max(16, triton.next_power_of_2(rope_dim))
    direct = num_splits == 1
    grid = (num_tokens // block_q + num_seqs, mla_head_groups(num_heads, tile_rows), num_splits)
    lse_base = num_tokens * num_splits * num_heads * latent  # where the log-sum-exps start (floats)
    partials = workspace.view(torch.float32) if not direct else out
    # Triton's interpreter (CPU tensors) multiplies bfloat16 operands wrongly: upcast there.
    dot_fp32 = q_nope.device.type == "cpu"
    precision = "ieee" if q_nope.dtype == torch.float32 or dot_fp32 else "tf32"
    _mla_split_kernel[grid](
        q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, seq_lens, query_start_loc, partials, out,
        scale * LOG2E.value, num_seqs, lse_base, num_splits,
        *q_nope.stride(), *q_pe.stride(), *kv_c_cache.stride(), *k_pe_cache.stride(), block_table.stride(0),
        *out.stride(),
        NUM_HEADS=num_heads, HEAD_ROWS=head_rows, LATENT=latent, ROPE=rope_dim, BLOCK_L=block_l, BLOCK_R=block_r,
        BLOCK_N=key_tile, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_SIZE=block_size, MIN_TILES=min_split_tiles,
        DIRECT=direct, PRECISION=precision, DOT_FP32=dot_fp32, NUM_STAGES=num_stages,
        num_warps=MLA_NUM_WARPS, num_stages=num_stages,
    )
    if not direct:  # FIA's reduce: the same records, split counts and (undecoded, featureless) schedule
        _reduce_kernel[(num_tokens, num_heads)](
            seq_lens, query_start_loc, partials, out, seq_lens, num_seqs, lse_base, num_splits, 1, 1, 0,
            *out.stride(),
            NUM_HEADS=num_heads, HEAD_DIM=latent, BLOCK_D=block_l,
            BLOCK_S=min(REDUCE_SPLITS, max(2, triton.next_power_of_2(num_splits))),
            BLOCK_N=key_tile, BLOCK_Q=block_q, BLOCK_B=16, MIN_TILES=min_split_tiles, DECODE=False,
            WINDOW=False, HAS_SINKS=False,
        )


def mla_cache_write(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_c_cache: torch.Tensor, k_pe_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Write `kv_c [T, L]` and `k_pe [T, R]` at `slot_mapping` (int32 or int64); slots -1 (and any
    outside the cache) are skipped, on the device."""
    num_tokens, latent = kv_c.shape
    if num_tokens == 0:
        return
    rope_dim = k_pe.shape[1]
    _mla_cache_write_kernel[(num_tokens,)](
        kv_c, k_pe, kv_c_cache, k_pe_cache, slot_mapping, kv_c_cache.shape[0] * kv_c_cache.shape[1],
        kv_c_cache.shape[1], *kv_c.stride(), *k_pe.stride(), *kv_c_cache.stride(), *k_pe_cache.stride(),
        LATENT=latent, ROPE=rope_dim, BLOCK_L=triton.next_power_of_2(latent), BLOCK_R=triton.next_power_of_2(rope_dim),
    )
