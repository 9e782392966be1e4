"""Whether `verify`'s tolerance passes right graphs and catches wrong ones, at the depth of real models.

    python benchmarks/verify_tolerance.py [--layers 4 32] [--steps 200]

A right graph differs from eager by rounding alone. As an upper bound of that difference, the example
model run in bfloat16 stands for the graph and the same weights run in float32 (cast to bfloat16) for
eager: every op rounds differently, not only attention. A planted binding error stands for a wrong
graph: every sequence's length stale at half its value (what a replay reads when its lengths are not
updated). Per depth, over `--steps` random decode steps (1 to 16 sequences, lengths 2 to 500):
the worst row's error relative to its norm (`lowering/verify.py: compare`) of the right steps and of
the stale ones, the tolerance `row_tolerance` gives, and how many steps each rule flags: ours (per row)
and an elementwise `isclose` at rtol = atol = 5e-2 (the rule before). Good: 0 right steps flagged, every
stale step flagged.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ascend_compile.lowering.verify import compare, row_tolerance  # noqa: E402
from examples.llama import LlamaConfig, LlamaDecoder, PagedBatch, build  # noqa: E402


def worst_row(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest row error relative to the row's norm."""
    g, w = got.double(), want.double()
    return float(((g - w).norm(dim=-1) / w.norm(dim=-1)).max())


def measure(layers: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """The figures at one depth."""
    cfg = LlamaConfig(num_layers=layers, num_blocks=512)
    low = dataclasses.replace(cfg, dtype=torch.bfloat16)
    reference, model = build(cfg), LlamaDecoder(low).eval()
    with torch.no_grad():  # the same weights and cache contents, rounded (a seeded draw in another dtype
        # draws other numbers on some torches: 2.10's)
        for mine, theirs in zip([*model.parameters(), *model.buffers()], [*reference.parameters(), *reference.buffers()]):
            mine.copy_(theirs)
    ref_batch, batch = PagedBatch(cfg, seed=1), PagedBatch(low, seed=1)
    rng = random.Random(seed)
    right, stale, flagged, flagged_elementwise, caught = [], [], 0, 0, 0
    with torch.no_grad():
        for _ in range(steps):
            lens = [rng.randint(2, 500) for _ in range(rng.randint(1, 16))]
            want = reference(**ref_batch.step(lens)).to(torch.bfloat16)
            step = batch.step(lens)
            # the stale step first: it writes wrong rows at the step's slots, which the right step then
            # writes anew (the same slots), so that later steps read a right cache
            wrong = model(**{**step, "seq_lens": torch.clamp(step["seq_lens"] // 2, min=1)})
            stale.append(worst_row(wrong, want))
            caught += compare("logits", wrong, want, layers) is not None
            got = model(**step)
            right.append(worst_row(got, want))
            flagged += compare("logits", got, want, layers) is not None
            flagged_elementwise += not bool(torch.isclose(got, want, rtol=5e-2, atol=5e-2).all())
    return {"layers": layers, "steps": steps, "rtol": row_tolerance(torch.bfloat16, layers)[0],
            "right_worst": max(right), "stale_least": min(stale), "right_flagged": flagged,
            "right_flagged_elementwise": flagged_elementwise, "stale_caught": caught}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print("bfloat16 graph stand-in vs float32 eager stand-in; stale: every length at half")
    print(f"{'layers':>6} {'steps':>5} {'rtol':>6} {'right worst':>11} {'stale least':>11} "
          f"{'right flagged':>13} {'(elementwise)':>13} {'stale caught':>12}")
    for layers in args.layers:
        r = measure(layers, args.steps)
        print(f"{r['layers']:>6} {r['steps']:>5} {r['rtol']:>6.3f} {r['right_worst']:>11.3f} {r['stale_least']:>11.3f} "
              f"{r['right_flagged']:>13} {r['right_flagged_elementwise']:>13} {r['stale_caught']:>12}")


if __name__ == "__main__":
    main()
