"""A Llama-style decoder with random weights over a paged KV cache, built on the `ascend` ops.

It is the model the demo, the tests and the benchmarks compile: RMSNorm, rotary embeddings,
grouped-query attention through `ascend.attention`, cache writes through
`ascend.reshape_and_cache`, a SwiGLU MLP. Its inputs are vLLM's flattened batch: tokens of all
sequences in one dimension, plus the attention metadata.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Sequence

import torch
from torch import nn

import ascend_compile.ops  # noqa: F401  (registers torch.ops.ascend)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the example model and its KV cache."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_size: int = 128
    block_size: int = 16
    num_blocks: int = 256
    dtype: torch.dtype = torch.float32
    rope_theta: float = 10000.0
    #: attention features (`ascend_compile/ops/features.py`): the window of the "sliding" layers,
    #: each layer's type ("full" or "sliding"; empty: every layer full), a logit soft-cap, per-head sinks
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    soft_cap: float | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types: expected one per layer ({self.num_layers}), got {len(self.layer_types)}")

    def window_of(self, layer: int) -> int | None:
        """The window of layer `layer`: `sliding_window` for a "sliding" layer, else None."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding"
        return self.sliding_window if sliding else None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.window = cfg.window_of(layer)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads, dtype=torch.float32)) if cfg.sinks else None
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.sizes = (q_size, kv_size, kv_size)
        cache_shape = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.register_buffer("key_cache", torch.zeros(cache_shape, dtype=cfg.dtype), persistent=False)
        self.register_buffer("value_cache", torch.zeros(cache_shape, dtype=cfg.dtype), persistent=False)

    def forward(self, x, cos, sin, block_table, seq_lens, query_start_loc, slot_mapping):
        cfg = self.cfg
        tokens = x.shape[0]
        q, k, v = self.qkv(x).split(self.sizes, dim=-1)
        q = rotate(q.view(tokens, cfg.num_heads, cfg.head_dim), cos, sin)
        k = rotate(k.view(tokens, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        out = self.attend(q, k, v, block_table, seq_lens, query_start_loc, slot_mapping)
        return self.o(out.reshape(tokens, -1))

    def attend(self, q, k, v, block_table, seq_lens, query_start_loc, slot_mapping):
        """Write this step's keys and values into the paged cache, then attend: `[T, H, D]` out."""
        torch.ops.ascend.reshape_and_cache(k, v, self.key_cache, self.value_cache, slot_mapping)
        return torch.ops.ascend.attention(
            q, self.key_cache, self.value_cache, block_table, seq_lens, query_start_loc, self.cfg.head_dim**-0.5,
            window=self.window, soft_cap=self.cfg.soft_cap, sinks=self.sinks,
        )


class DecoderLayer(nn.Module):
    """Pre-norm attention and a SwiGLU MLP; `attention` replaces this model's own (the MLA example's)."""

    def __init__(self, cfg: LlamaConfig, layer: int = 0, attention: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size)
        self.attn = attention if attention is not None else Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_size, bias=False)
        self.down = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, block_table, seq_lens, query_start_loc, slot_mapping):
        x = x + self.attn(self.attn_norm(x), cos, sin, block_table, seq_lens, query_start_loc, slot_mapping)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class LlamaDecoder(nn.Module):
    """input_ids/positions/slot_mapping `[T]`, block_table `[B, W]`, seq_lens `[B]`,
    query_start_loc `[B+1]` -> logits `[T, vocab]`."""

    def __init__(self, cfg: Any, make_layer: Callable[[], nn.Module] | None = None, rope_dim: int | None = None
                 ) -> None:
        """`cfg`: a `LlamaConfig`, or any config of its vocab, hidden and layer sizes, dtype and rope
        theta (`examples.deepseek`); `make_layer`: each layer (else `DecoderLayer`); `rope_dim`: the
        rotated dims of a head (else `cfg.head_dim`)."""
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = (make_layer() if make_layer else DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        rope_dim = rope_dim or cfg.head_dim
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, rope_dim, 2).float() / rope_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.to(cfg.dtype)

    def forward(self, input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        cos = freqs.cos().unsqueeze(1).to(self.cfg.dtype)
        sin = freqs.sin().unsqueeze(1).to(self.cfg.dtype)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, block_table, seq_lens, query_start_loc, slot_mapping)
        return self.lm_head(self.norm(x))


class PagedBatch:
    """Sequences in a paged KV cache: assigns blocks and builds the model's inputs for a step.

    Every step draws fresh, distinct, shuffled blocks for its sequences (as many as each needs), so
    block tables are not trivially ordered; their width is `table_width` (vLLM's fixed
    max_model_len / block_size) or, by default, varies from step to step.
    """

    def __init__(self, cfg: LlamaConfig, seed: int = 0, table_width: int | None = None) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.table_width = table_width  # None: as wide as the step's longest sequence needs

    def blocks_for(self, context_lens: Sequence[int]) -> list[list[int]]:
        bs = self.cfg.block_size
        need = [max(1, -(-n // bs)) for n in context_lens]
        if sum(need) > self.cfg.num_blocks:
            raise ValueError(f"context_lens: the step needs {sum(need)} blocks, the cache has {self.cfg.num_blocks}")
        free = self.rng.sample(range(self.cfg.num_blocks), sum(need))
        width = self.table_width or max(need)
        if width < max(need):
            raise ValueError(f"context_lens: a sequence needs {max(need)} blocks, table_width is {width}")
        tables, start = [], 0
        for n in need:
            tables.append(free[start:start + n] + [0] * (width - n))
            start += n
        return tables

    def step(self, context_lens: Sequence[int], query_lens: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
        """Inputs for a step where sequence i ends at `context_lens[i]` with `query_lens[i]` new tokens."""
        cfg = self.cfg
        query_lens = list(query_lens) if query_lens is not None else [1] * len(context_lens)
        tables = self.blocks_for(context_lens)
        ids, pos, slots, starts = [], [], [], [0]
        for table, ctx, q in zip(tables, context_lens, query_lens):
            for p in range(ctx - q, ctx):
                ids.append(self.rng.randrange(cfg.vocab_size))
                pos.append(p)
                slots.append(table[p // cfg.block_size] * cfg.block_size + p % cfg.block_size)
            starts.append(starts[-1] + q)
        return {
            "input_ids": torch.tensor(ids, dtype=torch.int64),
            "positions": torch.tensor(pos, dtype=torch.int64),
            "block_table": torch.tensor(tables, dtype=torch.int32),
            "seq_lens": torch.tensor(list(context_lens), dtype=torch.int32),
            "query_start_loc": torch.tensor(starts, dtype=torch.int32),
            "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        }


def build(cfg: LlamaConfig | None = None, seed: int = 0) -> LlamaDecoder:
    """The example model with seeded random weights, in inference mode."""
    torch.manual_seed(seed)
    model = LlamaDecoder(cfg or LlamaConfig())
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.dim() > 1:
                tensor.normal_(std=0.05 if "cache" not in name else 1.0)
    return model.eval()
