"""Reference PA, FIA and MLA kernels in pure torch: split-K attention over a paged KV cache.

They run on any device and define the semantics every device kernel must match. Both really use
their workspace: each split's partial output and log-sum-exp are written there, and the reduce
reads them back from there, so a short or corrupted workspace changes the result.

Workspace layout (float32), query tokens in order, for each token whose sequence has `S > 1`
splits: `S * H * D` partial outputs (split-major), then `S * H` log-sum-exps. Tokens of sequences
with one split write their output directly and take no workspace. See `tiling.py` for the sizes.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from ..errors import WorkspaceTooSmall
from . import tiling
from .features import PLAIN, AttentionFeatures

#: Test hook: called with the float32 workspace between the split and the reduce phases.
between_split_and_reduce: Callable[[torch.Tensor], None] | None = None


def _gather_split_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_idx: torch.Tensor,
) -> torch.Tensor:
    """Cache rows at logical positions `kv_idx [B, S, C]` of each sequence -> `[B, S, C, KVH, D]`."""
    block_size = cache.shape[1]
    batch = torch.arange(kv_idx.shape[0], device=kv_idx.device).view(-1, 1, 1)
    blocks = block_table.long()[batch, kv_idx // block_size]
    return cache[blocks, kv_idx % block_size].float()


def split_k_attention(
    kernel: str,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_starts: Sequence[int],
    query_lens: Sequence[int],
    kv_lens: Sequence[int],
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
    num_splits: int | None = None,
    features: AttentionFeatures = PLAIN,
    sinks: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Causal split-K attention of each sequence's query tokens over its paged KV, into `out`,
    with the `features` of `features.py` (the sinks' values in `sinks`).

    `rope` (MLA, FIA v2's `query_rope` / `key_rope`): a query part `[T, H, R]` and a key cache part
    `[NB, BS, KVH, R]` whose product adds to the scores; the values keep the dim of `value_cache`.
    MLA passes its latent cache as both `key_cache` and `value_cache` (read once).

    The split count of each sequence follows `kernel`'s tiling rule over the keys it reads (its
    span: all of them, or with a window its last `W + q - 1`), or is `num_splits` for every
    sequence when given (the fixed split count of the device-length ops, `ops/cuda.py`). No key
    before a sequence's span is read, so its blocks may be freed.
    """
    shape = tiling.AttentionShape.of(query, key_cache)
    if rope is not None:
        shape = dataclasses.replace(shape, rope_dim=int(rope[0].shape[2]))
    spans = [features.span(n, q) for n, q in zip(kv_lens, query_lens)]
    if num_splits is None:
        needed = tiling.workspace_nbytes(kernel, shape, spans, query_lens)
    elif num_splits < 1:
        raise ValueError(f"num_splits: expected a positive split count, got {num_splits}")
    else:
        tokens = sum(q for q, n in zip(query_lens, kv_lens) if n > 0)
        needed = tokens * num_splits * tiling.split_record_nbytes(shape) if num_splits > 1 else 0
    if workspace.numel() < needed:
        raise WorkspaceTooSmall(kernel, needed, workspace.numel())
    out.zero_()
    device = query.device
    num_seqs = len(kv_lens)
    if num_seqs == 0 or max(kv_lens) == 0 or query.shape[0] == 0:
        return  # nothing attends (a step of sequences without query tokens attends nothing)
    heads, dim = shape.num_heads, shape.head_dim
    kv_heads = shape.num_kv_heads
    group = heads // kv_heads

    kv = torch.tensor(list(kv_lens), dtype=torch.int64, device=device)
    span = torch.tensor(spans, dtype=torch.int64, device=device)
    ql = torch.tensor(list(query_lens), dtype=torch.int64, device=device)
    qs = torch.tensor(list(query_starts), dtype=torch.int64, device=device)
    if num_splits is None:
        splits = tiling.splits_for(kernel, span).clamp(min=1)
    else:
        splits = torch.full_like(kv, num_splits)
    chunk = torch.div(span + splits - 1, splits, rounding_mode="floor").clamp(min=1)
    max_splits = int(splits.max())
    max_chunk = int(chunk.max())
    max_q = max(int(ql.max()), 1)

    # Logical KV positions of every (sequence, split, slot), from the start of the span.
    s_idx = torch.arange(max_splits, device=device).view(1, -1, 1)
    c_idx = torch.arange(max_chunk, device=device).view(1, 1, -1)
    offset = s_idx * chunk.view(-1, 1, 1) + c_idx
    kv_valid = (c_idx < chunk.view(-1, 1, 1)) & (offset < span.view(-1, 1, 1)) & (s_idx < splits.view(-1, 1, 1))
    start = (kv - span).view(-1, 1, 1)  # slots past a sequence's keys read its span's first key: no block before it
    kv_idx = torch.where(kv_valid, start + offset, start.expand_as(offset))
    keys = _gather_split_kv(key_cache, block_table, kv_idx)
    values = keys if value_cache is key_cache else _gather_split_kv(value_cache, block_table, kv_idx)

    # Queries padded per sequence: [B, Q, KVH, G, D].
    q_pos = torch.arange(max_q, device=device).view(1, -1)
    q_valid = (q_pos < ql.view(-1, 1)) & (kv.view(-1, 1) > 0)
    tok = torch.where(q_valid, qs.view(-1, 1) + q_pos, torch.zeros_like(q_pos))
    q = query[tok].float().view(num_seqs, max_q, kv_heads, group, dim)

    scores = torch.einsum("bqkgd,bsckd->bkgqsc", q, keys)
    if rope is not None:
        query_rope, key_rope = rope
        q_rope = query_rope[tok].float().view(num_seqs, max_q, kv_heads, group, shape.rope_dim)
        scores = scores + torch.einsum("bqkgd,bsckd->bkgqsc", q_rope, _gather_split_kv(key_rope, block_table, kv_idx))
    scores = scores * scale
    if features.soft_cap is not None:
        scores = features.soft_cap * torch.tanh(scores / features.soft_cap)
    position = (kv - ql).view(-1, 1) + q_pos  # absolute position of each query token
    key_pos, query_pos = kv_idx.view(num_seqs, 1, max_splits, max_chunk), position.view(num_seqs, max_q, 1, 1)
    allowed = kv_valid.view(num_seqs, 1, max_splits, max_chunk) & (key_pos <= query_pos)
    if features.window is not None:
        allowed = allowed & (key_pos > query_pos - features.window)
    allowed = allowed.view(num_seqs, 1, 1, max_q, max_splits, max_chunk)
    scores = scores.masked_fill(~allowed, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m_safe)
    denom = p.sum(dim=-1)
    partial = torch.einsum("bkgqsc,bsckd->bkgqsd", p, values) / denom.clamp(min=1e-30).unsqueeze(-1)
    lse = torch.where(denom > 0, m_safe.squeeze(-1) + torch.log(denom.clamp(min=1e-30)), float("-inf"))

    # [B, Q, S, H, D] and [B, Q, S, H]
    partial = partial.permute(0, 3, 4, 1, 2, 5).reshape(num_seqs, max_q, max_splits, heads, dim)
    lse = lse.permute(0, 3, 4, 1, 2).reshape(num_seqs, max_q, max_splits, heads)

    multi = (splits > 1).view(-1, 1) & q_valid  # tokens whose partials go through the workspace
    if bool(multi.any()):
        _through_workspace(workspace, multi, splits, partial, lse, heads, dim)

    if features.sinks:
        # each head's sink logit joins the denominator of every split's combination, attending no value
        sink = sinks.float().view(1, 1, 1, heads).expand(num_seqs, max_q, 1, heads)
        combined = torch.softmax(torch.cat([lse, sink], dim=2), dim=2)[:, :, :max_splits].nan_to_num(0.0)
    else:
        combined = torch.softmax(lse, dim=2).nan_to_num(0.0)
    result = (combined.unsqueeze(-1) * partial).sum(dim=2)
    out[tok[q_valid]] = result[q_valid].to(out.dtype)


