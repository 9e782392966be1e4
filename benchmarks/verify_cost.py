"""What `verify` costs: seconds per captured graph of the first-replay check, beside the capture itself.

    python benchmarks/verify_cost.py [--layers 4 32] [--buckets 8]

The example model on the simulator (runtime "sim", its kernels the reference ones), compiled with
`verify` off and on in the same process: one decode step per bucket (each captures its graph and
replays it once), then the same steps again (replays only). Prints, per depth: capture seconds per
graph, the check's seconds per graph (`plan.json`'s `verified.seconds`: one eager step and the
copies of the step's written rows), their ratio, and the steady-step time with and without the check
(the check runs at first replays only, so steady steps cost the same). On a device the eager step
runs the reference kernels there, not the simulator's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ascend_compile import backend  # noqa: E402
from ascend_compile.config import CompileConfig  # noqa: E402
from examples.llama import LlamaConfig, PagedBatch, build  # noqa: E402


def measure(layers: int, buckets: tuple[int, ...], verify: bool) -> dict[str, float]:
    """Capture seconds and check seconds per graph, and the median steady step, for one setting."""
    cfg = LlamaConfig(num_layers=layers, num_blocks=64 * max(buckets))
    artifacts: list = []
    torch._dynamo.reset()
    config = CompileConfig(max_model_len=1024, capture_sizes=buckets, runtime="sim", verify=verify)
    fn = torch.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append), dynamic=True)
    batch = PagedBatch(cfg, seed=0)
    steps = [batch.step([300 + 7 * i for i in range(b)]) for b in buckets]
    with torch.no_grad():
        for inputs in steps:
            fn(**inputs)
        times = []
        for _ in range(3):
            for inputs in steps:
                start = time.perf_counter()
                fn(**inputs)
                times.append(time.perf_counter() - start)
    entries = [g for a in artifacts for g in a.graphs.values() if g.graph is not None]
    checks = [g.verified["seconds"] for g in entries if g.verified is not None]
    return {"graphs": len(entries), "capture_s": statistics.mean(g.capture_seconds for g in entries),
            "check_s": statistics.mean(checks) if checks else 0.0, "step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[4, 32])
    parser.add_argument("--buckets", type=int, nargs="*", default=[1, 2, 4, 8])
    args = parser.parse_args()
    buckets = tuple(args.buckets)
    print("| layers | graphs | capture s / graph | check s / graph | check / capture | step ms, verify off | step ms, on |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for layers in args.layers:
        off, on = measure(layers, buckets, False), measure(layers, buckets, True)
        print(f"| {layers} | {on['graphs']} | {on['capture_s']:.3f} | {on['check_s']:.3f} | "
              f"{on['check_s'] / on['capture_s']:.2f}x | {off['step_s'] * 1e3:.2f} | {on['step_s'] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
