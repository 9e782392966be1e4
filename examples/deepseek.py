"""A DeepSeek-style decoder with random weights: multi-head latent attention (MLA) over a paged
latent cache, through `ascend.mla_attention` and `ascend.mla_cache_write`.

Each layer runs MLA's absorbed decode path, as vLLM and vLLM-Ascend do: the query projection gives
each head a non-rope part `q_nope` and a rope part `q_pe`; W_UK (the key half of `kv_b`) is absorbed
into `q_nope`, so it attends the compressed latent directly; `kv_a` projects each token to its
latent (normed) and one rope key `k_pe` shared by every head, which the cache keeps; after
attention W_UV (the value half of `kv_b`) up-projects the latent output per head. A SwiGLU MLP stands
in for DeepSeek's mixture of experts (not what this example is about). Inputs are vLLM's flattened
batch, as in `examples/llama.py`, whose `PagedBatch` builds them.

    python -m examples.deepseek [--steps 8] [--dump-dir DIR]

compiles it with `ascend_graph`, runs decode and mixed steps over several buckets, compares each
with the uncompiled model and prints the compiler's decisions from the dump.
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile

import torch
from torch import nn

import ascend_compile
import ascend_compile.ops  # noqa: F401  (registers torch.ops.ascend)
from ascend_compile import cli
from examples.demo import run_and_compare
from examples.llama import DecoderLayer, LlamaDecoder, PagedBatch, RMSNorm, rotate


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig:
    """Sizes of the example model (DeepSeek-V2's structure, tiny) and its latent cache."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    kv_lora_rank: int = 32  # the latent each token keeps in the cache (DeepSeek-V2/V3: 512)
    qk_nope_head_dim: int = 16  # the non-rope part of a head's query and key (128)
    qk_rope_head_dim: int = 8  # the rope part, shared by every head on the key side (64)
    v_head_dim: int = 16  # (128)
    ffn_size: int = 128
    block_size: int = 16
    num_blocks: int = 512
    dtype: torch.dtype = torch.float32
    rope_theta: float = 10000.0


class LatentAttention(nn.Module):
    """MLA, absorbed: `[T, hidden]` in, `[T, hidden]` out, the latent cache written for this step's tokens."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        self.cfg = cfg
        heads = cfg.num_heads
        self.q = nn.Linear(cfg.hidden_size, heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), bias=False)
        self.kv_a = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o = nn.Linear(heads * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        blocks = (cfg.num_blocks, cfg.block_size)
        self.register_buffer("kv_c_cache", torch.zeros(*blocks, cfg.kv_lora_rank, dtype=cfg.dtype), persistent=False)
        self.register_buffer("k_pe_cache", torch.zeros(*blocks, cfg.qk_rope_head_dim, dtype=cfg.dtype),
                             persistent=False)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK `[H, kv_lora_rank, qk_nope_head_dim]` and W_UV `[H, kv_lora_rank, v_head_dim]` from `kv_b`."""
        cfg = self.cfg
        w = self.kv_b.weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        w_uk, w_uv = w.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
        return w_uk.transpose(1, 2), w_uv.transpose(1, 2)

    def forward(self, x, cos, sin, block_table, seq_lens, query_start_loc, slot_mapping):
        cfg = self.cfg
        tokens = x.shape[0]
        q = self.q(x).view(tokens, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_pe = rotate(q_pe, cos, sin)
        latent, k_pe = self.kv_a(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_norm(latent.contiguous())
        k_pe = rotate(k_pe.unsqueeze(1), cos, sin).squeeze(1)
        w_uk, w_uv = self.up_projections()
        q_latent = torch.einsum("thd,hld->thl", q_nope, w_uk)  # W_UK absorbed into the query
        torch.ops.ascend.mla_cache_write(latent, k_pe, self.kv_c_cache, self.k_pe_cache, slot_mapping)
        out = torch.ops.ascend.mla_attention(q_latent, q_pe.contiguous(), self.kv_c_cache, self.k_pe_cache,
                                             block_table, seq_lens, query_start_loc, self.scale)
        out = torch.einsum("thl,hlv->thv", out, w_uv)  # W_UV: the latent output up-projected per head
        return self.o(out.reshape(tokens, -1))


class DeepSeekDecoder(LlamaDecoder):
    """`examples.llama.LlamaDecoder`'s inputs and outputs: its decoder layers with latent attention,
    rope over each head's rope part."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__(cfg, make_layer=lambda: DecoderLayer(cfg, attention=LatentAttention(cfg)),
                         rope_dim=cfg.qk_rope_head_dim)


def build(cfg: DeepSeekConfig | None = None, seed: int = 0) -> DeepSeekDecoder:
    """The example model with seeded random weights and a random latent cache, in inference mode."""
    torch.manual_seed(seed)
    model = DeepSeekDecoder(cfg or DeepSeekConfig())
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.dim() > 1:
                tensor.normal_(std=0.05 if "cache" not in name else 1.0)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dump-dir", default=None)
    parser.add_argument("--runtime", default="auto", choices=["auto", "sim", "eager"])
    args = parser.parse_args()
    dump_dir = args.dump_dir or tempfile.mkdtemp(prefix="ascend_compile_deepseek_")

    cfg = DeepSeekConfig(num_blocks=2048)
    model, reference = build(cfg), build(cfg)
    max_model_len = 64 * cfg.block_size
    options = {"max_model_len": max_model_len, "capture_sizes": [1, 2, 4, 8, 16, 32], "runtime": args.runtime,
               "dump_dir": dump_dir}
    compiled = ascend_compile.compile(model, options)
    run_and_compare(compiled, reference, PagedBatch(cfg, table_width=max_model_len // cfg.block_size),
                    max_model_len, args.steps, (3, 13, 6, 32, 1, 4))
    cli.main(["inspect", dump_dir])


if __name__ == "__main__":
    main()