def _through_workspace(
    workspace: torch.Tensor,
    multi: torch.Tensor,
    splits: torch.Tensor,
    partial: torch.Tensor,
    lse: torch.Tensor,
    heads: int,
    dim: int,
) -> None:
    """Write the partials of multi-split tokens to the workspace, then read them back in place."""
    device = partial.device
    max_splits = partial.shape[2]
    tok_splits = splits.view(-1, 1).expand_as(multi)[multi]  # [N] splits per workspace token
    tok_floats = tok_splits * heads * (dim + 1)
    tok_off = torch.cumsum(tok_floats, 0) - tok_floats
    total = int(tok_floats.sum())
    ws = workspace[: total * 4].view(torch.float32)

    rows = multi.unsqueeze(-1) & (torch.arange(max_splits, device=device) < splits.view(-1, 1, 1))
    token_of_row = torch.cumsum(multi.flatten().long(), 0).view_as(multi).unsqueeze(-1).expand_as(rows)[rows] - 1
    split_of_row = torch.arange(max_splits, device=device).expand_as(rows)[rows]
    base = tok_off[token_of_row]
    out_idx = (base + split_of_row * heads * dim).unsqueeze(1) + torch.arange(heads * dim, device=device)
    lse_idx = (base + tok_splits[token_of_row] * heads * dim + split_of_row * heads).unsqueeze(1) + torch.arange(
        heads, device=device
    )
    ws[out_idx] = partial[rows].reshape(-1, heads * dim)
    ws[lse_idx] = lse[rows]
    if between_split_and_reduce is not None:
        between_split_and_reduce(ws)
    partial[rows] = ws[out_idx].view(-1, heads, dim)
    lse[rows] = ws[lse_idx]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: Sequence[int],
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """PA: one query token per sequence (decode), split-K flash decoding with PA's tiling."""
    num = query.shape[0]
    split_k_attention(
        tiling.PA, query, key_cache, value_cache, block_table,
        list(range(num)), [1] * num, context_lens, scale, workspace, out,
    )


