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

#: Per floating dtype, (rtol, atol) of one row (the last dimension) of an output or written region, for a
#: graph of one attention layer: the row's 2-norm error within rtol of the row's norm, plus atol per
#: element (rows near zero). A right graph differs from eager by rounding alone (a device kernel's
#: accumulation order, fp16 softmax), which grows with depth: rtol grows as sqrt(layers)
#: (`row_tolerance`). Measured as an upper bound (`python benchmarks/verify_tolerance.py`): the example
#: model in bfloat16 against the same weights in float32 (every op rounded, not only attention), 200
#: random decode steps: the worst row's relative error was 0.035 at 4 layers and 0.19 at 32 (about
#: 0.034 sqrt(layers)); bfloat16's rtol, 0.05 sqrt(layers), flags none of them, where an elementwise
#: rule (`isclose` at 5e-2, the rule before) flags 67 of the 200 at 32 layers. A binding error moves the
#: rows it touches by far more (every length stale at half: at least 0.46 at 4 layers, 0.65 at 32, all
#: 400 caught); other dtypes (integers, bool) must be equal.
ROW_TOLERANCE = {torch.float64: (1e-6, 1e-9), torch.float32: (2e-3, 1e-5), torch.float16: (5e-3, 1e-3),
                 torch.bfloat16: (5e-2, 1e-2)}


def row_tolerance(dtype: torch.dtype, layers: int) -> tuple[float, float] | None:
    """(rtol, atol) of one row for a graph `layers` attention layers deep (None: compared exactly)."""
    base = ROW_TOLERANCE.get(dtype)
    if base is None:
        return None
    scale = max(1, layers) ** 0.5
    return base[0] * scale, base[1]


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
    error: float  # compared exactly: the largest |diff|; else the worst row's error relative to its norm
    tolerance: tuple[float, float] | None  # (rtol, atol) of a row, None where compared exactly

    def __str__(self) -> str:
        if self.tolerance is None:
            return f"{self.what}: max |diff| {self.error:.3g} (exact)"
        return (f"{self.what}: worst row's error {self.error:.3g} of its norm (per row: rtol="
                f"{self.tolerance[0]:.3g}, atol={self.tolerance[1]:g} an element)")


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


def compare(name: str, got: Any, expected: Any, layers: int = 1) -> Mismatch | None:
    """None where `got` equals `expected`: every row (the last dimension) within `row_tolerance` of
    the dtype for a graph `layers` deep, NaNs and infinities where `expected` has them; exactly for
    other dtypes. A mismatch reports the worst row's error relative to its norm."""
    if not isinstance(expected, torch.Tensor):
        return None if got == expected else Mismatch(name, float("inf"), None)
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return Mismatch(f"{name} (shape {shape}, expected {tuple(expected.shape)})", float("inf"), None)
    tolerance = row_tolerance(expected.dtype, layers)
    if tolerance is None:
        equal = torch.equal(got, expected)
        diff = 0.0 if equal else float((got.double() - expected.double()).abs().max())
        return None if equal else Mismatch(name, diff, None)
    if got.numel() == 0:
        return None
    g, e = got.double(), expected.double()
    if not torch.equal(g.isnan(), e.isnan()) or not torch.equal(g.isinf() & (g == e), e.isinf()):
        return Mismatch(f"{name} (NaN or infinity where eager has none, or none where it has)", float("inf"), tolerance)
    finite = e.isfinite()
    rows = lambda t: torch.where(finite, t, 0.0).reshape(-1, max(1, e.shape[-1] if e.dim() else 1))  # noqa: E731
    err, norm = (rows(g) - rows(e)).norm(dim=1), rows(e).norm(dim=1)
    rtol, atol = tolerance
    if bool((err <= rtol * norm + atol * rows(e).shape[1] ** 0.5).all()):
        return None
    return Mismatch(name, float((err / norm.clamp_min(atol)).max()), tolerance)


def first_replay_check(
    name: str,
    regions: Sequence[Region],
    args: Sequence[Any],
    eager: Callable[[], Any],
    replay: Callable[[], Sequence[Any]],
    names: dict[int, str],
    generators_kept: Callable[[], ContextManager[None]],
    layers: int = 1,
) -> tuple[Sequence[Any], dict[str, Any]]:
    """Run the step eagerly, put the written regions and the random generators back, replay it;
    compare outputs and regions (a step that samples draws the same numbers in both runs), each within
    the tolerance of a graph `layers` attention layers deep (`row_tolerance`).

    Returns (the step's outputs, the check's record for the plan): the replay's outputs where they
    agree, else eager's, with the written regions left as eager wrote them, and a warning logged."""
    start = time.perf_counter()
    outputs, mismatches = _compare_runs(regions, args, eager, replay, names, generators_kept, layers)
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
                  generators_kept: Callable[[], ContextManager[None]], layers: int) -> tuple[Sequence[Any], list[Mismatch]]:
    before = [r.read(args) for r in regions]
    with generators_kept():
        expected = [o.clone() if isinstance(o, torch.Tensor) else o for o in _flat(eager())]
    eager_state = [r.read(args) for r in regions]
    for region, value in zip(regions, before):
        region.write(args, value)
    outputs = replay()
    mismatches = [m for i, (got, want) in enumerate(zip(_flat(outputs), expected))
                  if (m := compare(f"output {i}", got, want, layers)) is not None]
    if len(_flat(outputs)) != len(expected):
        mismatches.append(Mismatch(f"{len(_flat(outputs))} outputs, expected {len(expected)}", float("inf"), None))
    for region, want in zip(regions, eager_state):
        what = names[region.index] + (" (the step's rows)" if region.rows is not None else "")
        m = compare(what, region.read(args), want, layers)
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
