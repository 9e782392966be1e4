"""The device-side building blocks of the CUDA attention kernels (`ops/cuda_triton.py`): which
sequence a query tile or token belongs to, the key tiles of a sequence's span (`ops/features.py`:
with a window, only its last `W + q - 1` keys), the decode split schedule every program computes
from the lengths, FIA's split count per sequence, a key tile's cache blocks, the online-softmax loop
over a program's key range (window mask, soft-cap) and the sink's join to a softmax denominator.
Kept apart from the kernels and their launch so each module reads as one job; the schedule and the
loop are documented in `cuda_triton`'s docstring.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: Steps of the decode schedule's binary search for its chunk, between `ceil(tiles / units)` (the
#: least that can fit) and `ceil(tiles / (units - B))` (always fits), whose ratio is at most
#: S / (S - 1): after 4 steps the chunk is within 1/16 of that gap of the best.
SEARCH_STEPS: tl.constexpr = tl.constexpr(4)
#: log2(e): the kernels' exponents are base 2, the features' logits (sinks) natural.
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


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
def _sequence_of_token(query_start_loc, token, num_seqs):
    """The sequence of query token `token` (`num_seqs` if it lies past every sequence): the last b
    with `query_start_loc[b] <= token` (sequences without query tokens share their start)."""
    lo = 1
    hi = num_seqs + 1
    while lo < hi:  # the first index whose offset exceeds the token
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _span_tiles(kv_len, q_len, window, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first key, first key tile, end key tile) of the span of sequences of `kv_len` keys whose last
    `q_len` are query tokens (scalars or vectors): with a `WINDOW`, the last `window + q - 1` keys
    (`AttentionFeatures.span`), else all of them. Tiles are aligned to `BLOCK_N` from key 0, so the
    first tile may start before the span: its keys before the first key are masked, never read."""
    if WINDOW:
        first_key = tl.maximum(kv_len - window - tl.maximum(q_len, 1) + 1, 0)
    else:
        first_key = tl.zeros_like(kv_len)
    return first_key, first_key // BLOCK_N, (kv_len + BLOCK_N - 1) // BLOCK_N


