"""The self-check at first contact: a graph's first replay against the same step run eagerly.

On a device no test of ours ran on, the first user relies on this: before a captured graph serves
steps, its first replay is compared with the model's own graph (dynamo's, the eager fallback) run on
the same step, outputs and every input the step writes (KV caches, the caller's buffers). A graph
whose replay differs is marked eager-only, and the step returns eager's results, so every step stays
right; the mismatch is logged and recorded in the plan.

What is written is put back between the two runs, so each starts from the same state. Inputs
written in place are snapshot where the step writes them: a KV cache at the rows of the step's slot
mappings (the cache-write op's contract: nothing else of a cache changes; a step with several slot
mappings, one per group of layers, snapshots every cache at the rows any of them names, which holds
the rows its own names), anything else whole. The cost of a check is one eager step and two copies
of the step's written rows (before, and as eager wrote them; `benchmarks/verify_cost.py`), never of
a whole cache.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, ContextManager, Sequence

import torch

from ..passes.roles import GraphSignature, Role

log = logging.getLogger("ascend_compile")

#: (rtol, atol) per dtype: a device kernel may round unlike the reference (bf16 accumulation
#: orders, fp16 softmax), a binding error (wrong argument, stale length, a cache never written)
#: is far outside these. Other dtypes (integers, bool) must be equal.
TOLERANCE = {torch.float32: (1e-3, 1e-3), torch.float64: (1e-6, 1e-6), torch.float16: (1e-2, 1e-2),
             torch.bfloat16: (5e-2, 5e-2)}


@dataclasses.dataclass(frozen=True)
class Region:
    """Where a step writes one input: the whole tensor, or a KV cache's rows (block, offset)."""

    index: int
    rows: tuple[torch.Tensor, torch.Tensor] | None  # (blocks, offsets) of the written slots

    def read(self, args: Sequence[Any]) -> torch.Tensor:
        t = args[self.index]
        return t.clone() if self.rows is None else t[self.rows]

    def write(self, args: Sequence[Any], value: torch.Tensor) -> None:
        t = args[self.index]
        if self.rows is None:
            t.copy_(value)
        else:
            t[self.rows] = value


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """What differed at a first replay: which output or input, and by how much."""

    what: str
    max_abs_diff: float
    tolerance: tuple[float, float] | None

    def __str__(self) -> str:
        within = f"rtol={self.tolerance[0]:g}, atol={self.tolerance[1]:g}" if self.tolerance else "exact"
        return f"{self.what}: max |diff| {self.max_abs_diff:.3g} ({within})"


def written_regions(signature: GraphSignature, written: set[int], args: Sequence[Any]) -> list[Region]:
    """The regions of the step's arguments `args` that the graph may write: each KV cache at the
    rows of the step's valid slots (of every slot mapping the step has, those within the cache),
    every other written input whole."""
    mappings = [args[s.index] for s in signature.by_role(Role.SLOT_MAPPING)]
    slots = torch.cat([m[m >= 0].long().flatten() for m in mappings]).unique() if mappings else None
    regions = []
    for i in sorted(written):
        spec = signature.inputs[i]
        if spec.role is Role.KV_CACHE and slots is not None and args[i].dim() >= 2:
            block_size = args[i].shape[1]
            valid = slots[slots < args[i].shape[0] * block_size]
            regions.append(Region(i, (valid // block_size, valid % block_size)))
        elif isinstance(args[i], torch.Tensor):
            regions.append(Region(i, None))
    return regions


def compare(name: str, got: Any, expected: Any) -> Mismatch | None:
    """None where `got` equals `expected` within the dtype's tolerance (NaNs equal where both are)."""
    if not isinstance(expected, torch.Tensor):
        return None if got == expected else Mismatch(name, float("inf"), None)
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return Mismatch(f"{name} (shape {shape}, expected {tuple(expected.shape)})", float("inf"), None)
    tolerance = TOLERANCE.get(expected.dtype)
    if tolerance is None:
        equal = torch.equal(got, expected)
        diff = 0.0 if equal else float((got.double() - expected.double()).abs().max())
        return None if equal else Mismatch(name, diff, None)
    rtol, atol = tolerance
    if torch.isclose(got, expected, rtol=rtol, atol=atol, equal_nan=True).all():
        return None
    diff = (got.double() - expected.double()).abs().nan_to_num(float("inf")).max()
    return Mismatch(name, float(diff), tolerance)


def first_replay_check(
    name: str,
    regions: Sequence[Region],
    args: Sequence[Any],
    eager: Callable[[], Any],
    replay: Callable[[], Sequence[Any]],
    names: dict[int, str],
    generators_kept: Callable[[], ContextManager[None]],
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Run the step eagerly, put the written regions and the random generators back, replay it;
    compare outputs and regions (a step that samples draws the same numbers in both runs).

    Returns (the step's outputs, the check's record for the plan): the replay's outputs where they
    agree, else eager's, with the written regions left as eager wrote them, and a warning logged."""
    start = time.perf_counter()
    outputs, mismatches = _compare_runs(regions, args, eager, replay, names, generators_kept)
    record = {"ok": not mismatches, "seconds": round(time.perf_counter() - start, 4),
              "mismatches": [str(m) for m in mismatches]}
    if mismatches:
        log.warning("ascend_compile: %s: first replay differs from eager: %s; its steps run eagerly",
                    name, "; ".join(record["mismatches"][:3]))
    else:
        log.debug("ascend_compile: %s: first replay equals eager (%.3f s)", name, record["seconds"])
    return outputs, record


def _compare_runs(regions: Sequence[Region], args: Sequence[Any], eager: Callable[[], Any],
                  replay: Callable[[], Sequence[Any]], names: dict[int, str],
                  generators_kept: Callable[[], ContextManager[None]]) -> tuple[Sequence[Any], list[Mismatch]]:
    before = [r.read(args) for r in regions]
    with generators_kept():
        expected = [o.clone() if isinstance(o, torch.Tensor) else o for o in _flat(eager())]
    eager_state = [r.read(args) for r in regions]
    for region, value in zip(regions, before):
        region.write(args, value)
    outputs = replay()
    mismatches = [m for i, (got, want) in enumerate(zip(_flat(outputs), expected))
                  if (m := compare(f"output {i}", got, want)) is not None]
    if len(_flat(outputs)) != len(expected):
        mismatches.append(Mismatch(f"{len(_flat(outputs))} outputs, expected {len(expected)}", float("inf"), None))
    for region, want in zip(regions, eager_state):
        what = names[region.index] + (" (the step's rows)" if region.rows is not None else "")
        m = compare(what, region.read(args), want)
        if m is not None:
            mismatches.append(m)
    if not mismatches:
        return outputs, []
    for region, value in zip(regions, eager_state):
        region.write(args, value)
    return _unflat(outputs, expected), mismatches


def _flat(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _unflat(like: Any, flat: list[Any]) -> Any:
    return tuple(flat) if isinstance(like, (tuple, list)) else flat[0]
