"""The example decoder, tensor-parallel over N CPU ranks (gloo), compiled by the backend step by step.

Each rank holds a slice of the unsplit `examples.llama` model: its share of the attention heads and
KV heads (column-parallel QKV, its own slice of the KV cache) and of the MLP (column-parallel
gate/up); the attention output and MLP down projections are row-parallel and end in an all-reduce:
a functional `all_reduce(x, "sum", group)` (`_c10d_functional.all_reduce` + `wait_tensor` in the
traced graph), or, with `--custom-op`, a Python custom op whose body calls `dist.all_reduce` in place,
as vLLM's `torch.ops.vllm.all_reduce` does on CUDA (`c10d.allreduce_` on the device's stream).
Embedding, norms and head are replicated. Every rank compiles its shard and compares it, at every
step, with the unsplit model run eagerly in the same process on the same inputs.

    python -m examples.tensor_parallel [--runtime sim|eager] [--dynamic] [--new-group] [--plain-tensors]
                                       [--custom-op] [--world 4 --tp 2]

Exit status 0 when every step matches on every rank. `tests/test_tensor_parallel.py` runs the same
code (`spawn_ranks`, `Case`).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import multiprocessing
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch import nn

import ascend_compile
from ascend_compile.config import CompileConfig
from ascend_compile.runtime.sim import SimRuntime
from ascend_compile.runtime.sim.faults import streams_exhausted
from ascend_compile.targets import Target
from examples.llama import LlamaConfig, LlamaDecoder, PagedBatch, RMSNorm, build, rotate

MAX_LEN = 256
CAPTURE_SIZES = (1, 2, 4, 8)
ATOL = 1e-4

#: Query tokens per sequence of every step, in order: decode steps (one token per sequence) and
#: mixed steps (several per sequence), the token count falling across, between and above the
#: buckets (1, 2, 4, 8).
STEPS = (
    (1,) * 3, (1,) * 4, (2, 1), (1,) * 5, (1,) * 8, (3, 2, 3), (1,) * 9, (1,) * 2,
    (5, 4), (1,), (1, 3), (1,) * 12, (6, 6), (1, 1),
)


def schedule(seed: int = 11) -> list[tuple[list[int], list[int]]]:
    """(context_lens, query_lens) of every step; the same on every rank for the same seed."""
    rng = random.Random(seed)
    return [([rng.randint(q, MAX_LEN) for q in query_lens], list(query_lens)) for query_lens in STEPS]


#: The groups `tp_example::all_reduce` reduces over, by name (a custom op takes no process group).
GROUPS: dict[str, Any] = {}


@torch.library.custom_op("tp_example::all_reduce", mutates_args=())
def custom_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of `x` over the ranks of group `group_name`: a copy reduced in place by
    `dist.all_reduce`, the shape of vLLM's `torch.ops.vllm.all_reduce` (`_all_reduce_out_place`)."""
    out = x.clone()
    dist.all_reduce(out, group=GROUPS[group_name])
    return out


@custom_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def group_name(group: Any) -> str:
    """`group`'s name for `tp_example::all_reduce`, registered in `GROUPS` (before any trace, as
    vLLM names its groups when it creates them)."""
    name = dist.distributed_c10d._get_group_name(group) if group is not dist.group.WORLD else "world"
    GROUPS[name] = group
    return name


def all_reduce(x: torch.Tensor, group: Any, name: str | None) -> torch.Tensor:
    """The sum of `x` over `group`'s ranks: functional, or through `tp_example::all_reduce` when
    the group's `name` is given."""
    if name is None:
        return funcol.all_reduce(x, "sum", group)
    return custom_all_reduce(x, name)


