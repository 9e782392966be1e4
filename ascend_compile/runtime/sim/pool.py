"""Simulated device memory of the ACL-graph simulator: segments carved into blocks.

A device graph replays at the addresses it was captured at, and the bugs the simulator exists to
reproduce depend on where blocks land: a workspace freed during capture is handed to a later
allocation of the same capture, and a kernel that overruns its workspace writes into whatever block
lies next to it. So memory is not one CPU tensor per allocation; it is carved, like a caching
allocator carves device segments, out of large uint8 CPU tensors (**segments**) into 512-byte aligned
**blocks** (best fit, split, coalesced on free).

Source: a capture allocates from its graph's private pool, whose blocks freed during the capture serve
later allocations of it (PyTorch's CUDA semantics notes, "Graph memory management", the section
torch_npu 2.14's `npu/graphs.py` refers to for its pools); vLLM-Ascend hit exactly that with a
weak-referenced workspace (DESIGN.md §7, case 3). Blocks are multiples of 512 bytes, the caching
allocators' smallest block.

Every tensor handed out owns its block through its storage: the storage is created over the block's
bytes with `torch.frombuffer`, so every view of it (made under capture or not, or saved by autograd)
keeps the block allocated, and when the last one dies the block returns to its pool. The memory is
not cleared, exactly as with a caching allocator.
"""
from __future__ import annotations

import bisect
import ctypes
import threading
import weakref
from typing import Callable, Optional

import torch

#: Alignment and granularity of every block, as on the device allocators.
ALIGNMENT = 512


def round_up(nbytes: int) -> int:
    """Size of the block that holds `nbytes` (at least one alignment unit)."""
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


