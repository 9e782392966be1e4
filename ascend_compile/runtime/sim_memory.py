"""What the ACL-graph simulator (`runtime/sim.py`) does with its device memory.

`sim_pool.py` carves blocks out of segments; this module holds the rules the runtime applies on top:
an allocation comes from the graph pool during a capture and from the general pool otherwise; every
block a capture allocated is remembered and poisoned (0xFF bytes: NaN, -1) when the capture ends, so
nothing can depend on capture-time values; `locate` finds where a tensor lives (None for memory that
is not the simulator's: a parameter, a user's KV cache), and `describe` turns a tensor operand into
the address (`_MemRef`) a task records instead of it. Kept apart from `sim.py` so the runtime there
reads as the capture / replay / update protocol and the memory rules read here in one place.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .sim_pool import Segment, SimPool, extent_bytes
from .sim_tasks import _MemRef, _is_cpu_dense


def _region(ref: _MemRef) -> tuple[Segment, int, int]:
    """(segment, offset, bytes) an operand spans."""
    return ref.segment, ref.offset, extent_bytes(ref.shape, ref.stride, ref.dtype)


class SimMemory:
    """The simulator's two pools ("general", "graph") and the blocks the current capture allocated."""

    def __init__(self, segment_bytes: int) -> None:
        self.general = SimPool("general", segment_bytes)
        self.graph = SimPool("graph", segment_bytes)
        self.captured_blocks: list[tuple[Segment, int, int]] = []

    def allocate(
        self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, capturing: bool
    ) -> torch.Tensor:
        """A tensor over a fresh block: from the graph pool (and remembered) while `capturing`."""
        pool = self.graph if capturing else self.general
        block = pool.allocate(extent_bytes(shape, stride, dtype))
        if capturing:
            self.captured_blocks.append((block.segment, block.offset, block.size))
        return pool.tensor(block, shape, stride, dtype)

    def like(self, t: torch.Tensor, capturing: bool) -> torch.Tensor:
        """A fresh tensor of `t`'s shape, stride and dtype (`t` itself if it is not dense CPU memory)."""
        if not _is_cpu_dense(t):
            return t
        return self.allocate(tuple(t.shape), t.stride(), t.dtype, capturing)

    def locate(self, t: torch.Tensor) -> Optional[tuple[Segment, int]]:
        """(segment, byte offset) of `t`'s first element, or None if it is not simulator memory."""
        if not _is_cpu_dense(t):
            return None
        ptr = t.data_ptr()
        return self.general.locate(ptr) or self.graph.locate(ptr)

    def describe(self, x: Any) -> Any:
        """`x` as a task operand: a tensor in simulator memory becomes its address, anything else stays."""
        if not isinstance(x, torch.Tensor):
            return x
        where = self.locate(x)
        if where is None:
            return x
        return _MemRef(where[0], where[1], x.dtype, tuple(x.shape), x.stride())

    def poison_captured(self) -> list[tuple[Segment, int, int]]:
        """Fill every block the capture allocated with 0xFF and forget them; returns them. Call
        outside any dispatch mode."""
        blocks, self.captured_blocks = self.captured_blocks, []
        for segment, offset, size in blocks:
            segment.data[offset : offset + size].fill_(0xFF)
        return blocks

    def stats(self) -> dict[str, dict[str, int]]:
        """Per pool: reserved_bytes, allocated_bytes, segments, free_blocks."""
        return {pool.name: pool.stats() for pool in (self.general, self.graph)}
