"""Workspace planning speed: the exact maximum over every length in [1, max_model_len], all buckets.

    python benchmarks/workspace_scan.py [--max-model-len 131072] [--layers 32] [--json]

Plans PA and FIA workspaces for the default 35 capture sizes and `--layers` attention nodes each
(the shape of a Llama-3-8B layer), and prints the time, the slot and the arg-max length, next to the
per-bucket and per-layer schemes it avoids.
"""
from __future__ import annotations

import argparse
import json
import time

from ascend_compile.config import default_capture_sizes
from ascend_compile.ops import tiling
from ascend_compile.passes.workspaces import GraphKey, KernelSite, plan_workspaces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shape = tiling.AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, block_size=128)
    buckets = default_capture_sizes()
    results = {}
    for kernel in (tiling.PA, tiling.FIA):
        graphs = [(GraphKey(b, True), [KernelSite(f"attn_{i}", kernel, shape) for i in range(args.layers)]) for b in buckets]
        start = time.perf_counter()
        plan = plan_workspaces(graphs, args.max_model_len)
        seconds = time.perf_counter() - start
        slot = plan.slots["attn_workspace"]
        results[kernel] = {"seconds": seconds, "nbytes": slot.nbytes, "argmax_len": slot.argmax_len,
                           "schemes": plan.schemes, "lengths_x_buckets": args.max_model_len * len(buckets)}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{len(buckets)} buckets x {args.layers} layers x {args.max_model_len} lengths, H=32 KVH=8 D=128")
    for kernel, r in results.items():
        s = r["schemes"]
        print(f"{kernel:>22}: planned in {r['seconds'] * 1e3:7.1f} ms; slot {r['nbytes']:,} B at length {r['argmax_len']}; "
              f"per-bucket {s['per_bucket']:,} B, per-layer {s['per_layer']:,} B")


if __name__ == "__main__":
    main()
