"""The update table's host cost per updated task: our own work against the runtime's update call.

    python benchmarks/update_cost.py [--layers 32] [--batch 32] [--rounds 15] [--calls 20] [--json PATH]

The example Llama (`examples/llama.py`, tiny dims, `--layers` deep) compiled with
`ascend_compile.compile`, one decode graph of `--batch` sequences captured and replayed on two steps of
different KV lengths, whose host lists (the `plan.host` of each replay) are then fed to its update
table (`lowering/capture.py: UpdateTable`) directly, no replay between, on each runtime:
- "sim": the ACL-graph simulator; a task update is recorded by its dispatch mode (`UpdateMode`);
- "npu": the fake torch_npu (`tests/fake_torch_npu.py`, over the same simulator): the runtime's
  `NpuKernels` binding converts each task's arguments as torch_npu's call needs them.
Per runtime, us per updated task, best / median of `--rounds` rounds of `--calls` applications, in the
calling thread's CPU time (`time.thread_time`, collector off), the queued updates drained between
rounds (not timed):
- ours: what the runner does per task before any runtime call: the per-step comparison of the host
  lists with those last issued, and each task's arguments with the step's lists in place
  (`UpdateEntry.arguments`);
- issued: `table.apply` with the KV lengths changed at every call, so that every task is re-issued
  (task update begin, the kernel re-issued inside it, end, its event recorded);
- the runtime's call: issued - ours;
- unchanged: `table.apply` with the same lists again: no task re-issued, its event recorded.
On a device, the runtime's call is torch_npu's `graph_task_update_begin/end` and the kernel's host-side
tiling: users of vLLM-Ascend measured about 184 us per layer on a 910B3 (3.68 ms of updates for 20
layers); the simulator's call is its own dispatch, a stand-in, not a device figure.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ascend_compile  # noqa: E402
from ascend_compile.backend import backend  # noqa: E402
from ascend_compile.config import CompileConfig  # noqa: E402
from ascend_compile.lowering import capture  # noqa: E402
from examples.llama import LlamaConfig, PagedBatch, build  # noqa: E402
from tests import fake_torch_npu  # noqa: E402


def _rounds(fn: Callable[[], Any], rounds: int, calls: int, between: Callable[[], None]) -> list[float]:
    """Thread CPU seconds per call of `fn`, one figure per round of `calls` calls."""
    out = []
    for _ in range(rounds):
        between()
        gc.disable()
        start = time.thread_time()
        for _ in range(calls):
            fn()
        out.append((time.thread_time() - start) / calls)
        gc.enable()
    return out


def _captured(runtime: str, layers: int, batch: int) -> tuple[Any, Any, list[dict]]:
    """(table, runtime, [host lists of two steps]) of a `batch`-sequence decode graph."""
    dtype = torch.bfloat16 if runtime == "npu" else torch.float32
    cfg = LlamaConfig(num_layers=layers, num_blocks=4 * batch, block_size=128, dtype=dtype)
    seen: list[tuple[Any, Any, dict]] = []
    apply = capture.UpdateTable.apply

    def recording(table, rt, host):
        seen.append((table, rt, dict(host)))
        return apply(table, rt, host)

    capture.UpdateTable.apply = recording
    try:
        torch._dynamo.reset()
        config = CompileConfig(max_model_len=512, capture_sizes=(batch,), runtime=runtime)
        fn = ascend_compile.compile(build(cfg), backend=backend(config))
        steps = PagedBatch(cfg, seed=1)
        with torch.no_grad():
            for base in (100, 101, 102):
                fn(**steps.step([base + 3 * i for i in range(batch)]))
    finally:
        capture.UpdateTable.apply = apply
    table, rt, _ = seen[-1]
    hosts = [host for t, _, host in seen if t is table][-2:]
    assert len(hosts) == 2 and hosts[0] != hosts[1], "two replays of one graph with different lists"
    return table, rt, hosts


def measure(runtime: str, layers: int, batch: int, rounds: int, calls: int) -> dict[str, Any]:
    table, rt, hosts = _captured(runtime, layers, batch)
    tasks = len(table.entries)
    sources = table.sources
    flip = [0]

    def ours() -> None:
        host = hosts[flip[0]]
        flip[0] ^= 1
        changed = {s for s in sources if table.issued.get(s) != host[s]}
        for entry in table.entries.values():
            if not entry.sources.isdisjoint(changed):
                entry.arguments(host)
        table.issued = {s: list(host[s]) for s in sources}

    def issued() -> None:
        flip[0] ^= 1
        assert table.apply(rt, hosts[flip[0]]) == tasks

    def unchanged() -> None:
        assert table.apply(rt, hosts[0]) == 0

    def drain() -> None:
        rt.synchronize()
        table.issued, flip[0] = {}, 0  # the next call issues every task, and each after it too

    def prime_unchanged() -> None:
        rt.synchronize()
        table.apply(rt, hosts[0])

    figures = {"ours": _rounds(ours, rounds, calls, drain), "issued": _rounds(issued, rounds, calls, drain),
               "unchanged": _rounds(unchanged, rounds, calls, prime_unchanged)}
    rt.synchronize()
    row = {"runtime": runtime, "layers": layers, "batch": batch, "tasks": tasks}
    for name, per_call in figures.items():
        row[name] = {"best_us": min(per_call) / tasks * 1e6, "median_us": statistics.median(per_call) / tasks * 1e6}
    row["runtime_call"] = {k: row["issued"][k] - row["ours"][k] for k in ("best_us", "median_us")}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", help="write the rows here")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure("sim", opts.layers, opts.batch, opts.rounds, opts.calls)]
    with pytest.MonkeyPatch.context() as mp:
        fake_torch_npu.install(mp)
        rows.append(measure("npu", opts.layers, opts.batch, opts.rounds, opts.calls))
    print(f"update table, {opts.layers} layers, decode batch {opts.batch}: us per task, best / median "
          f"(thread CPU time, {opts.rounds} rounds of {opts.calls} applications)")
    print(f"{'runtime':8} {'tasks':>5} {'ours':>15} {'runtime call':>15} {'issued':>15} {'unchanged':>15}")
    for r in rows:
        cell = lambda k: f"{r[k]['best_us']:6.1f} / {r[k]['median_us']:6.1f}"  # noqa: E731
        print(f"{r['runtime']:8} {r['tasks']:5d} {cell('ours'):>15} {cell('runtime_call'):>15} {cell('issued'):>15} "
              f"{cell('unchanged'):>15}")
    for r in rows:
        print(f"{r['runtime']}: ours/issued {r['ours']['best_us'] / r['issued']['best_us']:.3f}, "
              f"unchanged/issued {r['unchanged']['best_us'] / r['issued']['best_us']:.3f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
