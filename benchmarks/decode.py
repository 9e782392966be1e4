"""Decode-step benchmark: a Llama-style model over a paged KV cache, compiled every way there is.

Two variants of the same weights: **plain** (attention in plain PyTorch: gather the sequence's
blocks, SDPA with a float padding mask, the query heads sharing a KV head folded into SDPA's query
length so no K/V is expanded; what a careful user without this project writes; decode only) and
**op** (attention through `ascend.attention`). On CUDA the plain variant runs with SDPA restricted
to one fused backend (efficient attention, else cuDNN), checked to run before anything is timed,
so the peer is not the math fallback; the backend is in the results' `info`.

In one process, on identical inputs, for each batch: the median time of one decode step (CUDA
events around each step) in eager, `torch.compile` (default) and `torch.compile(mode=
"reduce-overhead")` on both variants (compiled with `dynamic=True`, as a server compiles one graph
for every batch), and `ascend_graph` with the eager and the inductor inner compiler on the op
variant; the ratio of each to an HBM roofline (weights read once plus the KV actually attended)
at the bandwidth of a device-to-device copy measured in the same run (`x roof`; the nominal HBM
bandwidth beside it, `x nom`, where the device is known); the largest absolute difference to eager
of the same variant; and the first call's time (compile + capture). Modes run in order of
importance (the target comparisons first); each row is printed and the JSON rewritten as soon as
it is measured, and `--budget-s` skips the modes left once a time budget is spent, so a cut run
still returns every finished row. The kernels' own bandwidth is `benchmarks/gpu_kernels.py`.

    python benchmarks/decode.py --preset tiny             # CPU, about a minute
    python benchmarks/decode.py --preset h200 --json out.json --budget-s 150   # phase 3 of run_gpu.sh
    python benchmarks/decode.py --preset small --json out.json    # 8 layers, 5 batches: ~10 min

Modes a device cannot run (CUDA graphs on the CPU) are skipped with the reason printed.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ascend_compile  # noqa: E402
from bench_util import Results, copy_bandwidth, nominal_gbps, synchronize, time_median  # noqa: E402
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
    # The decode table of `benchmarks/run_gpu.sh` (phase 3, about 4 minutes on an H200): "small" with
    # 4 layers (every layer is the same, so the ratios hardly move, and compiles take half as long)
    # and 3 batches (the targets need batch 32 and up; batch 1 is the latency case).
    "h200": Preset(
        LlamaConfig(vocab_size=32000, hidden_size=2048, num_layers=4, num_heads=16, num_kv_heads=8, head_dim=128,
                    ffn_size=5632, block_size=128, num_blocks=128 * 8 + 8, dtype=torch.bfloat16),
        context=1024, batches=(1, 32, 128), device="cuda", iters=20,
    ),
}

#: Every (variant, mode), in the order they run: the eager references, then what the targets
#: compare (ours, the plain variant's best torch.compile, reduce-overhead on the op variant), then
#: the rest, so a time budget cuts the least important.
MODES = (
    ("plain", "eager"), ("op", "eager"),
    ("op", "ascend_graph+inductor"), ("plain", "reduce-overhead"), ("op", "reduce-overhead"),
    ("plain", "compile"), ("op", "ascend_graph"), ("op", "compile"),
)


class PlainAttention(Attention):
    """Decode attention in plain PyTorch: index the cache with the block table, SDPA.

    The `G` query heads sharing a KV head become `G` query positions of that head (`[B, KVH, G,
    D]`), so no K/V is expanded for GQA; the padding mask is additive (float), which the fused
    efficient-attention backend takes (a boolean mask or `enable_gqa` can send SDPA to the math
    fallback)."""

    def attend(self, q, k, v, block_table, seq_lens, query_start_loc, slot_mapping):
        cfg = self.cfg
        self.key_cache.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(0, slot_mapping, k)
        self.value_cache.view(-1, cfg.num_kv_heads, cfg.head_dim).index_copy_(0, slot_mapping, v)
        batch, group = block_table.shape[0], cfg.num_heads // cfg.num_kv_heads
        keys = self.key_cache[block_table].flatten(1, 2).transpose(1, 2)  # [B, KVH, L, D]
        values = self.value_cache[block_table].flatten(1, 2).transpose(1, 2)
        hidden = torch.arange(keys.shape[2], device=q.device) >= seq_lens.unsqueeze(1)  # [B, L]
        mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))
        out = F.scaled_dot_product_attention(
            q.view(batch, cfg.num_kv_heads, group, cfg.head_dim), keys, values,
            attn_mask=mask[:, None, None, :], scale=cfg.head_dim**-0.5,
        )
        return out.reshape(batch, cfg.num_heads, cfg.head_dim)


#: SDPA backends the plain variant may run on CUDA, best first; the first that runs its step is used.
SDPA_BACKENDS = ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def sdpa_backend(model: torch.nn.Module, step: dict[str, torch.Tensor], device: torch.device) -> tuple[str, Any]:
    """(name, context manager) of the SDPA backend the plain variant runs with: on CUDA the first
    of `SDPA_BACKENDS` that runs `step` alone (SDPA raises when a restricted backend cannot), else
    the math fallback, named so; elsewhere torch's own choice."""
    if device.type != "cuda":
        return "default (not CUDA)", contextlib.nullcontext
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return "default (no torch.nn.attention)", contextlib.nullcontext
    for name in SDPA_BACKENDS:
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with sdpa_kernel([backend]), torch.no_grad():
                model(**step)
            synchronize(device)
        except RuntimeError as err:
            print(f"plain variant: SDPA backend {name} does not run this step ({str(err)[:200]})")
            continue
        return name, functools.partial(sdpa_kernel, [backend])
    return "MATH (no fused backend ran: a weak peer)", functools.partial(sdpa_kernel, [SDPBackend.MATH])


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


