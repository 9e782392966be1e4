"""Decode-step benchmark: a Llama-style model over a paged KV cache, compiled every way there is.

Two variants of the same weights: **plain** (attention in plain PyTorch: gather the sequence's
blocks, masked SDPA, what a user without this project writes; decode only) and **op** (attention
through `ascend.attention`). In one process, on identical inputs, for each batch: the median time
of one decode step in eager, `torch.compile` (default) and `torch.compile(mode="reduce-overhead")`
on both variants (compiled with `dynamic=True`, as a server compiles one graph for every batch),
and `ascend_graph` with the eager and the inductor inner compiler on the op variant; the ratio of
each to an HBM roofline (weights read once plus the KV actually attended, at `--hbm-gbps`); the
largest absolute difference to eager of the same variant; and the first call's time (compile +
capture). With CUDA, also a kernel benchmark: the PA and FIA kernels' achieved bandwidth at batch
64 x context 4096 against a device-to-device copy in the same run, for several split counts.

    python benchmarks/decode.py --preset tiny             # CPU, under a minute
    python benchmarks/decode.py --preset small --json out.json    # a GPU (H200-sized)

Modes a device cannot run (CUDA graphs on the CPU) are skipped with the reason printed.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ascend_compile  # noqa: E402
from ascend_compile.ops import cuda as cuda_ops  # noqa: E402
from ascend_compile.ops import tiling  # noqa: E402
from examples.llama import Attention, LlamaConfig, PagedBatch, build  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model, its cache, the step shape and the batches of one benchmark run."""

    model: LlamaConfig
    context: int
    batches: tuple[int, ...]
    device: str
    iters: int


PRESETS = {
    "tiny": Preset(
        LlamaConfig(num_blocks=8 * 4 + 8), context=60, batches=(2, 8), device="cpu", iters=5,
    ),
    "small": Preset(
        LlamaConfig(vocab_size=32000, hidden_size=2048, num_layers=8, num_heads=16, num_kv_heads=8, head_dim=128,
                    ffn_size=5632, block_size=128, num_blocks=256 * 8 + 8, dtype=torch.bfloat16),
        context=1024, batches=(1, 8, 32, 128, 256), device="cuda", iters=20,
    ),
}

MODES = (
    ("plain", "eager"), ("plain", "compile"), ("plain", "reduce-overhead"),
    ("op", "eager"), ("op", "compile"), ("op", "reduce-overhead"),
    ("op", "ascend_graph"), ("op", "ascend_graph+inductor"),
)


class PlainAttention(Attention):
    """Decode attention in plain PyTorch: index the cache with the block table, mask, SDPA."""

    def attend(self, q, k, v, block_table, seq_lens, query_start_loc, slot_mapping):
        cfg = self.cfg
        self.key_cache.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(0, slot_mapping, k)
        self.value_cache.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(0, slot_mapping, v)
        batch = block_table.shape[0]
        keys = self.key_cache[block_table].flatten(1, 2).transpose(1, 2)  # [B, KVH, L, D]
        values = self.value_cache[block_table].flatten(1, 2).transpose(1, 2)
        visible = torch.arange(keys.shape[2], device=q.device) < seq_lens.unsqueeze(1)  # [B, L]
        out = F.scaled_dot_product_attention(
            q.view(batch, cfg.num_heads, 1, cfg.head_dim), keys, values,
            attn_mask=visible[:, None, None, :], scale=cfg.head_dim**-0.5, enable_gqa=True,
        )
        return out.view(batch, cfg.num_heads, cfg.head_dim)


def build_variant(preset: Preset, variant: str) -> torch.nn.Module:
    """The model of `preset` on its device (same seed: same weights for both variants)."""
    with torch.device(preset.device):
        model = build(preset.model, seed=0)
    if variant == "plain":
        for layer in model.layers:
            layer.attn.__class__ = PlainAttention
    return model


def weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Bytes of weights one step reads: every parameter once, but only `batch` embedding rows."""
    total = 0
    for name, p in model.named_parameters():
        rows = min(batch, p.shape[0]) if name.startswith("embed") else p.shape[0]
        total += rows * p[0].numel() * p.element_size()
    return total


def kv_bytes(cfg: LlamaConfig, seq_lens: list[int]) -> int:
    """Bytes of K and V the attention of one step reads, over every layer."""
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    return sum(seq_lens) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy of `nbytes` (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_loop(functools.partial(dst.copy_, src), device, iters=20)
    return 2 * nbytes / seconds


def time_loop(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Seconds per call of `fn` over `iters` calls back to back (one synchronisation at each end):
    a kernel's throughput, without the host's per-call synchronisation."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def time_call(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median seconds of `fn` (synchronised), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_steps(cfg: LlamaConfig, preset: Preset, device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
    """One decode step per batch, each the first sequences of the largest: a step writes the same
    keys and values to the same slots as any other, so every step leaves the caches as it found them
    after the first, and every mode sees identical inputs and caches."""
    full = PagedBatch(cfg, seed=0).step([preset.context] * max(preset.batches))
    steps = {}
    for b in preset.batches:
        step = {k: v[:b] for k, v in full.items() if k != "query_start_loc"}
        step["query_start_loc"] = full["query_start_loc"][: b + 1]
        steps[b] = {k: v.to(device) for k, v in step.items()}
    return steps


def skip_reason(variant: str, mode: str, device: torch.device) -> str | None:
    """Why `variant` in `mode` cannot run on `device`, or None."""
    if device.type != "cuda" and mode in ("reduce-overhead", "ascend_graph+inductor"):
        return "needs CUDA graphs (a CUDA device)"
    if device.type == "cuda" and variant == "op":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "needs triton for the CUDA kernels of the ascend ops"
    return None


def compiled(model: torch.nn.Module, mode: str, preset: Preset, artifacts: list) -> Callable[..., Any]:
    """`model` as `mode` runs it; `ascend_graph` modes append their compiled artifacts to `artifacts`."""
    torch._dynamo.reset()
    if mode == "eager":
        return model
    if mode == "compile":
        return torch.compile(model, dynamic=True)
    if mode == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead", dynamic=True)
    inner = "inductor" if mode == "ascend_graph+inductor" else "eager"
    backend = ascend_compile.backend(
        on_compiled=artifacts.append, max_model_len=preset.context, capture_sizes=preset.batches,
        inner_compiler=inner,
    )
    return torch.compile(model, backend=backend, dynamic=True)


def run_mode(model, mode, preset, steps, expected, bandwidth, device) -> list[dict[str, Any]]:
    """Time `mode` at every batch; one result row per batch. Rows of `ascend_graph` modes also
    split a step's time into the runner's phases; rows of CUDA-graph modes note graphs inductor
    declined to capture."""
    artifacts: list = []
    fn = compiled(model, mode, preset, artifacts)
    counters = torch._dynamo.utils.counters["inductor"]
    rows = []
    with torch.no_grad():
        for batch in preset.batches:
            inputs = steps[batch]
            skips = counters["cudagraph_skips"]
            start = time.perf_counter()
            out = fn(**inputs)
            synchronize(device)
            first = time.perf_counter() - start
            diff = (out.float() - expected[batch].float()).abs().max().item()
            before = sum((a.seconds for a in artifacts), start=collections.Counter())
            seconds = time_call(functools.partial(fn, **inputs), device, preset.iters)
            calls = preset.iters + 2  # time_call's warm-up calls included
            phases = sum((a.seconds for a in artifacts), start=collections.Counter()) - before
            roofline = (weight_bytes(model, batch) + kv_bytes(preset.model, [preset.context] * batch)) / bandwidth
            row = {
                "batch": batch, "median_ms": seconds * 1e3, "roofline_ms": roofline * 1e3,
                "x_roofline": seconds / roofline, "max_abs_diff": diff, "first_call_s": first,
            }
            if phases:
                row["runner_ms"] = {k: v * 1e3 / calls for k, v in sorted(phases.items())}
            if counters["cudagraph_skips"] > skips:
                row["note"] = "inductor skipped CUDA graphs (see its warning)"
            rows.append(row)
    return rows


def kernel_benchmark(preset: Preset, device: torch.device, batch: int = 64, context: int = 4096) -> dict[str, Any]:
    """PA and FIA (device-length Triton kernels) bandwidth at `batch` x `context`, vs a copy."""
    cfg = preset.model
    shape = tiling.AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size)
    blocks = -(-context // cfg.block_size)
    gen = torch.Generator(device=device).manual_seed(0)
    cache_shape = (batch * blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen, device=device).to(cfg.dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device).to(cfg.dtype)
    perm = torch.randperm(batch * blocks, generator=gen, device=device)
    block_table = perm.view(batch, blocks).to(torch.int32)
    query = torch.randn(batch, cfg.num_heads, cfg.head_dim, generator=gen, device=device).to(cfg.dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    nbytes = kv_bytes(dataclasses.replace(cfg, num_layers=1), [context] * batch) + 2 * query.numel() * query.element_size()
    copy = copy_bandwidth(device, nbytes // 2)
    chosen = cuda_ops.choose_num_splits(batch * cfg.num_kv_heads, context, cfg.block_size,
                                        cuda_ops.device_sm_count(device))
    result: dict[str, Any] = {"batch": batch, "context": context, "bytes": nbytes, "copy_gbps": copy / 1e9,
                              "chosen_splits": chosen, "kernels": []}
    scale = cfg.head_dim**-0.5
    for splits in sorted({chosen, 1, 2, 4, 8}):
        ws = torch.empty(cuda_ops.dev_workspace_nbytes(batch, shape, splits), dtype=torch.uint8, device=device)
        calls = {
            "PA": functools.partial(torch.ops.ascend.paged_attention_dev,
                                    query, key_cache, value_cache, block_table, seq_lens, scale, ws, out, splits),
            "FIA": functools.partial(torch.ops.ascend.fused_infer_attention_dev,
                                     query, key_cache, value_cache, block_table, start_loc, seq_lens, scale, ws, out,
                                     splits),
        }
        for name, call in calls.items():
            seconds = time_loop(call, device, iters=20)
            gbps = nbytes / seconds / 1e9
            result["kernels"].append({"kernel": name, "splits": splits, "ms": seconds * 1e3, "gbps": gbps,
                                      "of_copy": gbps / result["copy_gbps"]})
    return result


def targets(rows: list[dict[str, Any]], kernels: dict[str, Any] | None) -> list[str]:
    """The issue's targets, checked against this run's figures."""
    by = {(r["variant"], r["mode"], r["batch"]): r for r in rows if "median_ms" in r}
    lines = []
    for batch in sorted({r["batch"] for r in rows if "batch" in r}):
        ours = by.get(("op", "ascend_graph+inductor", batch))
        if ours is None:
            continue
        plain = [by[k]["median_ms"] for k in by if k[0] == "plain" and k[1] != "eager" and k[2] == batch]
        ro = by.get(("op", "reduce-overhead", batch))
        if batch >= 32 and plain:
            speedup = min(plain) / ours["median_ms"]
            lines.append(f"batch {batch}: ascend_graph+inductor {speedup:.2f}x faster than the best torch.compile "
                         f"on plain (target >= 2): {'PASS' if speedup >= 2 else 'FAIL'}; "
                         f"{ours['x_roofline']:.2f}x roofline (target <= 1.5): "
                         f"{'PASS' if ours['x_roofline'] <= 1.5 else 'FAIL'}")
        if ro is not None:
            ratio = ours["median_ms"] / ro["median_ms"]
            lines.append(f"batch {batch}: ascend_graph+inductor / reduce-overhead on op = {ratio:.2f} "
                         f"(target <= 1): {'PASS' if ratio <= 1 else 'FAIL'}")
    if kernels:
        pa = [k for k in kernels["kernels"] if k["kernel"] == "PA" and k["splits"] == kernels["chosen_splits"]][0]
        lines.append(f"PA kernel at batch {kernels['batch']} x {kernels['context']}: {pa['of_copy']:.0%} of copy "
                     f"bandwidth (target >= 70%): {'PASS' if pa['of_copy'] >= 0.7 else 'FAIL'}")
    return lines


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'variant':7} {'mode':22} {'batch':>5} {'median ms':>10} {'roofline ms':>11} {'x roof':>7} " \
             f"{'max|diff|':>10} {'first s':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        if "median_ms" not in r:
            print(f"{r['variant']:7} {r['mode']:22} {'':>5} skipped: {r['skipped']}")
            continue
        extra = " ".join(f"{k}={v:.3f}" for k, v in r.get("runner_ms", {}).items())
        print(f"{r['variant']:7} {r['mode']:22} {r['batch']:5d} {r['median_ms']:10.3f} {r['roofline_ms']:11.3f} "
              f"{r['x_roofline']:7.2f} {r['max_abs_diff']:10.2e} {r['first_call_s']:8.2f}"
              + (f"  runner ms/step: {extra}" if extra else "") + (f"  ({r['note']})" if "note" in r else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--batches", type=lambda s: tuple(int(b) for b in s.split(",")), default=None,
                        help="comma-separated batch sizes (default: the preset's)")
    parser.add_argument("--modes", default=None,
                        help="comma-separated variant/mode pairs, e.g. op/eager,op/ascend_graph (default: all)")
    parser.add_argument("--iters", type=int, default=None, help="timed steps per measurement (default: the preset's)")
    parser.add_argument("--device", default=None, help="torch device (default: the preset's)")
    parser.add_argument("--hbm-gbps", type=float, default=None,
                        help="bandwidth of the roofline in GB/s (default: 4800, the H200's, on CUDA; a measured "
                             "copy elsewhere)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of torch (default: 1 on the CPU, where timings of small models with "
                             "several threads are dominated by thread spinning; unchanged with CUDA)")
    parser.add_argument("--no-kernel-bench", action="store_true", help="skip the PA/FIA kernel benchmark")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    preset = PRESETS[args.preset]
    preset = dataclasses.replace(
        preset, batches=args.batches or preset.batches, iters=args.iters or preset.iters,
        device=args.device or preset.device,
    )
    device = torch.device(preset.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"preset {args.preset}: needs CUDA, which this machine does not have", file=sys.stderr)
        return 2
    modes = MODES if args.modes is None else tuple(tuple(m.split("/")) for m in args.modes.split(","))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; known: {['/'.join(m) for m in MODES]}")
    cfg = preset.model
    need_blocks = max(preset.batches) * -(-preset.context // cfg.block_size)
    if need_blocks > cfg.num_blocks:
        parser.error(f"--batches: {max(preset.batches)} sequences of {preset.context} need {need_blocks} blocks, "
                     f"the preset's cache has {cfg.num_blocks}")

    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    bandwidth = (args.hbm_gbps * 1e9 if args.hbm_gbps else
                 4800e9 if device.type == "cuda" else copy_bandwidth(device, 64 << 20))
    steps = decode_steps(cfg, preset, device)
    info = {
        "preset": args.preset, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "context": preset.context, "batches": list(preset.batches),
        "dtype": str(cfg.dtype), "roofline_gbps": bandwidth / 1e9, "iters": preset.iters,
        "threads": torch.get_num_threads(),
    }
    print(" ".join(f"{k}={v}" for k, v in info.items()))

    rows: list[dict[str, Any]] = []
    expected: dict[str, dict[int, torch.Tensor]] = {}
    for variant in ("plain", "op"):
        runnable = []
        for mode in [m for v, m in modes if v == variant]:
            reason = skip_reason(variant, mode, device)
            if reason is None:
                runnable.append(mode)
            else:
                print(f"skipping {variant}/{mode}: {reason}")
                rows.append({"variant": variant, "mode": mode, "skipped": reason})
        if not runnable:
            continue
        model = build_variant(preset, variant)
        with torch.no_grad():
            expected[variant] = {b: model(**steps[b]).clone() for b in preset.batches}
        for mode in runnable:
            print(f"running {variant}/{mode} ...", flush=True)
            for row in run_mode(model, mode, preset, steps, expected[variant], bandwidth, device):
                rows.append({"variant": variant, "mode": mode, **row})
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "plain" in expected and "op" in expected:
        info["plain_vs_op_max_abs_diff"] = max(
            (expected["plain"][b].float() - expected["op"][b].float()).abs().max().item() for b in preset.batches
        )

    kernels = None
    reason = "--no-kernel-bench" if args.no_kernel_bench else skip_reason("op", "kernels", device)
    if device.type != "cuda":
        reason = reason or "the Triton kernels need a CUDA device"
    if reason is None:
        kernels = kernel_benchmark(preset, device)
    else:
        print(f"skipping the kernel benchmark: {reason}")

    print()
    print_table(rows)
    if "plain_vs_op_max_abs_diff" in info:
        print(f"plain vs op (eager) max|diff|: {info['plain_vs_op_max_abs_diff']:.2e}")
    if kernels:
        print(f"\nkernels at batch {kernels['batch']} x context {kernels['context']} ({kernels['bytes'] / 1e9:.2f} GB "
              f"read): copy {kernels['copy_gbps']:.0f} GB/s; chosen splits {kernels['chosen_splits']}")
        for k in kernels["kernels"]:
            print(f"  {k['kernel']:3} splits {k['splits']:2d}: {k['ms']:.3f} ms, {k['gbps']:.0f} GB/s, "
                  f"{k['of_copy']:.0%} of copy")
    checks = targets(rows, kernels)
    if checks:
        print("\ntargets")
        for line in checks:
            print(f"  {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows, "kernels": kernels, "targets": checks}, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