class TPLayer(nn.Module):
    """A decoder layer holding `1/world` of the heads, KV heads and MLP of `examples.llama`'s."""

    def __init__(self, cfg: LlamaConfig, world: int, group: Any, custom_op: bool = False) -> None:
        super().__init__()
        self.group_name = group_name(group) if custom_op else None
        assert cfg.num_heads % world == 0 and cfg.num_kv_heads % world == 0 and cfg.ffn_size % world == 0
        self.cfg, self.group = cfg, group
        self.heads, self.kv_heads = cfg.num_heads // world, cfg.num_kv_heads // world
        q, kv = self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        self.sizes = (q, kv, kv)
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.hidden_size), RMSNorm(cfg.hidden_size)
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=False)  # column-parallel
        self.o = nn.Linear(q, cfg.hidden_size, bias=False)  # row-parallel
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_size // world, bias=False)  # column-parallel
        self.down = nn.Linear(cfg.ffn_size // world, cfg.hidden_size, bias=False)  # row-parallel
        shape = (cfg.num_blocks, cfg.block_size, self.kv_heads, cfg.head_dim)
        self.register_buffer("key_cache", torch.zeros(shape, dtype=cfg.dtype), persistent=False)
        self.register_buffer("value_cache", torch.zeros(shape, dtype=cfg.dtype), persistent=False)

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
        x = x + all_reduce(self.o(out.reshape(tokens, -1)), self.group, self.group_name)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + all_reduce(self.down(nn.functional.silu(gate) * up), self.group, self.group_name)


class TPDecoder(LlamaDecoder):
    """Replicated embedding, final norm and head around tensor-parallel layers; same inputs and
    outputs as `examples.llama.LlamaDecoder`."""

    def __init__(self, cfg: LlamaConfig, world: int, group: Any, custom_op: bool = False) -> None:
        super().__init__(cfg, make_layer=lambda: TPLayer(cfg, world, group, custom_op))


def shard(
    full: LlamaDecoder, rank: int, world: int, group: Any, plain_tensors: bool = False, custom_op: bool = False
) -> TPDecoder:
    """Rank `rank`'s slice of the unsplit `full` model (weights and KV cache copied, not shared).
    `plain_tensors`: hold every weight as a plain tensor attribute instead of an `nn.Parameter`;
    `custom_op`: all-reduce through `tp_example::all_reduce`."""
    cfg = full.cfg
    tp = TPDecoder(cfg, world, group, custom_op)
    d, f = cfg.head_dim, cfg.ffn_size // world
    h, kv = cfg.num_heads // world, cfg.num_kv_heads // world
    q_full, kv_full = cfg.num_heads * d, cfg.num_kv_heads * d

    def rows(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
        return w[start + rank * n : start + (rank + 1) * n]

    with torch.no_grad():
        tp.embed.weight.copy_(full.embed.weight)
        tp.norm.weight.copy_(full.norm.weight)
        tp.lm_head.weight.copy_(full.lm_head.weight)
        for mine, layer in zip(tp.layers, full.layers):
            attn = layer.attn
            mine.attn_norm.weight.copy_(layer.attn_norm.weight)
            mine.mlp_norm.weight.copy_(layer.mlp_norm.weight)
            w = attn.qkv.weight
            mine.qkv.weight.copy_(torch.cat([rows(w, 0, h * d), rows(w, q_full, kv * d), rows(w, q_full + kv_full, kv * d)]))
            mine.o.weight.copy_(attn.o.weight[:, rank * h * d : (rank + 1) * h * d])
            w = layer.gate_up.weight
            mine.gate_up.weight.copy_(torch.cat([rows(w, 0, f), rows(w, cfg.ffn_size, f)]))
            mine.down.weight.copy_(layer.down.weight[:, rank * f : (rank + 1) * f])
            mine.key_cache.copy_(attn.key_cache[:, :, rank * kv : (rank + 1) * kv])
            mine.value_cache.copy_(attn.value_cache[:, :, rank * kv : (rank + 1) * kv])
    if plain_tensors:
        for module in tp.modules():
            for name, param in list(module._parameters.items()):
                del module._parameters[name]
                setattr(module, name, None if param is None else param.detach())
    return tp.eval()


@dataclasses.dataclass(frozen=True)
class Case:
    """One compiled run of the schedule on every rank."""

    name: str
    runtime: str = "sim"
    dynamic: bool = False  # False: torch.compile's default (dynamic=None)
    new_group: bool = False  # all_reduce over dist.new_group(all ranks) instead of the world group
    plain_tensors: bool = False
    tp_size: int | None = None  # ranks per TP group (consecutive ranks; new groups); None: the world
    steps: int | None = None  # run only the first `steps` steps of the schedule
    custom_op: bool = False  # all-reduce through a custom op calling dist.all_reduce (vLLM's shape)
    #: graphs (the runner's names) whose capture the simulated device refuses on rank 0 only (an error at
    #: `capture_begin`, `runtime/sim/faults.py`): every rank must serve their steps the same way
    capture_faults: tuple[str, ...] = ()
    streams_out: bool = False  # those refusals are 207008, out of streams: every rank then stops capturing


def tp_group(case: Case, rank: int, world: int) -> tuple[Any, int, int]:
    """This rank's TP group, its rank in it and the group's size. Every rank creates every group,
    in the same order, as `dist.new_group` requires."""
    size = case.tp_size or world
    if size == world and not case.new_group:
        return dist.group.WORLD, rank, world
    assert world % size == 0, f"tp_size {size} does not divide the world size {world}"
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
    return groups[rank // size], rank % size, size


def run_case(case: Case, rank: int, world: int, cfg: LlamaConfig) -> dict[str, Any]:
    """Run `case` on this rank: per-step max error against the unsplit model, outputs, artifact stats."""
    torch._dynamo.reset()
    group, tp_rank, tp_size = tp_group(case, rank, world)
    full = build(cfg, seed=0)
    model = shard(full, tp_rank, tp_size, group, case.plain_tensors, case.custom_op)
    artifacts: list[Any] = []
    config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=CAPTURE_SIZES, runtime=case.runtime)
    target = {}
    if case.capture_faults:
        sim = SimRuntime()
        for label in case.capture_faults if rank == 0 else ():
            sim.faults.inject(label, phase="begin", error=streams_exhausted if case.streams_out else None)
        target = {"target": lambda device, config: Target(sim)}
    backend = ascend_compile.backend(config, on_compiled=artifacts.append, **target)
    fn = torch.compile(model, backend=backend, dynamic=True if case.dynamic else None)
    batch = PagedBatch(cfg, seed=7)  # the same inputs on every rank: same seed, same steps
    errors, outputs, steps = [], [], []
    with torch.no_grad():
        for context_lens, query_lens in schedule()[: case.steps]:
            inputs = batch.step(context_lens, query_lens)
            out = fn(**inputs)
            errors.append((out - full(**inputs)).abs().max().item())
            outputs.append(out.clone())
            steps.append(f"{len(context_lens)}x{query_lens[0] if len(set(query_lens)) == 1 else 'mixed'}={sum(query_lens)}")
    stats = sum((collections.Counter(a.stats) for a in artifacts), collections.Counter())
    failed = {name: why for a in artifacts for name, why in a.failures.graphs.items()}
    return {"errors": errors, "outputs": outputs, "steps": steps, "stats": dict(stats), "artifacts": len(artifacts),
            "failed_captures": failed}


def _worker(rank: int, world: int, store_path: str, out_dir: str, cases: Sequence[Case]) -> None:
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    cfg = LlamaConfig(num_layers=2, num_blocks=256)
    results: dict[str, Any] = {}
    try:
        for case in cases:
            start = time.perf_counter()
            try:
                results[case.name] = run_case(case, rank, world, cfg)
            except Exception:
                results[case.name] = {"failure": traceback.format_exc()}
            results[case.name]["seconds"] = time.perf_counter() - start
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_ranks(cases: Sequence[Case], world: int = 2, timeout: float = 120.0, workdir: str | None = None) -> list[dict]:
    """Run `cases` in order on `world` spawned ranks; each rank's results (`run_case`'s dicts, or
    {"failure": traceback}) by case name. Raises TimeoutError (after killing the ranks) when they
    have not all finished within `timeout` seconds, RuntimeError when a rank died."""
    # forkserver, its server importing this module (torch, dynamo, the package) once: each rank is a
    # fork of that single-threaded process, not a fresh interpreter paying those imports (seconds
    # each); later calls reuse the server.
    multiprocessing.set_forkserver_preload([__spec__.name if __spec__ else __name__])
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        store_path = os.path.join(tmp, "store")
        ctx = mp.start_processes(
            _worker, args=(world, store_path, tmp, tuple(cases)), nprocs=world, join=False, start_method="forkserver"
        )
        return join_ranks(ctx, world, tmp, timeout)


def join_ranks(ctx: Any, world: int, out_dir: str, timeout: float) -> list[Any]:
    """Wait for the ranks `ctx` started (`mp.start_processes(join=False)`), then load what each saved as
    `out_dir/rank<r>.pt`. Raises TimeoutError, after killing the ranks, past `timeout` seconds; join()
    raises ProcessRaisedException / ProcessExitedException when a rank failed."""
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks still running after {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", default="sim", choices=("sim", "eager"))
    parser.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True)")
    parser.add_argument("--new-group", action="store_true", help="all_reduce over dist.new_group, not WORLD")
    parser.add_argument("--plain-tensors", action="store_true", help="weights as plain tensors, not Parameters")
    parser.add_argument("--custom-op", action="store_true", help="all-reduce through a custom op (vLLM's shape)")
    parser.add_argument("--world", type=int, default=2, help="number of ranks")
    parser.add_argument("--tp", type=int, default=None, help="ranks per TP group (default: the world)")
    opts = parser.parse_args(argv)
    case = Case("example", opts.runtime, opts.dynamic, opts.new_group, opts.plain_tensors, opts.tp,
                custom_op=opts.custom_op)
    print(f"{opts.world} ranks, {case}")
    ok = True
    for rank, results in enumerate(spawn_ranks([case], world=opts.world)):
        res = results[case.name]
        if "failure" in res:
            print(f"rank {rank} failed:\n{res['failure']}")
            ok = False
            continue
        bad = [i for i, e in enumerate(res["errors"]) if not e <= ATOL]
        ok &= not bad
        print(f"rank {rank}: {res['seconds']:.1f} s, {res['artifacts']} artifact(s), stats {res['stats']}")
        for i, (step, err) in enumerate(zip(res["steps"], res["errors"])):
            print(f"  step {i:2d} {step:>12} tokens  max |compiled - unsplit| = {err:.2e}{'  MISMATCH' if i in bad else ''}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