@triton.jit
def _decode_schedule(seq_lens, num_seqs, num_units, num_kv_heads, slots, window, BLOCK_B: tl.constexpr,
                     BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr, WINDOW: tl.constexpr):
    """The decode schedule of `num_units` (> num_seqs) work units over the key tiles of each
    sequence's span, the same in every program: (key tiles per unit, units of each sequence
    [BLOCK_B], inclusive cumulative units [BLOCK_B])."""
    seqs = tl.arange(0, BLOCK_B)
    valid = seqs < num_seqs
    lens = tl.load(seq_lens + seqs, mask=valid, other=0)
    _, first_tiles, end_tiles = _span_tiles(lens, 1, window, WINDOW, BLOCK_N)
    tiles = end_tiles - first_tiles
    total = tl.sum(tiles, 0)
    fair = (total * num_kv_heads + slots - 1) // slots  # a chunk below the GPU's fair share gains nothing
    lo = tl.maximum(tl.maximum((total + num_units - 1) // num_units, MIN_TILES), fair)  # no smaller chunk fits
    spare = num_units - num_seqs
    hi = tl.maximum((total + spare - 1) // spare, lo)  # always fits: see the module docstring
    # A few steps of binary search towards the smallest chunk that fits, unrolled (a loop here
    # stops Triton from pipelining the key loop); `hi` fits after every step.
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        need = tl.sum(tl.where(valid, tl.maximum((tiles + mid - 1) // mid, 1), 0), 0)
        fits = need <= num_units
        hi = tl.where(fits, mid, hi)
        lo = tl.where(fits, lo, mid + 1)
    units = tl.where(valid, tl.maximum((tiles + hi - 1) // hi, 1), 0)
    return hi, units, tl.cumsum(units, 0)


@triton.jit
def _fia_num_splits(kv_tiles, q_len, max_splits, BLOCK_Q: tl.constexpr, MIN_TILES: tl.constexpr):
    """Splits an FIA sequence uses: enough for the `kv_tiles` key tiles of its span (>= MIN_TILES
    tiles each), fewer when its query tiles already fill the grid, between 1 and `max_splits`."""
    q_tiles = tl.maximum((q_len + BLOCK_Q - 1) // BLOCK_Q, 1)
    wanted = tl.minimum((kv_tiles + MIN_TILES - 1) // MIN_TILES, (max_splits + q_tiles - 1) // q_tiles)
    return tl.minimum(tl.maximum(wanted, 1), max_splits)


@triton.jit
def _tile_blocks(table, t, kv_start, kv_len, offsets, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 WINDOW: tl.constexpr):
    """The physical block of each key of key tile `t` (int64): one block-table entry when the
    tile lies in one block (which then holds a key of `[kv_start, kv_len)` whenever the tile does),
    else one per key (keys past `kv_len` and, with a `WINDOW`, before `kv_start` read block 0:
    entries before a window's span may name freed blocks)."""
    if BLOCK_SIZE % BLOCK_N == 0:
        index = (t * BLOCK_N) // BLOCK_SIZE
        return tl.load(table + index, mask=t * BLOCK_N < kv_len, other=0).to(tl.int64)
    else:
        key_pos = t * BLOCK_N + offsets
        ok = key_pos < kv_len
        if WINDOW:
            ok = ok & (key_pos >= kv_start)
        return tl.load(table + key_pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)


@triton.jit
def _tanh(x):
    """tanh from one exp2 (Triton's interpreter has no libdevice): saturates to +-1 without NaN."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _sink_share(m, total, sink):
    """What a normalised softmax output keeps once a sink logit (base 2) joins its denominator (one
    more term, attending no value): `total / (total + 2^(sink - m))` for row max `m` and
    denominator `total`, computed relative to `max(m, sink)`; 0 for a row without keys."""
    m_new = tl.maximum(m, sink)
    kept = total * tl.exp2(m - m_new)  # 0 for a row without keys (m = -inf, total = 0)
    return kept / (kept + tl.exp2(sink - m_new))


@triton.jit
def _online_softmax_step(scores, allowed, m_i, l_i, acc, values, PRECISION: tl.constexpr):
    """One key tile of the online softmax: `scores` (base-2 logits) masked to `allowed`, folded into
    the rows' running max `m_i`, sum `l_i` and unnormalised output `acc` with the tile's `values`
    (a row with no key allowed yet keeps max -inf and contributes nothing)."""
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend(
    q, key_cache, value_cache, block_table, seq, kv_head, kv_start, kv_len, first_tile, end_tile,
    position, row_ok, scale_log2, window, cap_log2,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    """Online softmax of the rows of `q [BLOCK_M, BLOCK_D]` over the keys `[kv_start, kv_len)` of
    key tiles [first_tile, end_tile): (unnormalised output, row max, row sum), base-2 exponents.

    Keys outside `[kv_start, kv_len)` are masked in every load, so blocks before a window's span
    are never read. Causal rows also mask keys past their `position` and, with a `WINDOW`, at or
    before `position - window`. `SOFT_CAP`: the base-2 logits `s * log2(e)` become
    `cap_log2 * tanh(s * log2(e) / cap_log2)` with `cap_log2 = c * log2(e)`, which is
    `c * tanh(s / c)` in base 2."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k_base = key_cache + kv_head * stride_kh
    v_base = value_cache + kv_head * stride_vh
    table = block_table + seq * stride_bt
    # The block-table entries of each tile are loaded one iteration ahead (carried in the loop), so
    # the K/V loads depend on no load of their own iteration and Triton pipelines them the full
    # `num_stages - 1` tiles deep (an in-iteration lookup costs the pipeline one stage).
    physical = _tile_blocks(table, first_tile, kv_start, kv_len, offsets, BLOCK_N, BLOCK_SIZE, WINDOW)
    for t in tl.range(first_tile, end_tile, num_stages=NUM_STAGES):
        key_pos = t * BLOCK_N + offsets
        if WINDOW:
            kv_ok = (key_pos >= kv_start) & (key_pos < kv_len)
        else:
            kv_ok = key_pos < kv_len
        if BLOCK_SIZE % BLOCK_N == 0:  # the tile lies in one block: contiguous rows
            slot = (t * BLOCK_N) % BLOCK_SIZE + offsets
        else:
            slot = key_pos % BLOCK_SIZE
        k_rows = physical * stride_kb + slot * stride_ks
        v_rows = physical * stride_vb + slot * stride_vs
        physical = _tile_blocks(table, t + 1, kv_start, kv_len, offsets, BLOCK_N, BLOCK_SIZE, WINDOW)
        if BLOCK_D == HEAD_DIM:
            tile_ok = kv_ok[:, None]
        else:
            tile_ok = kv_ok[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_base + k_rows[:, None] + dims[None, :] * stride_kd, mask=tile_ok, other=0.0)
        v = tl.load(v_base + v_rows[:, None] + dims[None, :] * stride_vd, mask=tile_ok, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if SOFT_CAP:
            scores = cap_log2 * _tanh(scores / cap_log2)
        if CAUSAL:
            allowed = row_ok[:, None] & kv_ok[None, :] & (key_pos[None, :] <= position[:, None])
            if WINDOW:
                allowed = allowed & (key_pos[None, :] > (position - window)[:, None])
        else:  # decode: every row sees every key of the span, `[kv_start, kv_len)`
            allowed = row_ok[:, None] & kv_ok[None, :]
        acc, m_i, l_i = _online_softmax_step(scores, allowed, m_i, l_i, acc, v, PRECISION)
    return acc, m_i, l_i


#: Runtime ints that vary with the batch: not specialised (divisibility by 16, == 1), so one
#: compiled variant serves every batch of a kind.
