"""The runner on the CPU simulator: compile and capture cost, per-step host overhead, workspace schemes.

    python benchmarks/cpu_runner.py [--layers 4 16 32] [--steps 20] [--json]
    python benchmarks/cpu_runner.py --runner-only [--layers 4 16 32]   # the runner's host us per step

For the example model at each depth, with the default 35 capture sizes (1, 2, 4, 8..256), all in one
process:
- compile time (dynamo + passes) and capture time per bucket;
- a decode step: its wall time, the graph's execution (the simulator runs it in `synchronize`), and
  the runner's host work (reading the step, copy-in and padding, launch and task updates, unpad and
  clone) from the runner's own phase timers, against an eager step of the same model on the same
  inputs;
- host conversions and workspace queries per step (counted);
- workspace bytes the shared slot reserves vs per-bucket and per-layer workspaces.
The simulator replays ops on the CPU, so replay time is the simulator's, not a device's.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ascend_compile  # noqa: E402
from ascend_compile.backend import backend, compile_graph  # noqa: E402
from ascend_compile.config import CompileConfig  # noqa: E402
from ascend_compile.lowering import served  # noqa: E402
from ascend_compile.ops import tiling  # noqa: E402
from examples.llama import LlamaConfig, PagedBatch, build  # noqa: E402

MAX_LEN = 2048


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_depth(layers: int, steps: int, batch_size: int) -> dict:
    cfg = LlamaConfig(num_layers=layers, num_blocks=4096, block_size=16)
    model = build(cfg)
    config = CompileConfig(max_model_len=MAX_LEN, capture_all=True)
    artifacts = []

    def backend_fn(gm, example_inputs):
        artifacts.append(compile_graph(gm, example_inputs, config))
        return artifacts[-1]

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend_fn)
    batch = PagedBatch(cfg, seed=0)
    rng = random.Random(0)

    def inputs(size):
        return batch.step([rng.randint(1, MAX_LEN) for _ in range(size)])

    with torch.no_grad():
        compiled(**inputs(batch_size - 1))  # dynamo's first, static-shape graph
        start = time.perf_counter()
        compiled(**inputs(batch_size - 2))  # the dynamic graph: passes for 35 buckets, capture of all
        first_call = time.perf_counter() - start
        art = artifacts[-1]
        captures = [g.capture_seconds for g in art.graphs.values() if g.graph is not None]
        step_inputs = [inputs(batch_size) for _ in range(steps)]
        before, before_s = dict(art.stats), dict(art.seconds)
        queries = []
        real_max_workspace = tiling.max_workspace

        def counting(*a, **k):
            queries.append(1)
            return real_max_workspace(*a, **k)

        tiling.max_workspace = counting
        try:
            it = iter(step_inputs)
            step_ms = median_ms(lambda: compiled(**next(it)), steps)
        finally:
            tiling.max_workspace = real_max_workspace
        phase_ms = {k: (art.seconds[k] - before_s.get(k, 0.0)) * 1e3 / steps for k in art.seconds}
        eager_it = iter(step_inputs)
        eager_ms = median_ms(lambda: model(**next(eager_it)), steps)
        done = {k: art.stats[k] - before.get(k, 0) for k in ("steps", "host_conversions", "updates", "replays")}
    plan = art.rewritten.plan
    n = max(done["steps"], 1)
    host_ms = sum(v for k, v in phase_ms.items() if k != "synchronize")
    runner_us = (phase_ms.get("host", 0.0) + phase_ms.get("copy_in", 0.0)) * 1e3
    return {
        "layers": layers,
        "buckets": len(art.rewritten.buckets),
        "graphs_captured": len(captures),
        "first_dynamic_call_s": round(first_call, 3),
        "capture_s_per_bucket": {"mean": round(statistics.mean(captures), 4), "max": round(max(captures), 4)},
        "batch": batch_size,
        "step_ms": round(step_ms, 3),
        "execute_ms": round(phase_ms["synchronize"], 3),
        "copy_in_ms": round(phase_ms["copy_in"], 3),
        "launch_and_updates_ms": round(phase_ms["launch_and_updates"], 3),
        "runner_host_ms": round(host_ms, 3),
        "runner_us": round(runner_us, 1),
        "eager_step_ms": round(eager_ms, 3),
        "host_vs_eager": round(host_ms / eager_ms, 3),
        "host_conversions_per_step": done["host_conversions"] / n,
        "task_updates_per_step": done["updates"] / n,
        "workspace_queries_per_step": len(queries) / n,
        "workspace_bytes": dict(plan.schemes),
    }


class _NoDeviceGraph:
    """Stands in for a captured graph whose replay is free: what is left of a step is the runner's."""

    def replay(self) -> None:
        pass


class _NoUpdates:
    def apply(self, table, runtime, host) -> int:
        return 0


def stub_device(art) -> None:
    """Make the device's work in `art`'s captured graphs free: replay, task updates and synchronize do
    nothing (graphs captured later are real)."""
    for entry in art.graphs.values():
        entry.graph = _NoDeviceGraph() if entry.graph is not None else None
    art.runtime.synchronize = lambda: None
    art.target.updates = _NoUpdates()


