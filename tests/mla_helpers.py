"""MLA problems and their dense oracle: MLA computed the long way, the latent decompressed into
per-head keys and values with W_UK / W_UV and attended with a plain masked softmax."""
from __future__ import annotations

import dataclasses

import torch

import ascend_compile.ops  # noqa: F401  (registers torch.ops.ascend)
from tests.helpers import PagedLengths


@dataclasses.dataclass
class MlaProblem(PagedLengths):
    """A random MLA step over a paged latent cache, with the up-projections that define it."""

    q_full: torch.Tensor  # [T, H, qk_nope_dim]: the query before W_UK is absorbed
    q_pe: torch.Tensor  # [T, H, rope_dim]
    kv_c_cache: torch.Tensor  # [NB, BS, kv_lora_rank]
    k_pe_cache: torch.Tensor  # [NB, BS, rope_dim]
    w_uk: torch.Tensor  # [H, kv_lora_rank, qk_nope_dim]
    w_uv: torch.Tensor  # [H, kv_lora_rank, v_dim]
    block_table: torch.Tensor
    seq_lens: list
    query_lens: list
    scale: float

    @property
    def q_nope(self) -> torch.Tensor:
        """The absorbed query: W_UK folded into each head's query, `[T, H, kv_lora_rank]` (the caches' dtype)."""
        return torch.einsum("thd,hld->thl", self.q_full, self.w_uk).to(self.kv_c_cache.dtype)

    def attend(self) -> torch.Tensor:
        """`ascend.mla_attention` on the problem, up-projected by W_UV: `[T, H, v_dim]`."""
        seq_lens, query_start_loc = self.tensors()
        latent = torch.ops.ascend.mla_attention(self.q_nope, self.q_pe, self.kv_c_cache, self.k_pe_cache,
                                                self.block_table, seq_lens, query_start_loc, self.scale)
        return self.up_project(latent)

    def up_project(self, latent: torch.Tensor) -> torch.Tensor:
        """A latent attention output `[T, H, kv_lora_rank]` up-projected by W_UV: `[T, H, v_dim]`."""
        return torch.einsum("thl,hlv->thv", latent.float(), self.w_uv.float())

    def dense(self) -> torch.Tensor:
        """The oracle: per sequence, decompress the latent into per-head K and V and attend causally."""
        heads, v_dim = self.w_uv.shape[0], self.w_uv.shape[2]
        block_size = self.kv_c_cache.shape[1]
        out = torch.zeros(self.q_full.shape[0], heads, v_dim)
        starts = self.query_start_loc
        for b, length in enumerate(self.seq_lens):
            start, end = starts[b], starts[b + 1]
            if length == 0 or end == start:
                continue
            blocks = self.block_table[b, : (length + block_size - 1) // block_size].long()
            latent = self.kv_c_cache[blocks].reshape(-1, self.kv_c_cache.shape[2])[:length].float()
            k_pe = self.k_pe_cache[blocks].reshape(-1, self.k_pe_cache.shape[2])[:length].float()
            keys = torch.einsum("nl,hld->nhd", latent, self.w_uk.float())
            values = torch.einsum("nl,hlv->nhv", latent, self.w_uv.float())
            n = end - start
            scores = (torch.einsum("qhd,nhd->hqn", self.q_full[start:end].float(), keys)
                      + torch.einsum("qhr,nr->hqn", self.q_pe[start:end].float(), k_pe)) * self.scale
            causal = torch.arange(length).view(1, -1) > torch.arange(length - n, length).view(-1, 1)
            probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
            out[start:end] = torch.einsum("hqn,nhv->qhv", probs, values)
        return out


def make_mla_problem(seq_lens, query_lens=None, heads=4, kv_lora_rank=32, rope_dim=8, qk_nope_dim=16, v_dim=16,
                     block_size=16, seed=0, dtype=torch.float32) -> MlaProblem:
    """Random queries, latent caches and up-projections; each sequence gets its own shuffled blocks
    (a padding sequence has length 0 and no query tokens). `q_pe` and the caches are of `dtype`;
    the unabsorbed query and the up-projections stay float32 (the oracle's)."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = list(query_lens) if query_lens is not None else [1 if n else 0 for n in seq_lens]
    max_blocks = max(1, max((n + block_size - 1) // block_size for n in seq_lens))
    num_blocks = max_blocks * len(seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=gen)[: max_blocks * len(seq_lens)]
    block_table = perm.view(len(seq_lens), max_blocks).to(torch.int32)
    tokens = sum(query_lens)
    return MlaProblem(
        q_full=torch.randn(tokens, heads, qk_nope_dim, generator=gen),
        q_pe=torch.randn(tokens, heads, rope_dim, generator=gen).to(dtype),
        kv_c_cache=torch.randn(num_blocks, block_size, kv_lora_rank, generator=gen).to(dtype),
        k_pe_cache=torch.randn(num_blocks, block_size, rope_dim, generator=gen).to(dtype),
        w_uk=torch.randn(heads, kv_lora_rank, qk_nope_dim, generator=gen) / kv_lora_rank**0.5,
        w_uv=torch.randn(heads, kv_lora_rank, v_dim, generator=gen) / kv_lora_rank**0.5,
        block_table=block_table, seq_lens=list(seq_lens), query_lens=query_lens,
        scale=(qk_nope_dim + rope_dim) ** -0.5,
    )
