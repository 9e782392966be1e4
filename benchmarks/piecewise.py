"""Host time and launches of a step no full graph serves: eager (the runner's fallback before
piecewise graphs) against piecewise graphs, the device stubbed, in one process.

    python benchmarks/piecewise.py [--layers 32] [--tokens 512] [--rounds 15] [--calls 10] [--json]

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
plus, for piecewise, one per piece replayed. The last line prints `piecewise/eager X` (host time, best).
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


def _compiled(layers: int, tokens: int, piecewise: bool) -> tuple[Any, list, dict]:
    cfg = LlamaConfig(num_layers=layers, num_blocks=4096, block_size=16)
    torch._dynamo.reset()
    artifacts: list = []
    options: dict[str, Any] = dict(runtime="sim", max_model_len=MAX_LEN, capture_sizes=(8, 16, 32), verify=False)
    if not piecewise:
        options["piecewise_sizes"] = []
    compiled = ascend_compile.compile(build(cfg), backend=backend(CompileConfig(**options),
                                                                   on_compiled=artifacts.append))
    batch = PagedBatch(cfg, seed=0)
    quarter = tokens // 4
    step = batch.step([quarter] * 4, [quarter] * 4)
    with torch.no_grad():
        compiled(**batch.step([5, 9]))  # the general trace
        with served.probe() as calls:
            compiled(**step)
    art = artifacts[-1]
    return art, list(calls[-1].args), step


def _stub_device(art: Any) -> collections.Counter:
    replays: collections.Counter = collections.Counter()
    for graph in art.piecewise.values():
        for piece in graph.pieces:
            piece.graph = _NoReplay(replays)
    art.runtime.synchronize = lambda: None
    return replays


def measure(layers: int, tokens: int, piecewise: bool, rounds: int, calls: int) -> dict[str, Any]:
    art, args, _ = _compiled(layers, tokens, piecewise)
    replays = _stub_device(art)
    with torch.no_grad():
        for _ in range(3):
            art(*args)
        counter = _CountLaunches()
        before = replays["replays"]
        with counter:
            art(*args)
        launches = counter.count + replays["replays"] - before
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
            "served": served_by, "pieces": max((len(g.pieces) for g in art.piecewise.values()), default=0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    undo = _stub_kernels()
    try:
        eager = measure(args.layers, args.tokens, False, args.rounds, args.calls)
        pieces = measure(args.layers, args.tokens, True, args.rounds, args.calls)
    finally:
        undo()
    if "prefill/piecewise" not in pieces["served"] or "prefill/eager" not in eager["served"]:
        raise SystemExit(f"the step was not served as compared: eager {eager['served']}, piecewise {pieces['served']}")
    ratio = pieces["best_us"] / eager["best_us"]
    result = {"layers": args.layers, "tokens": args.tokens, "eager": eager, "piecewise": pieces,
              "host_ratio": round(ratio, 3), "launch_ratio": round(pieces["launches"] / eager["launches"], 3)}
    if args.json:
        print(json.dumps(result))
    print(f"{args.layers} layers, a {args.tokens}-token prefill step (4 sequences), device stubbed; host us per step "
          f"(best / median of {args.rounds} rounds of {args.calls}), launches per step")
    print(f"{'path':>10} {'best us':>10} {'median us':>10} {'launches':>9}")
    for name, row in (("eager", eager), ("piecewise", pieces)):
        print(f"{name:>10} {row['best_us']:>10} {row['median_us']:>10} {row['launches']:>9}")
    print(f"pieces per step {pieces['pieces']}; launches piecewise/eager {result['launch_ratio']}")
    print(f"piecewise/eager {ratio:.3f}")


if __name__ == "__main__":
    main()
