"""Failed steps: what a compiled step that raises may have written, and what is put back.

A graph writes the caller's tensors in two ways: copied inputs (tokens, a caller's output buffer)
are written in their static buffers and reach the caller only by the copy-back after a successful
replay; inputs used in place (KV caches, buffers, parameters) are written by the graph itself,
layer by layer. A replay, a run op by op or a first-replay check that raises half-way has written
the rows of the layers before the failure.

What a serving runtime relies on, and what this keeps free of per-step work: by the cache write's
contract (`slot_mapping`) a step writes only its own tokens' slots of each KV cache; a runtime that
sees a step raise does not count its tokens as computed and runs them again, writing the same slots
anew (vLLM re-schedules them; no serving runtime saves KV rows per step). So by default nothing of
the caches is saved: a step that raises gets a note naming the sequences and the slots it may have
written (`UndoPlan.touched`, read only on that path), and no other row of any cache has changed.
Inputs a plain op writes in place (a step counter, a buffer written whole) have no such contract and
are rare and small: those are saved before every step and put back. `save_cache_rows=True` (tests,
the differential tester) saves the caches' rows too: each KV cache at the rows of its cache write's
slots (padding slots, -1, are read as row 0, so no host sync is needed to drop them), one gather per
cache written (`benchmarks/undo_cost.py`), put back if the step raises.

Everything that can fail before the first write (the graph key, its capture, the step's shapes,
the target's step guard) is checked before the graph runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import fx

from ..passes.fx_utils import is_op, placeholders
from ..passes.mutations import MutationFacts
from ..passes.roles import CACHE_WRITES
from .inputs import Step


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

    def failure_note(self, undo: Undo, args: Sequence[Any], step: Step) -> str:
        """What a step of `args` that raised may have left written, in a few words: nothing where `undo`
        put everything back; else its sequences and the cache slots their tokens own (read on this path
        only: the slots' host copy is a device read)."""
        if undo.rows or not self.rows:
            return "what it wrote in place is put back"
        values = sorted({v for _, slot in self.rows for v in args[slot].reshape(-1).tolist() if v >= 0})
        where = f"slots {values[0]}..{values[-1]} ({len(values)} slots)" if values else "no slot"
        starts = next(iter(step.query_start_loc.values()), None)
        queries = [b - a for a, b in zip(starts, starts[1:])] if starts else [1] * step.seqs
        shown = ", ".join(map(str, queries[:16])) + (", ..." if len(queries) > 16 else "")
        return (f"it may have written {len({c for c, _ in self.rows})} KV caches at its own {where}, for its "
                f"{step.seqs} sequences (query tokens {shown}), and no other row; run the same step again to "
                f"write them anew")

    def save(self, args: Sequence[Any], rows_wanted: bool) -> Undo:
        """What the step's graph may overwrite, read now (before it runs): the inputs written whole, and
        with `rows_wanted` each written cache at the step's slots. Slots are clamped into the cache: a slot
        past it is the cache write's to refuse, by name (a gather would fault first)."""
        if not (self.rows and rows_wanted) and not self.whole:
            return NOTHING_SAVED
        with torch.inference_mode():
            slots: dict[tuple[int, ...], Any] = {}
            rows = []
            whole = [(args[i], args[i].clone()) for i in self.whole if isinstance(args[i], torch.Tensor)]
            launches = len(whole)
            pending = list(self.rows) if rows_wanted else []
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
                    launches += 1
                    continue
                capacity = t.shape[0] * t.shape[1]
                index = slots.get((slot, capacity))
                if index is None:
                    index = slots[(slot, capacity)] = args[slot].clamp(0, capacity - 1).long()
                    launches += 2
                if t.stride(0) == t.shape[1] * t.stride(1):  # [num_blocks * block_size, ...] is a view
                    view = t.flatten(0, 1)
                    rows.append((view, index, view.index_select(0, index)))
                else:  # a view of a larger cache (vLLM 0.23's [num_blocks, 2, ...]): by block and offset
                    where = slots.get((slot, capacity, t.shape[1]))
                    if where is None:  # shared by every cache of this block size the slots write
                        where = slots[(slot, capacity, t.shape[1])] = (index // t.shape[1], index % t.shape[1])
                        launches += 2
                    rows.append((t, where, t[where]))
                launches += 1
        return Undo(rows, whole, launches)


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
                 whole: list[tuple[torch.Tensor, torch.Tensor]], launches: int) -> None:
        self.rows = rows
        self.whole = whole
        self.launches = launches  # the device ops the save issued, outside any graph

    @property
    def nbytes(self) -> int:
        """The bytes this log holds (what the step paid to save)."""
        return sum(c.numel() * c.element_size() for _, c in self.whole) + sum(
            c.numel() * c.element_size() for _, _, c in self.rows)

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


#: The log of a step that saves nothing (the default path), shared: it is never added to.
NOTHING_SAVED = Undo([], [], 0)
