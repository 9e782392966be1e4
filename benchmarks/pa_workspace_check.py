"""What `pa_workspace_check` costs: the host seconds a decode step spends asking PA's workspace query
with its own lengths, beside the step itself, on the fake torch_npu.

    python benchmarks/pa_workspace_check.py [--layers 4 32] [--batch 8] [--steps 20]

The example model on runtime "npu" over the fake torch_npu (`tests/fake_torch_npu.py`, which runs the
simulator and answers PA's query from the reference tiling), compiled with
the check on (the default); decode steps are replayed. Prints the median step, the PA queries asked per
step, and the median time of that query alone, at a step's lengths, with their ratio. On a device the query is ATB's host tiling plus the workspace tensor it returns
(vLLM-Ascend pays it at every update); this measures our side of it (probe tensors, the call), not ATB.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ascend_compile import backend  # noqa: E402
from ascend_compile.config import CompileConfig  # noqa: E402
from ascend_compile.ops import tiling  # noqa: E402
from ascend_compile.ops.npu.workspace_queries import NpuWorkspaceQuery  # noqa: E402
from examples.llama import LlamaConfig, PagedBatch, build  # noqa: E402
from tests import fake_torch_npu  # noqa: E402

PA_QUERY = "_npu_paged_attention_get_workspace"


def measure(layers: int, batch_size: int, steps: int) -> dict[str, float]:
    """The median replayed decode step (check on), the PA queries it asked, and the median time of
    the check's one query at a step's lengths, timed alone."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        fake = fake_torch_npu.install(monkeypatch)
        cfg = LlamaConfig(num_layers=layers, num_blocks=64, block_size=128, dtype=torch.bfloat16)
        torch._dynamo.reset()
        config = CompileConfig(max_model_len=2048, capture_sizes=(batch_size,), runtime="npu", kernel_policy="pa",
                               verify=False)
        artifacts: list = []
        fn = torch.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append), dynamic=True)
        batch = PagedBatch(cfg, seed=0)
        lens = [200 + 37 * i for i in range(batch_size - 1)]
        times = []
        with torch.no_grad():
            for i in range(steps + 2):  # two to compile and capture
                inputs = batch.step([n + i for n in lens])
                asked = fake.count(PA_QUERY)
                start = time.perf_counter()
                fn(**inputs)
                times.append(time.perf_counter() - start)
        queries = fake.count(PA_QUERY) - asked
        assert artifacts[-1].stats["replays"] >= steps, artifacts[-1].stats
        query = NpuWorkspaceQuery(artifacts[-1].runtime.kernels, torch.bfloat16)
        shape = tiling.AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size)
        padded = lens + [1]
        seconds = []
        for _ in range(200):
            start = time.perf_counter()
            query.paged_attention(shape, padded, 2048 // cfg.block_size)
            seconds.append(time.perf_counter() - start)
        return {"step_ms": statistics.median(times[2:]) * 1e3, "queries_per_step": queries,
                "query_ms": statistics.median(seconds) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"fake torch_npu, batch {args.batch} decode (bucket {args.batch}, PA), median of {args.steps} replays")
    print("| layers | step (check on) | PA queries per step | the check's query | query / step |")
    print("|---:|---:|---:|---:|---:|")
    for layers in args.layers:
        m = measure(layers, args.batch, args.steps)
        print(f"| {layers} | {m['step_ms']:.2f} ms | {m['queries_per_step']} | {m['query_ms']:.3f} ms "
              f"| {m['query_ms'] / m['step_ms']:.4f}x |")


if __name__ == "__main__":
    main()