def run_mode(model, mode, preset, steps, expected, bandwidth, nominal, device):
    """Time `mode` at every batch, yielding one result row per batch as soon as it is measured.
    Rows of `ascend_graph` modes also split a step's time into the runner's phases; rows of
    CUDA-graph modes note graphs inductor declined to capture."""
    artifacts: list = []
    fn = compiled(model, mode, preset, artifacts)
    counters = torch._dynamo.utils.counters["inductor"]
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
            seconds = time_median(functools.partial(fn, **inputs), device, preset.iters)
            calls = preset.iters + 2  # time_median's warm-up calls included
            phases = sum((a.seconds for a in artifacts), start=collections.Counter()) - before
            nbytes = weight_bytes(model, batch) + kv_bytes(preset.model, [preset.context] * batch)
            roofline = nbytes / bandwidth
            row = {
                "batch": batch, "median_ms": seconds * 1e3, "roofline_ms": roofline * 1e3,
                "x_roofline": seconds / roofline, "max_abs_diff": diff, "first_call_s": first,
            }
            if nominal:
                row["x_nominal"] = seconds / (nbytes / nominal)
            if phases:
                row["runner_ms"] = {k: v * 1e3 / calls for k, v in sorted(phases.items())}
            if counters["cudagraph_skips"] > skips:
                row["note"] = "inductor skipped CUDA graphs (see its warning)"
            yield row


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's decode-table targets, checked against this run's figures (the kernel target is
    `benchmarks/gpu_kernels.py`'s; `benchmarks/verdicts.py` puts them together)."""
    by = {(r["variant"], r["mode"], r["batch"]): r for r in rows if "median_ms" in r}
    lines = []
    for batch in sorted({r["batch"] for r in rows if "batch" in r}):
        ours = by.get(("op", "ascend_graph+inductor", batch))
        if ours is None:
            continue
        plain = {k[1]: by[k]["median_ms"] for k in by if k[0] == "plain" and k[1] != "eager" and k[2] == batch}
        ro = by.get(("op", "reduce-overhead", batch))
        if batch >= 32 and plain:
            best = min(plain, key=plain.get)
            speedup = plain[best] / ours["median_ms"]
            lines.append(f"batch {batch}: ascend_graph+inductor {speedup:.2f}x faster than the best torch.compile "
                         f"on plain ({best}; measured: {', '.join(sorted(plain))}) (target >= 2): "
                         f"{'PASS' if speedup >= 2 else 'FAIL'}; {ours['x_roofline']:.2f}x roofline (target <= 1.5): "
                         f"{'PASS' if ours['x_roofline'] <= 1.5 else 'FAIL'}")
        if ro is not None:
            ratio = ours["median_ms"] / ro["median_ms"]
            lines.append(f"batch {batch}: ascend_graph+inductor / reduce-overhead on op = {ratio:.2f} "
                         f"(target <= 1): {'PASS' if ratio <= 1 else 'FAIL'}")
    return lines


def print_row(r: dict[str, Any]) -> None:
    if "median_ms" not in r:
        print(f"{r['variant']:7} {r['mode']:22} {'':>5} {r.get('skipped') or 'ERROR ' + r.get('error', '')}",
              flush=True)
        return
    extra = " ".join(f"{k}={v:.3f}" for k, v in r.get("runner_ms", {}).items())
    nominal = f"{r['x_nominal']:6.2f}" if "x_nominal" in r else f"{'-':>6}"
    print(f"{r['variant']:7} {r['mode']:22} {r['batch']:5d} {r['median_ms']:10.3f} {r['roofline_ms']:11.3f} "
          f"{r['x_roofline']:7.2f} {nominal} {r['max_abs_diff']:10.2e} {r['first_call_s']:8.2f}"
          + (f"  runner ms/step: {extra}" if extra else "") + (f"  ({r['note']})" if "note" in r else ""),
          flush=True)


HEADER = (f"{'variant':7} {'mode':22} {'batch':>5} {'median ms':>10} {'roofline ms':>11} {'x roof':>7} {'x nom':>6} "
          f"{'max|diff|':>10} {'first s':>8}")


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
                        help="bandwidth of the roofline in GB/s (default: a device-to-device copy measured now)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of torch (default: 1 on the CPU, where timings of small models with "
                             "several threads are dominated by thread spinning; unchanged with CUDA)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no mode after this many seconds (the rest are recorded as skipped)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file (after every row)")
    args = parser.parse_args(argv)
    began = time.perf_counter()

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
    copy = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    bandwidth = args.hbm_gbps * 1e9 if args.hbm_gbps else copy
    nominal = (nominal_gbps(device) or 0) * 1e9 or None
    steps = decode_steps(cfg, preset, device)
    info = {
        "preset": args.preset, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "context": preset.context, "batches": list(preset.batches),
        "layers": cfg.num_layers, "dtype": str(cfg.dtype), "copy_gbps": copy / 1e9,
        "roofline_gbps": bandwidth / 1e9, "nominal_gbps": nominal / 1e9 if nominal else None,
        "iters": preset.iters, "threads": torch.get_num_threads(), "timing": "CUDA events" if
        device.type == "cuda" else "wall clock",
    }
    models = {variant: build_variant(preset, variant) for variant in ("plain", "op") if any(v == variant for v, _ in modes)}
    expected: dict[str, dict[int, torch.Tensor]] = {}
    contexts: dict[str, Any] = {}
    with torch.no_grad():
        for variant, model in models.items():
            contexts[variant] = contextlib.nullcontext
            if variant == "plain":
                info["sdpa_backend"], contexts[variant] = sdpa_backend(model, steps[preset.batches[0]], device)
            with contexts[variant]():
                expected[variant] = {b: model(**steps[b]).clone() for b in preset.batches}
    if "plain" in expected and "op" in expected:
        info["plain_vs_op_max_abs_diff"] = max(
            (expected["plain"][b].float() - expected["op"][b].float()).abs().max().item() for b in preset.batches
        )
    results = Results(args.json, info)
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    print(HEADER, flush=True)

    for variant, mode in modes:
        reason = skip_reason(variant, mode, device)
        if reason is None and args.budget_s is not None and time.perf_counter() - began > args.budget_s:
            reason = f"time budget of {args.budget_s:.0f} s spent"
        if reason is not None:
            print_row(results.add({"variant": variant, "mode": mode, "skipped": reason}))
            continue
        try:
            with contexts[variant]():
                for row in run_mode(models[variant], mode, preset, steps, expected[variant], bandwidth, nominal,
                                    device):
                    print_row(results.add({"variant": variant, "mode": mode, **row}))
        except Exception as err:  # one failing mode must not cost the others
            print_row(results.add({"variant": variant, "mode": mode, "error": f"{type(err).__name__}: {err}"[:800]}))
        results.set("targets", targets(results.rows))
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if "plain_vs_op_max_abs_diff" in info:
        print(f"plain vs op (eager) max|diff|: {info['plain_vs_op_max_abs_diff']:.2e}")
    checks = targets(results.rows)
    if checks:
        print("\ntargets")
        for line in checks:
            print(f"  {line}")
    results.set("elapsed_s", time.perf_counter() - began)
    if args.json:
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
