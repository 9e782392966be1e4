"""Triton kernels of the CUDA runtime: split-K paged attention and the KV-cache write.

This module imports triton at import time; `ops/cuda.py` imports it only when a CUDA kernel first
runs, so the package works without triton. Kernels are decided by `TRITON_INTERPRET` when this
module is imported: set to 1, they run in Triton's interpreter on CPU tensors (the CPU tests).

Attention (`attention_dev`) reads every length from device buffers, so one launch configuration
(grid, maximum split count, workspace) serves every length up to the block table's capacity,
which is what a captured CUDA graph needs. `num_splits` (S) is fixed on the host per graph and
sizes the workspace; how the splits are spent is decided on the device, from the lengths:

- **decode (PA)**: the grid has `B * S` *work units* per KV head. Every program computes the same
  schedule from `seq_lens` (`_decode_schedule`): a chunk of key tiles, and `max(1, ceil(tiles_b /
  chunk))` units for each sequence, numbered sequence after sequence. The chunk is the smallest
  that fits in `B * S` units (a few unrolled steps of binary search) but no smaller than
  `min_split_tiles` nor than the GPU's fair share (`ceil(total_tiles * KVH / slots)`, slots = SMs x
  `SLOTS_PER_SM`: below that, more units only add reduce work). So a long sequence in a batch
  of short ones gets most of the units (uneven batches balance), a large uniform batch one unit
  per sequence, and a sequence of one unit writes its output directly (no workspace, no reduce).
  A chunk of `ceil(total_tiles / (B*S - B))` tiles always fits (each sequence rounds up by less
  than one unit), which bounds the search. Units past the schedule's end exit at once.
- **FIA (mixed steps)**: one program per (query tile, KV head, split). A query tile holds
  `BLOCK_Q` query tokens of one sequence and, for each, the `GROUP` query heads sharing the KV
  head (64 rows for steps with more tokens than sequences, `PREFILL_TILE_ROWS`, so a long chunk
  re-reads its KV prefix once per 64 rows, not per 16; 16 rows, `TILE_ROWS`, otherwise). Each
  sequence uses `min(S, ceil(kv_tiles / min_split_tiles), ceil(S / query_tiles))` splits (at least
  one), decided on the device; programs of splits past that exit at once.

Within a program the keys are walked `KEY_TILE` at a time with an online softmax. `block_size` is a
compile-time constant (`BLOCK_SIZE`): divisions are shifts for powers of two, and when it is a
multiple of the key tile each tile lies in one block (one block-table load per tile, contiguous
rows). The loop is software-pipelined by Triton (`num_stages`: K/V tiles prefetched
`num_stages - 1` deep in shared memory, checked by the sm_90 compile test).

Workspace layout (float32): partials `[T * S, H, D]`, then log-sum-exps `[T * S, H]` (a record per
(unit, head) for decode, per (token, split, head) for FIA), so a call needs `T * S * H * (D + 1) * 4`
bytes whatever the lengths (none with `S == 1`); the reduce kernel combines the records of each
(token, head) whose sequence used more than one split.

The attention features (`ops/features.py`), each a compile-time switch so plain layers run the
plain kernel:

- **window** (`WINDOW`): every length above is that of the sequence's *span*, its last
  `min(L, W + q - 1)` keys (`_span_tiles`): the decode schedule, FIA's split counts and every
  program's key range cover the span's tiles only, and the loads mask keys before it, so blocks
  before the span are never read (they may be freed). FIA programs start at the first key their
  tile's first query token sees, and mask each row's keys at or before `position - W`.
- **soft-cap** (`SOFT_CAP`): on the logits before the online softmax's max and exponent, in base 2
  (`_attend`).
- **sinks** (`HAS_SINKS`): each query head's logit joins the softmax denominator once, where the
  output is normalised: in the split kernel when the sequence used one split, else in the reduce
  (split records are partial softmaxes without it).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .cuda_triton_device import (LOG2E, SEARCH_STEPS, _attend, _decode_schedule, _fia_num_splits,
                                 _sequence_of_tile, _sequence_of_token, _sink_share, _span_tiles)
from .features import AttentionFeatures

#: Rows (query tokens x heads) of a decode-like attention tile: the smallest `tl.dot` operand.
TILE_ROWS = 16
#: Rows of an FIA tile in steps with more query tokens than sequences (prefill chunks): one
#: Hopper warpgroup MMA (wgmma M=64); each tile reads its sequence's KV prefix once.
PREFILL_TILE_ROWS = 64
#: Keys per step of the split kernel's loop. 64 keys of 128 dims keep a Hopper program at ~120
#: registers for decode, no spills (the sm_90 compile test checks every variant).
KEY_TILE = 64
#: A split covers at least this many key tiles (256 tokens): shorter splits cost more in the
#: reduce than they gain in parallelism.
MIN_SPLIT_TILES = 4
#: Software-pipeline depth of the key loop (K/V prefetched `NUM_STAGES - 1` tiles ahead).
NUM_STAGES = 3
#: Programs per SM the decode schedule counts on: its chunk is at least the fair share of key tiles
#: of `num_sms * SLOTS_PER_SM` programs (smaller chunks only add units and reduce work).
SLOTS_PER_SM = 3
#: The slot count off CUDA (the interpreter): no fair-share bound, so short test sequences split.
UNBOUNDED_SLOTS = 1 << 30
#: Splits the reduce kernel combines per step of its loop.
REDUCE_SPLITS = 16

#: Runtime ints left unspecialised (Triton would compile a variant for values == 1 or divisible by
#: 16): those that vary with the batch, and the window, so one compiled kernel serves every layer.
_VARYING = ["num_seqs", "lse_base", "slots", "window"]


@triton.jit(do_not_specialize=_VARYING)
def _split_kernel(
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc, workspace, out, sinks,
    scale_log2, num_seqs, lse_base, num_splits, slots, window, cap_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_B: tl.constexpr, MIN_TILES: tl.constexpr,
    DECODE: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One work unit (decode) or one (query tile, split) (FIA) of one KV head: its keys' partial
    softmax into the workspace, or the output itself when its sequence used one split."""
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE:
        q_len = 1
        q_first = 0
        if DIRECT:  # one unit per sequence
            seq = program
            split = 0
            n = 1
            chunk = 0  # unused: the whole span
        else:
            chunk, units, ends = _decode_schedule(seq_lens, num_seqs, num_seqs * num_splits, tl.num_programs(1),
                                                  slots, window, BLOCK_B, BLOCK_N, MIN_TILES, WINDOW)
            seqs = tl.arange(0, BLOCK_B)
            seq = tl.sum((ends <= program).to(tl.int32), 0)
            mine = seqs == seq
            n = tl.sum(tl.where(mine, units, 0), 0)
            split = program - (tl.sum(tl.where(mine, ends, 0), 0) - n)
        active = seq < num_seqs
        q_start = seq
    else:
        tile = program
        split = tl.program_id(2)
        seq = _sequence_of_tile(query_start_loc, tile, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc + seq)
        q_len = tl.load(query_start_loc + seq + 1) - q_start
        q_first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
        active = q_first < q_len
        n = 1
        chunk = 0
    if active:
        kv_len = tl.load(seq_lens + seq)
        kv_start, span_tile, num_tiles = _span_tiles(kv_len, q_len, window, WINDOW, BLOCK_N)
        if DECODE:
            first_tile = span_tile + split * chunk
            if DIRECT:
                end_tile = num_tiles
            else:
                end_tile = tl.minimum(first_tile + chunk, num_tiles)
        else:
            if not DIRECT:
                n = _fia_num_splits(num_tiles - span_tile, q_len, num_splits, BLOCK_Q, MIN_TILES)
            per_split = (num_tiles - span_tile + n - 1) // n
            first_tile = span_tile + split * per_split
            last_position = kv_len - q_len + tl.minimum(q_first + BLOCK_Q, q_len) - 1
            end_tile = tl.minimum(tl.minimum(first_tile + per_split, num_tiles), last_position // BLOCK_N + 1)
            if WINDOW:  # no key before the window of the tile's first query token
                kv_start = tl.maximum(kv_len - q_len + q_first - window + 1, kv_start)
                first_tile = tl.maximum(first_tile, kv_start // BLOCK_N)
        if split < n:
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
            acc, m_i, l_i = _attend(
                q, key_cache, value_cache, block_table, seq, kv_head, kv_start, kv_len, first_tile, end_tile,
                position, row_ok, scale_log2, window, cap_log2,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd,
                stride_bt,
                HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_M, BLOCK_SIZE, not DECODE, PRECISION, DOT_FP32, NUM_STAGES,
                WINDOW, SOFT_CAP,
            )
            has_keys = l_i > 0
            result = acc / tl.where(has_keys, l_i, 1.0)[:, None]
            store_ok = row_ok[:, None] & dim_ok[None, :]
            if n == 1:
                if HAS_SINKS:  # the whole softmax is here: its sink joins the denominator now
                    sink = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
                    result = result * _sink_share(m_i, l_i, sink)[:, None]
                tl.store(
                    out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
                    result.to(out.dtype.element_ty), mask=store_ok,
                )
            else:  # a partial softmax without the sink, which the reduce adds once
                if DECODE:
                    record = program.to(tl.int64) * NUM_HEADS + head
                else:
                    record = (token.to(tl.int64) * num_splits + split) * NUM_HEADS + head
                tl.store(workspace + record[:, None] * HEAD_DIM + dims[None, :], result, mask=store_ok)
                lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
                tl.store(workspace + lse_base + record, lse, mask=row_ok)


@triton.jit(do_not_specialize=_VARYING)
def _reduce_kernel(
    seq_lens, query_start_loc, workspace, out, sinks, num_seqs, lse_base, num_splits, num_kv_heads, slots, window,
    stride_ot, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_B: tl.constexpr, MIN_TILES: tl.constexpr,
    DECODE: tl.constexpr, WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Combines the split records of one (token, head) whose sequence used more than one split,
    and the head's sink (once: the records are partial softmaxes without it)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if DECODE:
        chunk, units, ends = _decode_schedule(seq_lens, num_seqs, num_seqs * num_splits, num_kv_heads, slots,
                                              window, BLOCK_B, BLOCK_N, MIN_TILES, WINDOW)
        mine = tl.arange(0, BLOCK_B) == token
        n = tl.sum(tl.where(mine, units, 0), 0)
        first = (tl.sum(tl.where(mine, ends, 0), 0) - n).to(tl.int64)  # the sequence's first unit
    else:
        seq = _sequence_of_token(query_start_loc, token, num_seqs)
        n = 0
        if seq < num_seqs:
            q_len = tl.load(query_start_loc + seq + 1) - tl.load(query_start_loc + seq)
            _, span_tile, num_tiles = _span_tiles(tl.load(seq_lens + seq), q_len, window, WINDOW, BLOCK_N)
            n = _fia_num_splits(num_tiles - span_tile, q_len, num_splits, BLOCK_Q, MIN_TILES)
        first = token.to(tl.int64) * num_splits
    if n > 1:
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, n, BLOCK_S):
            splits = s0 + tl.arange(0, BLOCK_S)
            split_ok = splits < n
            record = (first + splits) * NUM_HEADS + head
            lse = tl.load(workspace + lse_base + record, mask=split_ok, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(lse, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            weight = tl.exp2(lse - m_safe)
            seen = split_ok & (lse > float("-inf"))  # a split without keys wrote a zero partial
            partial = tl.load(
                workspace + record[:, None] * HEAD_DIM + dims[None, :], mask=seen[:, None] & dim_ok[None, :],
                other=0.0,
            )
            acc = acc * alpha + tl.sum(weight[:, None] * partial, 0)
            total = total * alpha + tl.sum(weight, 0)
            m = m_new
        result = acc / tl.where(total > 0, total, 1.0)
        if HAS_SINKS:
            result = result * _sink_share(m, total, tl.load(sinks + head).to(tl.float32) * LOG2E)
        tl.store(out + token * stride_ot + head * stride_oh + dims * stride_od, result.to(out.dtype.element_ty),
                 mask=dim_ok)


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


def tile_tokens(group: int, rows: int = TILE_ROWS) -> int:
    """Query tokens per FIA tile: enough that a tile's rows (tokens x grouped heads) reach `rows`."""
    return max(1, rows // group)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_config(dtype: torch.dtype, head_dim: int, decode: bool, num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """(rows of an attention tile, pipeline stages) of a call, checked for sm_90 by the compile test.

    FIA tiles hold `PREFILL_TILE_ROWS` rows when some sequence has several query tokens (T > B:
    prefill chunks, whose KV prefix each tile re-reads), else `TILE_ROWS` (one token per sequence,
    as in decode: larger tiles would only hold empty rows). Key loops run `NUM_STAGES` deep.
    Fallback for 4-byte dtypes and head dims above 128, whose K/V tiles are twice as large (64-row
    tiles would spill registers or, 3 stages deep, pass Hopper's 227 KB of shared memory): 16-row
    tiles, so long float32 prefill chunks re-read their prefix once per 16 rows (~140 KB of shared
    memory: one program per SM; float32 is for checking, not for speed).
    """
    small = torch.empty((), dtype=dtype).element_size() <= 2 and head_dim <= 128
    if not small:
        return TILE_ROWS, NUM_STAGES
    if decode or num_tokens <= num_seqs:
        return TILE_ROWS, NUM_STAGES
    return PREFILL_TILE_ROWS, NUM_STAGES


def span_tiles(kv_len: int, query_len: int, window: int | None, key_tile: int = KEY_TILE) -> int:
    """The host mirror of `_span_tiles`: key tiles of a sequence's span (tiles aligned from key 0)."""
    first_key = kv_len - AttentionFeatures(window=window).span(kv_len, query_len)
    return -(-kv_len // key_tile) - first_key // key_tile


def decode_schedule(seq_lens: list[int], num_splits: int, key_tile: int = KEY_TILE,
                    min_split_tiles: int = MIN_SPLIT_TILES, num_kv_heads: int = 1,
                    slots: int = UNBOUNDED_SLOTS, window: int | None = None) -> tuple[int, list[int]]:
    """The host mirror of `_decode_schedule` (for tests and tools): (key tiles per unit, units of
    each sequence) for `len(seq_lens) * num_splits` units over each sequence's span (`window`);
    `num_splits == 1`: one unit each."""
    num_seqs = len(seq_lens)
    if num_splits == 1 or num_seqs == 0:
        return 0, [1] * num_seqs
    num_units = num_seqs * num_splits
    tiles = [span_tiles(n, 1, window, key_tile) for n in seq_lens]
    total = sum(tiles)
    lo = max(-(-total // num_units), min_split_tiles, -(-total * num_kv_heads // slots))
    hi = max(-(-total // (num_units - num_seqs)), lo)
    for _ in range(SEARCH_STEPS.value):
        mid = (lo + hi) // 2
        if sum(max(1, -(-t // mid)) for t in tiles) <= num_units:
            hi = mid
        else:
            lo = mid + 1
    return hi, [max(1, -(-t // hi)) for t in tiles]


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
    *,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_tile: int = KEY_TILE,
    min_split_tiles: int = MIN_SPLIT_TILES,
    tile_rows: int | None = None,
    num_stages: int | None = None,
    slots: int | None = None,
) -> None:
    """Split-K paged attention into `out`, lengths read on the device; no host synchronisation.

    `query_start_loc None` is decode (PA): token i is sequence i's only query token. Otherwise
    (FIA) each sequence's query tokens are the last ones of its sequence, causal among them, and
    `query_start_loc[B]` must be T (tokens outside every sequence are not written: checking it
    would need the offsets on the host). `num_splits` is the most splits per query token, which
    sizes the workspace; the splits used are decided on the device (module docstring). `window`,
    `soft_cap` and `sinks` are the features of `ops/features.py`. Arguments are checked by the
    caller (`ops/cuda.py`). The other keyword arguments are tuning knobs (the tests shrink
    `key_tile` and `min_split_tiles` to split short sequences).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        out.zero_()
        return
    group = num_heads // num_kv_heads
    decode = query_start_loc is None
    rows, stages = launch_config(query.dtype, head_dim, decode, num_tokens, num_seqs)
    rows, stages = tile_rows or rows, num_stages or stages
    if slots is None:
        slots = _num_sms(query.device) * SLOTS_PER_SM if query.device.type == "cuda" else UNBOUNDED_SLOTS
    block_q = 1 if decode else tile_tokens(group, rows)
    block_m = max(TILE_ROWS, triton.next_power_of_2(block_q * group))
    direct = num_splits == 1
    block_d = max(16, triton.next_power_of_2(head_dim))
    # only the decode schedule reads BLOCK_B lengths at once; a fixed value elsewhere spares compiles
    block_b = max(16, triton.next_power_of_2(num_seqs)) if decode and not direct else 16
    if decode:
        grid = (num_seqs * num_splits, num_kv_heads)
    else:
        grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    lse_base = num_tokens * num_splits * num_heads * head_dim  # where the log-sum-exps start (floats)
    partials = workspace.view(torch.float32) if not direct else out
    # Triton's interpreter (CPU tensors) multiplies bfloat16 operands wrongly: upcast there.
    dot_fp32 = query.device.type == "cpu"
    precision = "ieee" if query.dtype == torch.float32 or dot_fp32 else "tf32"
    loc = seq_lens if decode else query_start_loc
    switches = dict(WINDOW=window is not None, HAS_SINKS=sinks is not None)
    sink_logits = seq_lens if sinks is None else sinks.contiguous()  # any pointer stands in for no sinks
    _split_kernel[grid](
        query, key_cache, value_cache, block_table, seq_lens, loc, partials, out, sink_logits,
        scale * LOG2E.value, num_seqs, lse_base, num_splits, slots, window or 0, (soft_cap or 1.0) * LOG2E.value,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), block_table.stride(0), *out.stride(),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=key_tile,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_SIZE=block_size, BLOCK_B=block_b, MIN_TILES=min_split_tiles,
        DECODE=decode, DIRECT=direct, PRECISION=precision, DOT_FP32=dot_fp32, NUM_STAGES=stages,
        SOFT_CAP=soft_cap is not None, **switches, num_warps=4, num_stages=stages,
    )
    if not direct:
        _reduce_kernel[(num_tokens, num_heads)](
            seq_lens, loc, partials, out, sink_logits, num_seqs, lse_base, num_splits, num_kv_heads, slots,
            window or 0, *out.stride(),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_S=min(REDUCE_SPLITS, max(2, triton.next_power_of_2(num_splits))),
            BLOCK_N=key_tile, BLOCK_Q=block_q, BLOCK_B=block_b, MIN_TILES=min_split_tiles, DECODE=decode,
            **switches,
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
