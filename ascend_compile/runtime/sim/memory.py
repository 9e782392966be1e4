"""What the ACL-graph simulator does with its device memory.

`pool.py` carves blocks out of segments; this module holds the rules the runtime applies on top:
an allocation comes from the graph pool during a capture and from the general pool otherwise
(source: a capture allocates from its graph's private pool, `torch.npu.graph_pool_handle` and the
`pool` argument of `NPUGraph.capture_begin`, torch_npu 2.14 `npu/graphs.py`); every block a capture
allocated is remembered and poisoned (0xFF bytes: NaN, -1) when the capture ends, so nothing can
depend on capture-time values (a model, kept because no source promises that what a capture
computed survives it: later work and later captures sharing the pool overwrite it); `locate` finds where a tensor lives (None for memory that
is not the simulator's: a parameter, a user's KV cache), and `describe` turns a tensor operand into
the address (`MemRef`) a task records instead of it. Kept apart from the runtime so that it reads as
the capture / replay / update protocol and the memory rules read here in one place.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .classify import is_cpu_dense
from .pool import Region, Segment, SimPool, extent_bytes


class MemRef:
    """Where a tensor operand of a task lives in simulated memory: what a task stores instead of it."""

    __slots__ = ("segment", "offset", "dtype", "shape", "stride")

    def __init__(
        self, segment: Segment, offset: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]
    ) -> None:
        self.segment = segment
        self.offset = offset
        self.dtype = dtype
        self.shape = shape
        self.stride = stride

    def resolve(self) -> torch.Tensor:
        """A tensor at this address that does not own the memory (the graph uses it, it doesn't own it)."""
        return self.segment.view(self.offset, self.dtype, self.shape, self.stride)

    def region(self) -> Region:
        """(segment, offset, bytes) the operand spans."""
        return self.segment, self.offset, extent_bytes(self.shape, self.stride, self.dtype)

    def __repr__(self) -> str:
        return f"<{self.segment.pool.name}#{self.segment.index}+{self.offset:#x} {self.dtype} {list(self.shape)}>"


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`."""
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


class SimMemory:
    """The simulator's two pools ("general", "graph") and the blocks the current capture allocated."""

    def __init__(self, segment_bytes: int) -> None:
        self.general = SimPool("general", segment_bytes)
        self.graph = SimPool("graph", segment_bytes)
        self.captured_blocks: list[Region] = []

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
        if not is_cpu_dense(t):
            return t
        return self.allocate(tuple(t.shape), t.stride(), t.dtype, capturing)

    def locate(self, t: torch.Tensor) -> Optional[tuple[Segment, int]]:
        """(segment, byte offset) of `t`'s first element, or None if it is not simulator memory."""
        if not is_cpu_dense(t):
            return None
        ptr = t.data_ptr()
        return self.general.locate(ptr) or self.graph.locate(ptr)

    def describe(self, x: Any) -> Any:
        """`x` as a task operand: a tensor in simulator memory becomes its address, an empty dense
        tensor (no element, no address: `data_ptr()` is 0) an empty one of its shape that holds no
        memory, anything else stays. A device task records addresses, never the tensors: keeping an
        empty view would keep the block of the tensor it views allocated for the graph's life."""
        if not isinstance(x, torch.Tensor):
            return x
        if x.numel() == 0 and is_cpu_dense(x):
            return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype)
        where = self.locate(x)
        if where is None:
            return x
        return MemRef(where[0], where[1], x.dtype, tuple(x.shape), x.stride())

    def poison_captured(self) -> list[Region]:
        """Fill every block the capture allocated with 0xFF and forget them; returns them. Call
        outside any dispatch mode."""
        blocks, self.captured_blocks = self.captured_blocks, []
        for segment, offset, size in blocks:
            segment.data[offset : offset + size].fill_(0xFF)
        return blocks

    def stats(self) -> dict[str, dict[str, int]]:
        """Per pool: reserved_bytes, allocated_bytes, segments, free_blocks."""
        return {pool.name: pool.stats() for pool in (self.general, self.graph)}
