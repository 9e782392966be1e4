"""Argument checks shared by the attention ops: each bad input gets its own clear message.

Shape, dtype and device checks need no data; checks on lengths use the host-side lists the kernels
take anyway; the block-id check reads the block table, which the reference kernels gather from.
"""
from __future__ import annotations

from typing import Sequence

import torch


def _fail(arg: str, expected: str, got: object) -> None:
    raise ValueError(f"{arg}: expected {expected}, got {got}")


def check_attention_tensors(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_seqs: int,
) -> None:
    """Shapes, dtypes and devices of query, caches and block table."""
    if query.dim() != 3:
        _fail("query", "a [T, H, D] tensor", f"shape {tuple(query.shape)}")
    if key_cache.dim() != 4:
        _fail("key_cache", "a [num_blocks, block_size, KVH, D] tensor", f"shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        _fail("value_cache", f"the shape of key_cache {tuple(key_cache.shape)}", tuple(value_cache.shape))
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != dim:
        _fail("key_cache", f"head dim {dim} (the query's)", key_cache.shape[3])
    if kv_heads == 0 or heads % kv_heads != 0:
        _fail("query", f"a head count that is a multiple of the KV head count {kv_heads}", heads)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype != query.dtype:
            _fail(name, f"dtype {query.dtype} (the query's)", cache.dtype)
    if block_table.dtype != torch.int32:
        _fail("block_table", "dtype torch.int32", block_table.dtype)
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        _fail("block_table", f"a [{num_seqs}, max_blocks] tensor", f"shape {tuple(block_table.shape)}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("block_table", block_table)):
        if t.device != query.device:
            _fail(name, f"device {query.device} (the query's)", t.device)


def sequence_rows(block_table: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """The first `num_seqs` rows of `block_table`, the ones a kernel taking its batch from its host
    lists reads: a graph's static table holds a row per sequence it can serve, a step's lists one
    entry per sequence it has (`lowering/inputs.py`: mixed graphs pack their padding)."""
    if block_table.dim() != 2 or block_table.shape[0] < num_seqs:
        _fail("block_table", f"a [>= {num_seqs}, max_blocks] tensor (a row per sequence)", f"shape {tuple(block_table.shape)}")
    return block_table[:num_seqs]


def check_int32_vector(name: str, t: torch.Tensor, length: int, device: torch.device) -> None:
    """A 1-D int32 tensor of the given length on the given device."""
    if t.dtype != torch.int32:
        _fail(name, "dtype torch.int32", t.dtype)
    if t.dim() != 1 or t.shape[0] != length:
        _fail(name, f"a 1-D tensor of length {length}", f"shape {tuple(t.shape)}")
    if t.device != device:
        _fail(name, f"device {device} (the query's)", t.device)


def check_lengths(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    max_blocks: int,
    block_size: int,
    arg: str,
) -> None:
    """Every KV length fits its block-table row and covers its query tokens.

    Non-negative and at most what the block-table row holds (KV_S): the device's rule (torch_npu
    2.14 `_op_plugin_docs.py`, npu_fused_infer_attention_score, L8211 and L8275). A length covering
    its sequence's query tokens (or 0, an empty sequence) is the ops' contract, not a device rule
    (DESIGN.md §3: query tokens are the last positions of their sequence, counted in its length).
    """
    capacity = max_blocks * block_size
    for i, (kv, q) in enumerate(zip(seq_lens, query_lens)):
        if kv < 0:
            _fail(arg, "non-negative lengths", f"{kv} for sequence {i}")
        if kv > capacity:
            _fail(
                arg,
                f"lengths of at most {capacity} (block_table rows hold {max_blocks} blocks of {block_size})",
                f"{kv} for sequence {i}",
            )
        if kv > 0 and q > kv:
            _fail(arg, f"a length covering the sequence's {q} query tokens", f"{kv} for sequence {i}")


def query_lens_from_ends(ends: Sequence[int], num_tokens: int, arg: str) -> list[int]:
    """Per-sequence query lengths from cumulative query ends, checked (non-decreasing, last == T)."""
    lens = []
    prev = 0
    for i, end in enumerate(ends):
        if end < prev:
            _fail(arg, "non-decreasing cumulative query offsets", f"{end} after {prev} at index {i}")
        lens.append(end - prev)
        prev = end
    if prev != num_tokens:
        _fail(arg, f"offsets ending at the number of query tokens {num_tokens}", f"last offset {prev}")
    return lens


def query_lens_from_start_loc(query_start_loc: Sequence[int], num_tokens: int) -> list[int]:
    """Per-sequence query lengths from `query_start_loc` (starts at 0, non-decreasing, ends at T)."""
    if not query_start_loc or query_start_loc[0] != 0:
        _fail("query_start_loc", "offsets starting at 0", list(query_start_loc[:1]))
    return query_lens_from_ends(query_start_loc[1:], num_tokens, "query_start_loc")


def check_block_ids(
    block_table: torch.Tensor, seq_lens: Sequence[int], block_size: int, num_blocks: int, arg: str,
    spans: Sequence[int] | None = None,
) -> None:
    """Every block a sequence uses is a valid index into the cache: with `spans` (the keys each
    sequence reads, `features.py`), only the blocks of its last `span` keys, so a runtime may free
    and reuse the entries before a window."""
    if not seq_lens:
        return
    device = block_table.device
    used = torch.tensor([(n + block_size - 1) // block_size for n in seq_lens], device=device)
    first = torch.tensor([(n - s) // block_size for n, s in zip(seq_lens, spans or seq_lens)], device=device)
    cols = torch.arange(block_table.shape[1], device=device)
    in_use = (cols.unsqueeze(0) < used.unsqueeze(1)) & (cols.unsqueeze(0) >= first.unsqueeze(1))
    bad = in_use & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        row, col = (int(v) for v in bad.nonzero()[0])
        _fail(
            arg,
            f"block ids in [0, {num_blocks}) for every block a sequence uses",
            f"block {int(block_table[row, col])} at row {row}, column {col}",
        )


def check_mla_tensors(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_cache: torch.Tensor,
    k_pe_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_seqs: int,
) -> None:
    """Shapes, dtypes and devices of MLA's queries, latent caches and block table."""
    if q_nope.dim() != 3:
        _fail("q_nope", "a [T, H, kv_lora_rank] tensor", f"shape {tuple(q_nope.shape)}")
    tokens, heads, rank = q_nope.shape
    if q_pe.dim() != 3 or q_pe.shape[:2] != (tokens, heads) or q_pe.shape[2] == 0:
        _fail("q_pe", f"a [{tokens}, {heads}, rope_dim] tensor (rope_dim > 0)", f"shape {tuple(q_pe.shape)}")
    if kv_c_cache.dim() != 3 or kv_c_cache.shape[2] != rank:
        _fail("kv_c_cache", f"a [num_blocks, block_size, {rank}] tensor (q_nope's kv_lora_rank)",
              f"shape {tuple(kv_c_cache.shape)}")
    expected = (*kv_c_cache.shape[:2], q_pe.shape[2])
    if tuple(k_pe_cache.shape) != expected:
        _fail("k_pe_cache", f"a {list(expected)} tensor (kv_c_cache's blocks, q_pe's rope_dim)",
              f"shape {tuple(k_pe_cache.shape)}")
    for name, t in (("q_pe", q_pe), ("kv_c_cache", kv_c_cache), ("k_pe_cache", k_pe_cache)):
        if t.dtype != q_nope.dtype:
            _fail(name, f"dtype {q_nope.dtype} (q_nope's)", t.dtype)
    if block_table.dtype != torch.int32:
        _fail("block_table", "dtype torch.int32", block_table.dtype)
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        _fail("block_table", f"a [{num_seqs}, max_blocks] tensor", f"shape {tuple(block_table.shape)}")
    for name, t in (("q_pe", q_pe), ("kv_c_cache", kv_c_cache), ("k_pe_cache", k_pe_cache),
                    ("block_table", block_table)):
        if t.device != q_nope.device:
            _fail(name, f"device {q_nope.device} (q_nope's)", t.device)