def fused_infer_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_ends: Sequence[int],
    kv_lens: Sequence[int],
    query_lens: Sequence[int],
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
    features: AttentionFeatures = PLAIN,
    sinks: torch.Tensor | None = None,
) -> None:
    """FIA: TND layout, any number of query tokens per sequence, causal among them."""
    starts = [end - n for end, n in zip(query_ends, query_lens)]
    split_k_attention(
        tiling.FIA, query, key_cache, value_cache, block_table,
        starts, query_lens, kv_lens, scale, workspace, out, features=features, sinks=sinks,
    )


def mla_fused_infer_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_cache: torch.Tensor,
    k_pe_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_ends: Sequence[int],
    kv_lens: Sequence[int],
    query_lens: Sequence[int],
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
    num_splits: int | None = None,
) -> None:
    """MLA (absorbed form): TND like FIA, one latent KV head; the scores are
    `q_nope . kv_c + q_pe . k_pe`, the values `kv_c` (see `ops/mla.py`). `num_splits`: every
    sequence split that many times (the device-length op, `ops/cuda_mla.py`), else MLA's tiling."""
    starts = [end - n for end, n in zip(query_ends, query_lens)]
    latent = kv_c_cache.unsqueeze(2)  # [NB, BS, 1, kv_lora_rank]: one KV head, keys and values alike
    split_k_attention(
        tiling.MLA, q_nope, latent, latent, block_table,
        starts, query_lens, kv_lens, scale, workspace, out, num_splits=num_splits,
        rope=(q_pe, k_pe_cache.unsqueeze(2)),
    )
