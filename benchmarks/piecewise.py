"""Host time and launches of a step no full graph serves: eager (the runner's fallback before
piecewise graphs) against piecewise graphs, the device stubbed, in one process.

    python benchmarks/piecewise.py [--layers 32] [--tokens 512] [--rounds 15] [--calls 10] [--json PATH]

The example Llama (`examples/llama.py`, tiny dims, `--layers` deep) compiled with `ascend_compile.compile`
on the simulator, buckets up to 32 tokens, and a prefill step of `--tokens` tokens (four sequences of
a quarter each, new to the cache) called on the artifact directly, as `cpu_runner.py --runner-only`
does, twice over:
- eager: compiled with `piecewise_sizes=[]`, so the step runs dynamo's graph op by op;
- piecewise: the default, so it runs the pieces of the smallest piecewise size holding it.
The device's work is stubbed in both: a piece's replay and `synchronize` do nothing, and the attention
kernels' reference bodies return at once (their calls, checks and host lists remain); every other op
runs (on the CPU, tiny dims). Host time is the calling thread's CPU time (`time.thread_time`), us per
step, best / median of `--rounds` rounds of `--calls` steps with the collector off. Launches are the ops
dispatched to the device per step (a `TorchDispatchMode` counting top-level calls; a custom op is one)
plus one per graph or piece replayed and one per task update issued. A second table compares, at one token count inside
the buckets (a 32-sequence decode step), a full graph's step (its replay and task updates stubbed,
with the step's `launches_outside_graph`, `saved_bytes` and `synchronizes` stats,
as `cpu_runner.py --runner-only` stubs them) with the same step on pieces (compiled with buckets up
to 16). The full graph is timed twice: its task updates stubbed too, and issued (the host
re-issuing each layer's kernel in a task update, as on Ascend: the simulator's update machinery then
counts as host time, as the device's runtime's would). The last line prints `piecewise/eager X`
(host time, best).

    python benchmarks/piecewise.py --device cuda [--layers 32] [--tokens 512]   # on a GPU

times, instead, the same prefill step on a GPU (runtime "cuda": CUDA-graph pieces, the Triton kernels
between them), nothing stubbed: ms per step (median of `--rounds` rounds, `torch.cuda.synchronize`
around each), eager against piecewise, the outputs checked against the eager model first.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ascend_compile  # noqa: E402
from ascend_compile.backend import backend  # noqa: E402
from ascend_compile.config import CompileConfig  # noqa: E402
from ascend_compile.lowering import served  # noqa: E402
from ascend_compile.ops import reference  # noqa: E402
from examples.llama import LlamaConfig, PagedBatch, build  # noqa: E402

MAX_LEN = 2048


class _CountLaunches(TorchDispatchMode):
    """Counts the ops dispatched (top level only: a custom op's body is its kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class _NoReplay:
    """A captured graph whose replay is free, counting replays."""

    def __init__(self, counter: collections.Counter) -> None:
        self.counter = counter

    def replay(self) -> None:
        self.counter["replays"] += 1


def _stub_kernels() -> Callable[[], None]:
    """The attention kernels' reference bodies made free (device work); returns the undo."""
    saved = {name: getattr(reference, name) for name in ("fused_infer_attention", "paged_attention")}
    for name in saved:
        setattr(reference, name, lambda *args, **kwargs: None)
    return lambda: [setattr(reference, name, fn) for name, fn in saved.items()]


def _compiled(layers: int, tokens: int, piecewise: bool, decode: bool = False, buckets=(8, 16, 32),
              device: str = "cpu") -> tuple[Any, list, dict, Any]:
    """The example model compiled (`piecewise_sizes=[]` unless `piecewise`), its artifact after one
    step of `tokens` tokens (four prefill sequences, or `tokens` decode sequences), the arguments
    dynamo gave it, the step's inputs and the compiled callable."""
    cfg = LlamaConfig(num_layers=layers, num_blocks=4096, block_size=16)
    torch._dynamo.reset()
    artifacts: list = []
    options: dict[str, Any] = dict(runtime="sim" if device == "cpu" else "cuda", max_model_len=MAX_LEN,
                                   capture_sizes=buckets, verify=False)
    if not piecewise:
        options["piecewise_sizes"] = []
    compiled = ascend_compile.compile(build(cfg).to(device), backend=backend(CompileConfig(**options),
                                                                             on_compiled=artifacts.append))
    batch = PagedBatch(cfg, seed=0)
    quarter = tokens // 4
    step = batch.step([100] * tokens) if decode else batch.step([quarter] * 4, [quarter] * 4)
    step = {k: v.to(device) for k, v in step.items()}
    with torch.no_grad():
        compiled(**{k: v.to(device) for k, v in batch.step([5, 9]).items()})  # the general trace
        with served.probe() as calls:
            compiled(**step)
    art = artifacts[-1]
    return art, list(calls[-1].args), step, compiled


class _NoUpdates:
    def apply(self, table: Any, runtime: Any, host: Any) -> int:
        return 0


def _stub_device(art: Any, updates: bool = False) -> collections.Counter:
    """Replays, synchronize and (unless `updates`) task updates made free, counting replays."""
    replays: collections.Counter = collections.Counter()
    for graph in art.piecewise.values():
        for piece in graph.pieces:
            piece.graph = _NoReplay(replays)
    for entry in art.graphs.values():
        if entry.graph is not None:
            entry.graph = _NoReplay(replays)
    art.runtime.synchronize = lambda: setattr(art.runtime, "synchronizes", art.runtime.synchronizes + 1)
    if not updates:
        art.target.updates = _NoUpdates()
    else:  # the same step is called again and again: re-issue every task, as for steps whose lengths change
        art.runtime.task_updates_persist = False
    return replays


def measure(layers: int, tokens: int, piecewise: bool, rounds: int, calls: int, decode: bool = False,
            buckets=(8, 16, 32), updates: bool = False) -> dict[str, Any]:
    art, args, _, _ = _compiled(layers, tokens, piecewise, decode, buckets)
    replays = _stub_device(art, updates)
    with torch.no_grad():
        for _ in range(3):
            art(*args)
        counter = _CountLaunches()
        before, updates, stats = replays["replays"], art.stats["updates"], dict(art.stats)
        with counter:
            art(*args)
        outside = {k: art.stats[k] - stats.get(k, 0) for k in ("launches_outside_graph", "saved_bytes", "synchronizes")}
        # the task updates' kernels (issued inside the simulator's update mode, which the counter does not see)
        launches = counter.count + replays["replays"] - before + art.stats["updates"] - updates
        times = []
        gc.collect()
        gc.disable()
        try:
            for _ in range(rounds):
                start = time.thread_time()
                for _ in range(calls):
                    art(*args)
                times.append((time.thread_time() - start) / calls * 1e6)
        finally:
            gc.enable()
    served_by = {f"{kind}/{path}": n for (kind, path), n in art.served.items()}
    return {"best_us": round(min(times), 1), "median_us": round(statistics.median(times), 1), "launches": launches,
            **outside, "served": served_by, "pieces": max((len(g.pieces) for g in art.piecewise.values()), default=0)}


def measure_gpu(layers: int, tokens: int, piecewise: bool, rounds: int) -> dict[str, Any]:
    """ms per step of the prefill step on a GPU, nothing stubbed, after checking it against eager."""
    art, _, step, compiled = _compiled(layers, tokens, piecewise, device="cuda")
    cfg = LlamaConfig(num_layers=layers, num_blocks=4096, block_size=16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(**step), build(cfg).to("cuda")(**step), atol=1e-4, rtol=1e-3)
        times = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            compiled(**step)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    served_by = {f"{kind}/{path}": n for (kind, path), n in art.served.items()}
    return {"median_ms": round(statistics.median(times), 3), "best_ms": round(min(times), 3), "served": served_by}


def main_gpu(args: argparse.Namespace) -> None:
    eager = measure_gpu(args.layers, args.tokens, False, args.rounds)
    pieces = measure_gpu(args.layers, args.tokens, True, args.rounds)
    ratio = pieces["median_ms"] / eager["median_ms"]
    if args.json:
        Path(args.json).write_text(json.dumps({"layers": args.layers, "tokens": args.tokens, "eager": eager,
                                               "piecewise": pieces, "ratio": round(ratio, 3)}))
    print(f"GPU: {args.layers} layers, a {args.tokens}-token prefill step; ms per step (median / best of {args.rounds})")
    for name, row in (("eager", eager), ("piecewise", pieces)):
        print(f"{name:>10} {row['median_ms']:>10} {row['best_ms']:>10}  {row['served']}")
    print(f"piecewise/eager {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        return main_gpu(args)
    undo = _stub_kernels()
    try:
        eager = measure(args.layers, args.tokens, False, args.rounds, args.calls)
        pieces = measure(args.layers, args.tokens, True, args.rounds, args.calls)
        full_32 = measure(args.layers, 32, True, args.rounds, args.calls, decode=True)
        updated_32 = measure(args.layers, 32, True, args.rounds, args.calls, decode=True, updates=True)
        pieces_32 = measure(args.layers, 32, True, args.rounds, args.calls, decode=True, buckets=(8, 16))
    finally:
        undo()
    if "decode/full" not in full_32["served"] or "decode/piecewise" not in pieces_32["served"]:
        raise SystemExit(f"the 32-token steps were not served as compared: {full_32['served']}, {pieces_32['served']}")
    if "prefill/piecewise" not in pieces["served"] or "prefill/eager" not in eager["served"]:
        raise SystemExit(f"the step was not served as compared: eager {eager['served']}, piecewise {pieces['served']}")
    ratio = pieces["best_us"] / eager["best_us"]
    result = {"layers": args.layers, "tokens": args.tokens, "eager": eager, "piecewise": pieces,
              "full_graph_32": full_32, "full_graph_32_updates": updated_32, "piecewise_32": pieces_32,
              "host_ratio": round(ratio, 3), "launch_ratio": round(pieces["launches"] / eager["launches"], 3)}
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    print(f"{args.layers} layers, a {args.tokens}-token prefill step (4 sequences), device stubbed; host us per step "
          f"(best / median of {args.rounds} rounds of {args.calls}), launches per step")
    print(f"{'path':>10} {'best us':>10} {'median us':>10} {'launches':>9}")
    for name, row in (("eager", eager), ("piecewise", pieces)):
        print(f"{name:>10} {row['best_us']:>10} {row['median_us']:>10} {row['launches']:>9}")
    print(f"pieces per step {pieces['pieces']}; launches piecewise/eager {result['launch_ratio']}")
    print("a 32-sequence decode step (32 tokens), device stubbed: host us per step (best / median), launches; of "
          "them outside any graph or piece (`launches_outside_graph`), bytes saved, the host's synchronizes")
    for name, row in (("full graph, updates stubbed", full_32), ("full graph, updates issued", updated_32),
                      ("piecewise", pieces_32)):
        print(f"{name:>27} {row['best_us']:>10} {row['median_us']:>10} {row['launches']:>9} "
              f"{row['launches_outside_graph']:>4} {row['saved_bytes']:>4} {row['synchronizes']:>4}")
    print(f"piecewise/full graph at 32 tokens: {pieces_32['best_us'] / updated_32['best_us']:.3f} (updates issued), "
          f"{pieces_32['best_us'] / full_32['best_us']:.3f} (updates stubbed)")
    print(f"piecewise/eager {ratio:.3f}")


if __name__ == "__main__":
    main()