def runner_only_us(layers: int, batch_size: int, frozen_parameters: bool, rounds: int = 15,
                   calls: int = 200) -> dict[str, float]:
    """The runner's own host work per decode step, in microseconds, of the model compiled as the README
    says (`ascend_compile.compile`: one general trace, floats specialised): the compiled artifact called
    directly (no dynamo guards) with the device's work stubbed out (replay, task updates and
    synchronize do nothing), so only reading, checking, planning, staging and unpadding remain.
    The steps take turns among decode batches `batch_size` down to `batch_size - 7` (one bucket) with
    vLLM's fixed block-table width. `rounds` rounds of `calls` steps, the collector off (as `timeit` has it): the best round and the
    median round."""
    cfg = LlamaConfig(num_layers=layers, num_blocks=4096)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=(8, 16), frozen_parameters=frozen_parameters)
    compiled = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append))
    batch = PagedBatch(cfg, seed=0, table_width=MAX_LEN // cfg.block_size)  # vLLM's fixed block-table width
    rng = random.Random(0)
    sizes = [n for n in range(batch_size, batch_size - 8, -1) if n > 0]  # steps of several sizes, one bucket
    with torch.no_grad():
        compiled(**batch.step([rng.randint(1, MAX_LEN) for _ in range(batch_size)]))
        art = artifacts[-1]
        stub_device(art)
        with served.probe() as served_calls:  # the arguments dynamo gathers for the artifact, step by step
            for size in sizes:
                compiled(**batch.step([rng.randint(1, MAX_LEN) for _ in range(size)]))
        seen = [c.args for c in served_calls]
        for i in range(50):
            art(*seen[i % len(seen)])
        times = []
        gc.collect()
        gc.disable()  # as timeit does: a collection walking the whole process heap is not the runner's work
        try:
            for _ in range(rounds):
                start = time.perf_counter()
                for i in range(calls):
                    art(*seen[i % len(seen)])
                times.append((time.perf_counter() - start) / calls * 1e6)
        finally:
            gc.enable()
    return {"best_us": round(min(times), 1), "median_us": round(statistics.median(times), 1),
            "checked_inputs": len(art.checked), "inputs": len(seen[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--runner-only", action="store_true",
                        help="only the runner's own host work per step, the device's work stubbed out")
    args = parser.parse_args()
    if args.runner_only:
        print(f"the runner's own host work per decode step (batches {args.batch} to {args.batch - 7} in turn, device "
              f"stubbed, artifact called directly): us per step, best / median of 15 rounds of 200 steps; 'checked' = in-place inputs whose "
              f"addresses are checked each step")
        print(f"{'layers':>6} {'inputs':>6} | {'every address checked':>24} {'checked':>7} | "
              f"{'frozen_parameters=True':>24} {'checked':>7}")
        runner_only_us(2, args.batch, False, rounds=5)  # warm-up: the first measurement of a process runs slow
        for layers in args.layers:
            full, frozen = (runner_only_us(layers, args.batch, f) for f in (False, True))
            print(f"{layers:>6} {full['inputs']:>6} | {full['best_us']:>11.1f} / {full['median_us']:>10.1f} "
                  f"{full['checked_inputs']:>7} | {frozen['best_us']:>11.1f} / {frozen['median_us']:>10.1f} "
                  f"{frozen['checked_inputs']:>7}", flush=True)
        return
    rows = [bench_depth(layers, args.steps, args.batch) for layers in args.layers]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"ascend_graph on the CPU simulator, example model, {rows[0]['buckets']} buckets, decode batch {args.batch}, "
          f"max_model_len {MAX_LEN}, {torch.get_num_threads()} threads")
    head = (f"{'layers':>6} {'1st call s':>10} {'capture s/bucket':>16} {'step ms':>8} {'execute ms':>10} "
            f"{'host ms':>8} {'copy-in':>8} {'launch+upd':>10} {'runner us':>9} {'eager ms':>8} {'host/eager':>10} "
            f"{'conv/step':>9} {'upd/step':>8} {'ws q/step':>9}")
    print(head)
    for r in rows:
        print(f"{r['layers']:>6} {r['first_dynamic_call_s']:>10.2f} {r['capture_s_per_bucket']['mean']:>16.4f} "
              f"{r['step_ms']:>8.2f} {r['execute_ms']:>10.2f} {r['runner_host_ms']:>8.2f} {r['copy_in_ms']:>8.2f} "
              f"{r['launch_and_updates_ms']:>10.2f} {r['runner_us']:>9.1f} {r['eager_step_ms']:>8.2f} {r['host_vs_eager']:>10.3f} "
              f"{r['host_conversions_per_step']:>9.1f} {r['task_updates_per_step']:>8.1f} "
              f"{r['workspace_queries_per_step']:>9.1f}")
    print("\nworkspace bytes reserved: shared slot vs per-bucket vs per-layer")
    for r in rows:
        ws = r["workspace_bytes"]
        print(f"{r['layers']:>6} layers: shared {ws['shared']:>10,}  per-bucket {ws['per_bucket']:>12,}  "
              f"per-layer {ws['per_layer']:>14,}")


if __name__ == "__main__":
    main()
