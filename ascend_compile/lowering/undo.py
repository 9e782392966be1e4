"""Transactional steps: a compiled step that raises leaves the caller's state as it was before it.

A graph writes the caller's tensors in two ways: copied inputs (tokens, a caller's output buffer)
are written in their static buffers and reach the caller only by the copy-back after a successful
replay; inputs used in place (KV caches, buffers, parameters) are written by the graph itself,
layer by layer. A replay, a run op by op or a first-replay check that raises half-way has written
the rows of the layers before the failure: the next steps would attend over a half-written cache.

So, before a graph runs, the undo log saves what it may write in place: each KV cache at the rows
of its cache write's `slot_mapping` (the cache-write op's contract: nothing else of the cache
changes; padding slots, -1, are read as row 0, so no host sync is needed to drop them), every other
input written in place whole (a cache also written by another op is saved whole too). A step that
raises puts them back, then raises. The memory is bounded by the rows a step writes; the cost per
step is one gather per cache written (README, "A step that fails"; `benchmarks/undo_cost.py`).

Everything that can fail before the first write (the graph key, its capture, the step's shapes,
the target's step guard) is checked before the graph runs; the log covers what fails mid-step.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import fx

from ..passes.fx_utils import is_op, placeholders
from ..passes.mutations import MutationFacts
from ..passes.roles import CACHE_WRITES


@dataclasses.dataclass(frozen=True)
class UndoPlan:
    """What a graph may write in place: (cache input, slot_mapping input) pairs saved by rows, and
    the other inputs written in place, saved whole (placeholder indices)."""

    rows: tuple[tuple[int, int], ...]
    whole: tuple[int, ...]

    @classmethod
    def of(cls, gm: fx.GraphModule, facts: MutationFacts, in_place: set[int]) -> UndoPlan:
        """The plan of `gm` (any variant: they share placeholders and cache writes) for the written
        inputs `in_place`; an input is saved by rows only where every write into it is a cache write
        whose cache argument is the input itself."""
        index = {node: i for i, node in enumerate(placeholders(gm))}
        pairs = set()
        for node in gm.graph.nodes:
            if any(is_op(node, op) for op in CACHE_WRITES):
                *_, first, second, slots = node.args
                pairs.update((index[c], index[slots]) for c in (first, second) if c in index and slots in index)
        unsafe = {w.input for w in facts.unsafe()}
        by_rows = {c for c, _ in pairs} - unsafe
        return cls(tuple(sorted(p for p in pairs if p[0] in by_rows and p[0] in in_place)),
                   tuple(sorted(in_place - by_rows)))

    def save(self, args: Sequence[Any]) -> Undo:
        """What the step's graph may overwrite, read now (before it runs). Slots are clamped into the
        cache: a slot past it is the cache write's to refuse, by name (a gather would fault first)."""
        if not self.rows and not self.whole:
            return Undo([], [])
        with torch.inference_mode():
            slots: dict[tuple[int, ...], Any] = {}
            rows = []
            whole = [(args[i], args[i].clone()) for i in self.whole if isinstance(args[i], torch.Tensor)]
            pending = list(self.rows)
            while pending:
                cache, slot = pending.pop(0)
                t = args[cache]
                if pending and pending[0][1] == slot:
                    pair = _halves(t, args[pending[0][0]])
                    if pair is not None:  # a layer's key and value halves of one allocation: one gather
                        pending.pop(0)
                        t = pair
                if t.dim() < 2:
                    whole.append((t, t.clone()))
                    continue
                capacity = t.shape[0] * t.shape[1]
                index = slots.get((slot, capacity))
                if index is None:
                    index = slots[(slot, capacity)] = args[slot].clamp(0, capacity - 1).long()
                if t.stride(0) == t.shape[1] * t.stride(1):  # [num_blocks * block_size, ...] is a view
                    view = t.flatten(0, 1)
                    rows.append((view, index, view.index_select(0, index)))
                else:  # a view of a larger cache (vLLM 0.23's [num_blocks, 2, ...]): by block and offset
                    where = slots.get((slot, capacity, t.shape[1]))
                    if where is None:  # shared by every cache of this block size the slots write
                        where = slots[(slot, capacity, t.shape[1])] = (index // t.shape[1], index % t.shape[1])
                    rows.append((t, where, t[where]))
        return Undo(rows, whole)


def _halves(key: Any, value: Any) -> torch.Tensor | None:
    """`key` and `value` as one view `[num_blocks, block_size, 2, ...]` where they are two halves of
    one allocation with the same layout, `value` a fixed distance after `key` (vLLM 0.23's
    `[num_blocks, 2, ...]` unbound, vLLM 0.33's page split), so that their rows are read and put back
    in one gather; None otherwise (separate tensors)."""
    if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)) or key.dim() < 3:
        return None
    if (key.shape != value.shape or key.stride() != value.stride() or key.dtype != value.dtype
            or key.device != value.device or key.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()):
        return None
    delta = value.storage_offset() - key.storage_offset()
    if delta <= 0:
        return None
    return key.as_strided((*key.shape[:2], 2, *key.shape[2:]), (*key.stride()[:2], delta, *key.stride()[2:]),
                          key.storage_offset())


class Undo:
    """A step's undo log: `restore` puts back what was saved."""

    def __init__(self, rows: list[tuple[torch.Tensor, Any, torch.Tensor]],
                 whole: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.rows = rows
        self.whole = whole

    def restore(self) -> None:
        """Every saved row and input back as it was (padding's duplicate row 0 carries one value)."""
        with torch.inference_mode():
            for target, contents in self.whole:
                target.copy_(contents)
            for target, where, contents in self.rows:
                if isinstance(where, tuple):
                    target[where] = contents
                else:
                    target.index_copy_(0, where, contents)
