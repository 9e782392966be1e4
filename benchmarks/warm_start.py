"""Cold and warm start: the start-up ledger of the example model compiled twice with one `plan_dir`
(issue 48, item 4), each start in a fresh process, as a restarted server is.

    python benchmarks/warm_start.py [--layers 8] [--policy auto]

Each start compiles (kernel_policy "auto": both kernels timed per bucket on a cold start) and serves a
decode step and a step above the largest bucket (pieces), then prints its ledger. The last line is
`warm/cold X` over the phases that are not captures (dynamo's trace, the passes, kernel timing, probes,
the memory estimate), and the same without dynamo's trace, which no warm start here skips (no torch we
support offers a custom backend's artifact an AOT path it could take: docs/startup.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_start(plan_dir: str, layers: int, policy: str) -> dict:
    """One start in this process: its ledger (plan.json's `startup`)."""
    sys.path.insert(0, str(ROOT))
    import torch

    import ascend_compile
    from ascend_compile import CompileConfig, backend
    from examples.llama import LlamaConfig, PagedBatch, build

    cfg = LlamaConfig(num_layers=layers, num_blocks=512)
    artifacts: list = []
    config = CompileConfig(max_model_len=512, kernel_policy=policy, plan_dir=plan_dir)
    fn = ascend_compile.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append))
    batch = PagedBatch(cfg, seed=1)
    with torch.no_grad():
        fn(**batch.step([100] * 6))
        fn(**batch.step([200, 250], [150, 150]))
    return artifacts[0].describe()["startup"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        print(json.dumps(one_start(opts.child, opts.layers, opts.policy)))
        return
    with tempfile.TemporaryDirectory() as plan_dir:
        starts = {}
        for name in ("cold", "warm"):
            out = subprocess.run([sys.executable, __file__, "--child", plan_dir, "--layers", str(opts.layers),
                                  "--policy", opts.policy], capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            starts[name] = json.loads(out.stdout.strip().splitlines()[-1])
    for name, start in starts.items():
        phases = ", ".join(f"{k} {v:.3f} s" for k, v in start["seconds"].items())
        print(f"{name}: {phases}; captures {start['capture_seconds']:.3f} s ({len(start['captures'])} graphs); "
              f"plan asked {start['plan']['asked']}, reused {start['plan']['reused']}")
    cold, warm = (sum(s["seconds"].values()) for s in (starts["cold"], starts["warm"]))
    cold_nd, warm_nd = (sum(v for k, v in s["seconds"].items() if k != "dynamo_trace")
                        for s in (starts["cold"], starts["warm"]))
    print(f"warm/cold {warm / cold:.2f} over the non-capture phases; {warm_nd / cold_nd:.2f} without dynamo's trace")


if __name__ == "__main__":
    main()
