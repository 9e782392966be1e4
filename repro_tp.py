"""A 2-rank tensor-parallel decoder on CPU (gloo), compiled with the sim runtime, checked step by step.

Each rank holds half the attention heads and half the MLP; the output projection and the down
projection are row-parallel and end in a functional `all_reduce` (`_c10d_functional.all_reduce` +
`wait_tensor` in the traced graph). The compiled module of each rank is compared, step by step, with
an eager copy of the same rank's module. Exit status 0 when every step matches on both ranks.

    python repro_tp.py [--runtime sim|eager] [--dynamic]
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch import nn

import ascend_compile
from ascend_compile.config import CompileConfig
from examples.llama import LlamaConfig, PagedBatch, RMSNorm, rotate

WORLD = 2
MAX_LEN = 256
STEPS = (3, 4, 2, 4, 1, 3, 4, 2, 3, 4, 1, 2)


class TPLayer(nn.Module):
    """A Llama decoder layer with its heads and MLP split over `WORLD` ranks (row-parallel outputs)."""

    def __init__(self, cfg: LlamaConfig, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.cfg, self.group = cfg, group
        self.heads, self.kv_heads = cfg.num_heads // WORLD, cfg.num_kv_heads // WORLD
        q, kv = self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        self.sizes = (q, kv, kv)
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.hidden_size), RMSNorm(cfg.hidden_size)
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=False)
        self.o = nn.Linear(q, cfg.hidden_size, bias=False)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_size // WORLD, bias=False)
        self.down = nn.Linear(cfg.ffn_size // WORLD, cfg.hidden_size, bias=False)
        shape = (cfg.num_blocks, cfg.block_size, self.kv_heads, cfg.head_dim)
        self.register_buffer("key_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("value_cache", torch.zeros(shape), persistent=False)

    def forward(self, x, cos, sin, block_table, seq_lens, query_start_loc, slot_mapping):
        cfg, tokens = self.cfg, x.shape[0]
        q, k, v = self.qkv(self.attn_norm(x)).split(self.sizes, dim=-1)
        q = rotate(q.view(tokens, self.heads, cfg.head_dim), cos, sin)
        k = rotate(k.view(tokens, self.kv_heads, cfg.head_dim), cos, sin)
        v = v.view(tokens, self.kv_heads, cfg.head_dim)
        torch.ops.ascend.reshape_and_cache(k, v, self.key_cache, self.value_cache, slot_mapping)
        out = torch.ops.ascend.attention(
            q, self.key_cache, self.value_cache, block_table, seq_lens, query_start_loc, cfg.head_dim**-0.5
        )
        x = x + funcol.all_reduce(self.o(out.reshape(tokens, -1)), "sum", self.group)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + funcol.all_reduce(self.down(nn.functional.silu(gate) * up), "sum", self.group)


class TPDecoder(nn.Module):
    """Replicated embedding and head around `num_layers` tensor-parallel layers."""

    def __init__(self, cfg: LlamaConfig, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TPLayer(cfg, group) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, block_table, seq_lens, query_start_loc, slot_mapping)
        return self.lm_head(self.norm(x))


def build(cfg: LlamaConfig, group: dist.ProcessGroup, rank: int) -> TPDecoder:
    """This rank's shard; the seed includes the rank, so the two ranks' shards differ."""
    torch.manual_seed(100 + rank)
    model = TPDecoder(cfg, group)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dim() > 1:
                t.normal_(std=1.0 if "cache" in name else 0.05)
    return model.eval()


def worker(rank: int, port: int, runtime: str, dynamic: bool, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    try:
        torch.set_num_threads(2)
        cfg = LlamaConfig(num_layers=2, num_blocks=256)
        group = dist.group.WORLD
        model, reference = build(cfg, group, rank), build(cfg, group, rank)
        config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=(2, 4), runtime=runtime)
        fn = torch.compile(model, backend=ascend_compile.backend(config), dynamic=dynamic or None)
        batch, rng = PagedBatch(cfg, seed=7), random.Random(7)  # same steps on both ranks
        errors = []
        with torch.no_grad():
            for size in STEPS:
                inputs = batch.step([rng.randint(1, MAX_LEN) for _ in range(size)])
                errors.append((fn(**inputs) - reference(**inputs)).abs().max().item())
        results.put((rank, errors))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runtime", default="sim")
    parser.add_argument("--dynamic", action="store_true")
    opts = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = random.Random().randint(20000, 40000)
    procs = mp.start_processes(
        worker, args=(port, opts.runtime, opts.dynamic, results), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=55)
    while not procs.join(timeout=1):
        if datetime.datetime.now() > deadline:
            for p in procs.processes:
                p.kill()
            print("timeout")
            return 2
    ok = True
    for _ in range(WORLD):
        rank, errors = results.get()
        if isinstance(errors, str):
            print(f"rank {rank} failed:\n{errors}")
            ok = False
            continue
        bad = [i for i, e in enumerate(errors) if e > 1e-4]
        ok &= not bad
        print(f"rank {rank}: max error per step {[round(e, 4) for e in errors]}; wrong steps {bad}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
