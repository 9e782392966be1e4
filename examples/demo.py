"""Demo: compile the example Llama decoder with `ascend_graph` and run decode steps at several batch sizes.

    python -m examples.demo [--steps 6] [--dump-dir DIR]

Each step's logits are compared with the uncompiled model; at the end the compiler's decisions
(kernel per bucket with its reason, workspace slots, update tables) are printed from the dump.
"""
from __future__ import annotations

import argparse
import random
import tempfile
from typing import Callable, Sequence

import torch

import ascend_compile
from ascend_compile import cli
from examples.llama import LlamaConfig, PagedBatch, build


def run_and_compare(compiled: Callable[..., torch.Tensor], reference: torch.nn.Module, batch: PagedBatch,
                    max_model_len: int, steps: int, sizes: Sequence[int]) -> None:
    """`steps` steps of the batch sizes `sizes` in turn (every third a chunked-prefill step of 1-4 new
    tokens per sequence), each compared with the uncompiled `reference`, one line per step."""
    rng = random.Random(0)
    with torch.no_grad():
        for step in range(steps):
            size = sizes[step % len(sizes)]
            lens = [rng.randint(4, max_model_len) for _ in range(size)]
            mixed = step % 3 == 2  # chunked prefill: several new tokens per sequence
            query_lens = [rng.randint(1, 4) for _ in lens] if mixed else None
            inputs = batch.step(lens, query_lens)
            out = compiled(**inputs)
            diff = (out - reference(**inputs)).abs().max().item()
            kind = f"{inputs['input_ids'].shape[0]:3d} tokens (mixed)" if mixed else "decode"
            print(f"step {step}: batch {size:3d}, {kind}, longest sequence {max(lens):5d}, "
                  f"max |compiled - eager| = {diff:.2e}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dump-dir", default=None)
    parser.add_argument("--runtime", default="auto", choices=["auto", "sim", "eager"])
    args = parser.parse_args()
    dump_dir = args.dump_dir or tempfile.mkdtemp(prefix="ascend_compile_demo_")

    cfg = LlamaConfig(num_layers=4, num_blocks=2048)
    model, reference = build(cfg), build(cfg)
    max_model_len = 32 * cfg.block_size
    options = {
        "max_model_len": max_model_len,
        "capture_sizes": [1, 2, 4, 8, 16, 32],
        "pa_max_batch": 4,
        "runtime": args.runtime,
        "dump_dir": dump_dir,
    }
    # torch.compile(model, backend="ascend_graph", options=options), traced once for every step shape
    compiled = ascend_compile.compile(model, options)
    run_and_compare(compiled, reference, PagedBatch(cfg, table_width=max_model_len // cfg.block_size),
                    max_model_len, args.steps, (3, 13, 6, 40, 1, 32))  # b4 and b16 decode, b8 mixed, eager, ...
    cli.main(["inspect", dump_dir])


if __name__ == "__main__":
    main()
