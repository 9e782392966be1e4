"""PA vs FIA reference kernels: time per decode call on the CPU, in one process.

    python benchmarks/kernels.py [--context 1024] [--batches 1 4 16 64] [--json]

Both kernels run on identical inputs; the ratio column is FIA time / PA time (> 1: PA faster).
"""
from __future__ import annotations

import argparse
import json

import torch

from ascend_compile.ops import tiling
from ascend_compile.ops.timing import time_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    shape = tiling.AttentionShape(args.heads, args.kv_heads, args.head_dim, args.block_size)
    device = torch.device("cpu")
    rows = []
    for batch in args.batches:
        pa = time_kernel(tiling.PA, shape, batch, args.context, torch.float32, device, args.repeats)
        fia = time_kernel(tiling.FIA, shape, batch, args.context, torch.float32, device, args.repeats)
        rows.append({"batch": batch, "context": args.context, "pa_ms": pa * 1e3, "fia_ms": fia * 1e3, "fia_over_pa": fia / pa})
    if args.json:
        print(json.dumps({"shape": vars(shape), "torch_threads": torch.get_num_threads(), "rows": rows}, indent=2))
        return
    print(f"PA vs FIA reference kernels on the CPU ({torch.get_num_threads()} threads), "
          f"H={shape.num_heads} KVH={shape.num_kv_heads} D={shape.head_dim} block={shape.block_size}, float32")
    print(f"{'batch':>6} {'context':>8} {'PA ms':>9} {'FIA ms':>9} {'FIA/PA':>7}")
    for r in rows:
        print(f"{r['batch']:>6} {r['context']:>8} {r['pa_ms']:>9.3f} {r['fia_ms']:>9.3f} {r['fia_over_pa']:>7.2f}")


if __name__ == "__main__":
    main()
