"""Shared test helpers: a dense softmax reference and random paged-attention problems."""
from __future__ import annotations

import dataclasses
import importlib
import os
from types import ModuleType

import pytest
import torch

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def dense_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, window=None,
                    soft_cap=None, sinks=None):
    """Masked softmax over the gathered blocks, one sequence at a time, in float32: causal, keys in
    the window `(p - window, p]` of a query at position `p`, logits soft-capped, and a sink logit per
    head appended as a column that is dropped after the softmax (the definitions, computed the long way)."""
    heads, dim = query.shape[1], query.shape[2]
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float32)
    for b, length in enumerate(seq_lens):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        if length == 0 or end == start:
            continue
        blocks = block_table[b, : (length + block_size - 1) // block_size].long()
        keys = key_cache[blocks].reshape(-1, kv_heads, dim)[:length].float()
        values = value_cache[blocks].reshape(-1, kv_heads, dim)[:length].float()
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        q = query[start:end].float()
        n = end - start
        scores = torch.einsum("qhd,lhd->hql", q, keys) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        pos = torch.arange(length - n, length).view(-1, 1)
        key_pos = torch.arange(length).view(1, -1)
        masked = key_pos > pos
        if window is not None:
            masked = masked | (key_pos <= pos - window)
        scores = scores.masked_fill(masked, float("-inf"))
        if sinks is not None:
            column = sinks.float().view(heads, 1, 1).expand(heads, n, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hql,lhd->qhd", probs, values)
    return out


class PagedLengths:
    """The length metadata of a random step (`seq_lens` and `query_lens` fields), as the ops take it."""

    seq_lens: list
    query_lens: list

    @property
    def query_start_loc(self) -> list:
        loc = [0]
        for n in self.query_lens:
            loc.append(loc[-1] + n)
        return loc

    def tensors(self):
        return (
            torch.tensor(self.seq_lens, dtype=torch.int32),
            torch.tensor(self.query_start_loc, dtype=torch.int32),
        )


@dataclasses.dataclass
class Problem(PagedLengths):
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: list
    query_lens: list
    scale: float

    def dense(self, **features):
        return dense_attention(self.query, self.key_cache, self.value_cache, self.block_table,
                               self.seq_lens, self.query_start_loc, self.scale, **features)


def make_problem(seq_lens, query_lens=None, heads=4, kv_heads=2, dim=16, block_size=16, max_blocks=None,
                 dtype=torch.float32, seed=0) -> Problem:
    """Random query and caches; each sequence gets its own shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = list(query_lens) if query_lens is not None else [1] * len(seq_lens)
    max_blocks = max_blocks or max(1, max((n + block_size - 1) // block_size for n in seq_lens))
    num_blocks = max_blocks * len(seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=gen)[: max_blocks * len(seq_lens)]
    block_table = perm.view(len(seq_lens), max_blocks).to(torch.int32)
    shape = (num_blocks, block_size, kv_heads, dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), heads, dim, generator=gen).to(dtype)
    return Problem(query, key_cache, value_cache, block_table, list(seq_lens), query_lens, dim**-0.5)


def triton_kernels(module: str, device: torch.device) -> ModuleType:
    """`ascend_compile.ops.<module>`, Triton kernels, for a test module's fixture: interpreted on the CPU
    (tests/conftest.py), compiled with CUDA; the test is skipped where neither can run."""
    if device.type == "cpu":
        pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")
    pytest.importorskip("triton", reason="the Triton kernel tests need triton")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not 1, and there is no GPU to run the Triton kernels on")
    return importlib.import_module(f"ascend_compile.ops.{module}")


def write_flash_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """vLLM's `reshape_and_cache_flash` into `[num_blocks, block_size, kv_heads, head_dim]` key and value
    caches (views of a layer's cache, any strides), in pure torch: `slot_mapping`'s length is the number
    of real tokens (key may be padded); negative slots are skipped."""
    n = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = key_cache.shape[1]
    key_cache[slots // block_size, slots % block_size] = key[:n][valid]
    value_cache[slots // block_size, slots % block_size] = value[:n][valid]
