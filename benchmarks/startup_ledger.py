"""Where start-up goes, and how many graphs it plans (issue 48): the start-up ledger and graph budget
of the example model compiled on the simulator, every decode bucket captured at the first call
(`capture_all`), then one step above the largest bucket (a piecewise size captured).

    python benchmarks/startup_ledger.py [--layers 32] [--stream-budget 2048] [--json]

Prints the phases (dynamo's trace, the passes, kernel timing, probes, memory estimate), the capture
seconds (all captures, the slowest), the first call's wall time, and the graph count against the budget
(piecewise sizes dropped to fit it). Model dims are small (hidden 64): the figures are the compiler's
and the simulator's host work, not a device's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ascend_compile  # noqa: E402
from ascend_compile import CompileConfig, backend  # noqa: E402
from ascend_compile.runtime.sim import SimRuntime  # noqa: E402
from ascend_compile.targets import Target  # noqa: E402
from examples.llama import LlamaConfig, PagedBatch, build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--stream-budget", type=int, default=2048)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    cfg = LlamaConfig(num_layers=opts.layers, num_blocks=512)
    sim = SimRuntime(stream_budget=opts.stream_budget)
    artifacts: list = []
    config = CompileConfig(max_model_len=512, capture_all=True)
    fn = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append,
                                                            target=lambda device, config: Target(sim)))
    batch = PagedBatch(cfg, seed=1)
    with torch.no_grad():
        start = time.perf_counter()
        fn(**batch.step([100] * 6))
        first_call = time.perf_counter() - start
        fn(**batch.step([200, 250], [150, 150]))
    startup = artifacts[0].describe()["startup"]
    captures = startup["captures"]
    slowest = max(captures.items(), key=lambda kv: kv[1])
    result = {"layers": opts.layers, "first_call_s": round(first_call, 3), **startup["seconds"],
              "captures": len(captures), "capture_s": startup["capture_seconds"], "slowest_capture": slowest,
              **startup["graph_budget"]}
    if opts.json:
        print(json.dumps(result))
        return
    for name, value in result.items():
        print(f"{name:>28}: {value}")


if __name__ == "__main__":
    main()