def extent_bytes(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes a tensor of this shape and stride spans from its first element."""
    if any(s == 0 for s in shape):
        return 0
    last = sum((n - 1) * st for n, st in zip(shape, stride))
    return (last + 1) * dtype.itemsize


class Segment:
    """One large chunk of simulated device memory, a uint8 CPU tensor."""

    def __init__(self, pool: SimPool, index: int, nbytes: int) -> None:
        self.pool = pool
        self.index = index
        self.size = nbytes
        self.data = torch.empty(nbytes if pool.backed else 0, dtype=torch.uint8, device="cpu")
        self.base = self.data.data_ptr()

    def view(
        self, offset: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]
    ) -> torch.Tensor:
        """A tensor at byte `offset` of this segment that does not own any block.

        Used for replay-time operands and weak aliases: the memory is the graph's (or nobody's),
        so holding the tensor must not keep a block allocated.
        """
        if offset % dtype.itemsize:
            raise ValueError(f"offset {offset} is not aligned to {dtype}")
        return torch.empty(0, dtype=dtype, device="cpu").set_(
            self.data.untyped_storage(), offset // dtype.itemsize, shape, stride
        )

    def __repr__(self) -> str:
        return f"Segment({self.pool.name}#{self.index}, {self.size} bytes)"


#: A region of simulated memory: (segment, byte offset, bytes).
Region = tuple[Segment, int, int]


class Block:
    """A run of bytes of one segment, free or allocated; neighbours are linked for coalescing."""

    __slots__ = ("segment", "offset", "size", "free", "prev", "next")

    def __init__(self, segment: Segment, offset: int, size: int) -> None:
        self.segment = segment
        self.offset = offset
        self.size = size
        self.free = True
        self.prev: Optional[Block] = None
        self.next: Optional[Block] = None

    def key(self) -> tuple[int, int, int]:
        """Best-fit order: smallest block first, then lowest address."""
        return (self.size, self.segment.index, self.offset)


class SimPool:
    """A pool of simulated device memory: segments grown on demand, best-fit blocks.

    `segment_bytes` is the size of each new segment; a request larger than that gets a segment of
    its own (`segment_size`, given, says instead how large a segment a request of a size gets:
    `runtime/pool_model.py`'s device allocators). Frees may arrive at any time (a tensor dying in
    another thread or in the garbage collector while this pool is allocating), so they are queued
    while the pool is busy. `backed=False` keeps the bookkeeping without the memory: a model of
    the pool that only counts (`pool_model.py`), whose blocks cannot be made into tensors.
    """

    def __init__(self, name: str, segment_bytes: int, backed: bool = True,
                 segment_size: Optional[Callable[[int], int]] = None) -> None:
        if segment_bytes <= 0 or segment_bytes % ALIGNMENT:
            raise ValueError(f"segment_bytes must be a positive multiple of {ALIGNMENT}, got {segment_bytes}")
        self.name = name
        self.segment_bytes = segment_bytes
        self.backed = backed
        self.segment_size = segment_size or (lambda size: max(segment_bytes, size))
        self.segments: list[Segment] = []
        self._free: list[tuple[int, int, int]] = []
        self._free_blocks: dict[tuple[int, int, int], Block] = {}
        self._allocated = 0
        self._lock = threading.RLock()
        self._busy = False
        self._deferred: list[Block] = []

    def allocate(self, nbytes: int) -> Block:
        """Reserve a block of at least `nbytes` bytes (best fit; a new segment if none fits)."""
        size = round_up(nbytes)
        with self._lock:
            self._busy = True
            try:
                i = bisect.bisect_left(self._free, (size, -1, -1))
                if i == len(self._free):
                    self._add_segment(self.segment_size(size))
                    i = bisect.bisect_left(self._free, (size, -1, -1))
                block = self._take(self._free[i])
                if block.size > size:
                    rest = Block(block.segment, block.offset + size, block.size - size)
                    rest.prev, rest.next = block, block.next
                    if block.next is not None:
                        block.next.prev = rest
                    block.next = rest
                    block.size = size
                    self._put(rest)
                block.free = False
                self._allocated += block.size
            finally:
                self._busy = False
            self._drain()
        return block

    def release(self, block: Block) -> None:
        """Return `block` to the pool, merged with free neighbours. Its bytes are left as they are."""
        with self._lock:
            self._deferred.append(block)
            if not self._busy:
                self._drain()

    def tensor(
        self, block: Block, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A tensor over `block` that owns it: the block is released when its storage dies."""
        if not self.backed:
            raise RuntimeError(f"{self.name}: a pool model without memory (backed=False) makes no tensors")
        buf = (ctypes.c_uint8 * block.size).from_address(block.segment.base + block.offset)
        weakref.finalize(buf, self.release, block).atexit = False
        t = torch.frombuffer(buf, dtype=dtype)
        return t.set_(t.untyped_storage(), 0, shape, stride)

    def stats(self) -> dict[str, int]:
        """Bytes reserved (segments) and allocated (live blocks), and the counts behind them."""
        with self._lock:
            return {
                "reserved_bytes": sum(s.size for s in self.segments),
                "allocated_bytes": self._allocated,
                "segments": len(self.segments),
                "free_blocks": len(self._free),
            }

    def locate(self, ptr: int) -> Optional[tuple[Segment, int]]:
        """The segment holding address `ptr` and the byte offset in it, or None if not this pool's."""
        for segment in self.segments:
            if segment.base <= ptr < segment.base + segment.size:
                return segment, ptr - segment.base
        return None

    def _drain(self) -> None:
        with self._lock:
            if self._busy:
                return
            self._busy = True
            try:
                while self._deferred:
                    self._release(self._deferred.pop())
            finally:
                self._busy = False

    def _release(self, block: Block) -> None:
        if block.free:
            raise RuntimeError(f"double free of {self.name} block at {block.segment.index}+{block.offset}")
        block.free = True
        self._allocated -= block.size
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:
            self._take(prev.key())
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and nxt.free:
            self._take(nxt.key())
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        self._put(block)

    def _add_segment(self, nbytes: int) -> None:
        segment = Segment(self, len(self.segments), nbytes)
        self.segments.append(segment)
        self._put(Block(segment, 0, nbytes))

    def _put(self, block: Block) -> None:
        key = block.key()
        bisect.insort(self._free, key)
        self._free_blocks[key] = block

    def _take(self, key: tuple[int, int, int]) -> Block:
        del self._free[bisect.bisect_left(self._free, key)]
        return self._free_blocks.pop(key)

    def __repr__(self) -> str:
        return f"SimPool({self.name!r}, {self.stats()})"
