"""The host side of the Triton kernels' launch (`cuda_triton.py`): tile sizes, pipeline depth and
split floors, the launch configuration of a call, and the host mirrors of the schedule the kernels
compute on the device (`cuda_triton_device.py`), for the tests and tools that check it.
"""
from __future__ import annotations

import functools

import torch

from .cuda_triton_device import SEARCH_STEPS
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
