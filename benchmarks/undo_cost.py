"""What transactional steps cost: the undo log's save per step (`lowering/undo.py`), beside a step.

    python benchmarks/undo_cost.py [--layers 4 32] [--batch 16]

Before every graph step the runner saves each written KV cache at the rows of the step's slots (and
any other input the graph writes in place, whole). Measured here on the CPU for decode steps of
`--batch` tokens over bf16 caches of KVH 8, D 128, block 128: per step, the save (what every step
pays) and the restore (only a step that raised pays it), for caches given as their own tensors (one
`index_select` each) and as the halves of vLLM's `[num_blocks, 2, block_size, ...]` cache (indexed
by block and offset), and the bytes kept. The simulator's step of the example model at the same
depth is `benchmarks/cpu_runner.py`'s table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ascend_compile.lowering.undo import UndoPlan  # noqa: E402

BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 32, 128, 8, 128


def caches(layers: int, layout: str) -> list[torch.Tensor]:
    """Two caches per layer: separate tensors, or the key and value halves of one tensor per layer."""
    if layout == "separate":
        return [torch.randn(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(2 * layers)]
    pairs = [torch.randn(BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(layers)]
    return [half for kv in pairs for half in (kv[:, 0], kv[:, 1])]


def measure(layers: int, batch: int, layout: str, repeat: int = 50) -> dict[str, float]:
    """Median ms of the save and of the restore, and the bytes saved, for one step of `batch` tokens."""
    args: list = caches(layers, layout)
    slot = len(args)
    args.append(torch.randperm(BLOCKS * BLOCK_SIZE)[:batch])
    plan = UndoPlan(tuple((i, slot) for i in range(slot)), ())
    saves, restores = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        undo = plan.save(args, rows_wanted=True)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        undo.restore()
        restores.append(time.perf_counter() - start)
    kept = sum(c.numel() * c.element_size() for _, _, c in undo.rows)
    return {"save_ms": 1e3 * statistics.median(saves), "restore_ms": 1e3 * statistics.median(restores),
            "bytes": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[4, 32])
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    print("| layers | caches | layout | save ms / step | restore ms (failed steps) | bytes kept |")
    print("|---:|---:|---|---:|---:|---:|")
    for layers in args.layers:
        for layout in ("separate", "vllm halves"):
            m = measure(layers, args.batch, layout)
            print(f"| {layers} | {2 * layers} | {layout} | {m['save_ms']:.3f} | {m['restore_ms']:.3f} | {m['bytes']:,} |")


if __name__ == "__main__":
    main()
