"""Compile time: the first call of the example model under `ascend_graph` beside `backend="eager"`.

    python benchmarks/compile_time.py [--quick] [--layers 8 32 64] [--buckets 8 35 67] [--json]
    python benchmarks/compile_time.py --profile 32x67   # cProfile of ascend_graph's compile

For each depth and bucket count, in one process (`--repeat` times, alternating; the fastest run of each kept): the model is compiled with
`ascend_compile.compile` (one general trace: every step size symbolic) with `backend="eager"` (dynamo
alone) and with `ascend_graph` on the simulator, each on a fresh model; the first call (decode batch
6) is timed, then the model is stepped at decode batch 1 and 40, a one-sequence mixed step and a
mixed step of three sequences, and the backend calls are counted ("compiles": 1 is the goal). The
ratio is ascend_graph's first call over eager's. `backend_s` is the time spent inside the backend
(ascend_graph's passes; for eager, handing back the graph), so `first_call - backend_s` is dynamo's
trace plus the first step's execution (and, for ascend_graph, its first capture).

Times are wall-clock (`perf_counter`) and process CPU time (`process_time`); on a shared machine CPU
time is the steadier figure. Bucket counts: 8 = 1, 2, 4, ..., 128; 35 = the default (1, 2, 4, 8,
16, ..., 256); 67 = 1, 2, 4, 8, 16, ..., 512 (vLLM's longest default capture list).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ascend_compile  # noqa: E402
from ascend_compile import CompileConfig, backend  # noqa: E402
from examples.llama import LlamaConfig, PagedBatch, build  # noqa: E402

MAX_LEN = 512

#: name -> (context lengths, query lengths); the first is the timed first call.
STEPS = {
    "decode6": ([5, 80, 17, 250, 3, 64], None),
    "decode1": ([37], None),
    "decode40": ([(7 * i) % 200 + 2 for i in range(40)], None),
    "mixed1": ([45], [5]),
    "mixed": ([30, 9, 100], [3, 1, 4]),
}


def capture_sizes(count: int) -> tuple[int, ...]:
    """Up to 8 buckets: powers of two; more: 1, 2, 4, then steps of 8 (35: up to 256, 67: up to 512)."""
    if count <= 8:
        return tuple(2**i for i in range(count))
    return (1, 2, 4) + tuple(range(8, 8 * (count - 3) + 1, 8))


def model_config(layers: int) -> LlamaConfig:
    return LlamaConfig(num_layers=layers, num_blocks=1024)


def run(layers: int, buckets: int, kind: str) -> dict:
    """Compile a fresh model with `kind` ("eager" or "ascend_graph"), time the first call, step
    the other shapes, count backend calls."""
    cfg = model_config(layers)
    model = build(cfg)
    calls, backend_seconds = [], []
    if kind == "eager":
        def inner(gm, example_inputs):
            return gm.forward
    else:
        inner = backend(CompileConfig(max_model_len=MAX_LEN, capture_sizes=capture_sizes(buckets), runtime="sim"))

    def counting(gm, example_inputs):
        start = time.perf_counter()
        try:
            return inner(gm, example_inputs)
        finally:
            calls.append(gm)
            backend_seconds.append(time.perf_counter() - start)

    torch._dynamo.reset()
    compiled = ascend_compile.compile(model, backend=counting)
    batch = PagedBatch(cfg, seed=0, table_width=MAX_LEN // cfg.block_size)
    steps = [batch.step(*STEPS[name]) for name in STEPS]
    # the previous run's garbage is not collected inside this one's timing, and what earlier runs
    # left alive is frozen out of the collector's walks: every run sees the same heap
    gc.collect()
    gc.freeze()
    try:
        with torch.no_grad():
            wall, cpu = time.perf_counter(), time.process_time()
            compiled(**steps[0])
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            for inputs in steps[1:]:
                compiled(**inputs)
    finally:
        gc.unfreeze()
    return {"layers": layers, "buckets": buckets, "backend": kind, "first_call_s": round(wall, 3),
            "first_call_cpu_s": round(cpu, 3), "backend_s": round(backend_seconds[0], 3), "compiles": len(calls)}


def fastest(layers: int, buckets: int, repeat: int) -> tuple[dict, dict]:
    """`repeat` runs of each backend, alternating so that both see the same machine load; the run
    with the fastest first call of each (on a shared machine the minimum is the steadiest figure)."""
    runs: dict[str, list[dict]] = {"eager": [], "ascend_graph": []}
    for _ in range(repeat):
        for kind, found in runs.items():
            found.append(run(layers, buckets, kind))
    return tuple(min(found, key=lambda r: r["first_call_s"]) for found in runs.values())


def profile(layers: int, buckets: int, top: int) -> str:
    """cProfile of ascend_graph's compile (the backend call alone) of the general graph."""
    cfg = model_config(layers)
    config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=capture_sizes(buckets), runtime="sim")
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    compiled = ascend_compile.compile(build(cfg), backend=keep)
    batch = PagedBatch(cfg, seed=0, table_width=MAX_LEN // cfg.block_size)
    with torch.no_grad():
        compiled(**batch.step(*STEPS["decode6"]))
    gm, example_inputs = graphs[0]
    compile_fn = backend(config)
    profiler = cProfile.Profile()
    with ascend_compile.trace_settings():  # as during the real compile: the shape env reasons the same way
        start = time.perf_counter()
        profiler.enable()
        compile_fn(gm, example_inputs)
        profiler.disable()
        seconds = time.perf_counter() - start
    out = io.StringIO()
    out.write(f"ascend_graph compile of the {layers}-layer model, {buckets} buckets: {seconds:.2f} s "
              f"(under cProfile)\n")
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--buckets", type=int, nargs="+", default=[8, 35, 67])
    parser.add_argument("--quick", action="store_true", help="8 layers x 8 and 67 buckets")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", metavar="LAYERSxBUCKETS", help="cProfile ascend_graph's compile instead")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each backend per row, alternating; the fastest first call of each is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: CPU time is one thread's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        layers, buckets = (int(x) for x in args.profile.lower().split("x"))
        print(profile(layers, buckets, args.top))
        return
    layers, bucket_counts = ([8], [8, 67]) if args.quick else (args.layers, args.buckets)
    run(2, 8, "eager")  # warm-up: dynamo's and the backend's first-use costs stay out of the table
    run(2, 8, "ascend_graph")
    rows = []
    header = (f"{'layers':>6} {'buckets':>7} | {'eager s':>8} {'cpu s':>7} {'n':>2} | {'ascend s':>8} {'cpu s':>7} "
              f"{'backend s':>9} {'n':>2} | {'ratio':>5} {'cpu ratio':>9}")
    if not args.json:
        print(f"torch {torch.__version__}, first call = decode batch 6; n = backend compiles over 5 step shapes")
        print(header)
    for n_layers in layers:
        for buckets in bucket_counts:
            eager, ascend = fastest(n_layers, buckets, args.repeat)
            row = {"layers": n_layers, "buckets": buckets, "eager": eager, "ascend_graph": ascend,
                   "ratio": round(ascend["first_call_s"] / eager["first_call_s"], 2),
                   "cpu_ratio": round(ascend["first_call_cpu_s"] / eager["first_call_cpu_s"], 2)}
            rows.append(row)
            if not args.json:
                print(f"{n_layers:>6} {buckets:>7} | {eager['first_call_s']:>8.2f} {eager['first_call_cpu_s']:>7.2f} "
                      f"{eager['compiles']:>2} | {ascend['first_call_s']:>8.2f} {ascend['first_call_cpu_s']:>7.2f} "
                      f"{ascend['backend_s']:>9.2f} {ascend['compiles']:>2} | {row['ratio']:>5.2f} "
                      f"{row['cpu_ratio']:>9.2f}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
