"""Host-only models of a runtime's graph memory pool: what a sequence of allocations reserves.

Graph memory has to be known before it exists (vLLM sizes its KV cache before anything of ours is
captured: `integrations/vllm/memory.py`), and what a pool reserves is not what is allocated in it:
blocks are rounded, segments come in sizes, freed blocks are reused best fit. So a pool is modelled
by replaying the allocations and frees the captures will make over the simulator's own block
allocator without its memory (`sim.pool.SimPool(backed=False)`), with the device allocator's
segment sizes:

- the simulator: its graph pool exactly (`SimRuntime(segment_bytes=...)`);
- CUDA, c10's caching allocator (torch 2.14 `c10/core/AllocatorConfig.h`: blocks rounded to
  `kMinBlockSize` 512; requests up to `kSmallSize` 1 MiB from `kSmallBuffer` 2 MiB segments of a
  pool of their own; up to `kMinLargeAlloc` 10 MiB from `kLargeBuffer` 20 MiB segments; larger ones
  rounded up to `kRoundLarge` 2 MiB);
- Ascend, torch_npu 2.14's `NPUCachingAllocator` (`torch_npu/csrc/core/npu/NPUAllocatorConfig.h`:
  the same 2 MiB / 20 MiB / 10 MiB constants, large requests rounded up to `kAlignRoundLarge` 16 KB).

What the device allocators do beyond that (the `expandable_segments` and `roundup_power2_divisions`
settings, a block split only when what remains is over 1 MiB in the large pool) is not modelled:
the model is an estimate, compared with the measured pool after the captures (`memory.py`'s log).
"""
from __future__ import annotations

from typing import Any, Callable

from .sim.pool import SimPool

MIB = 1 << 20
#: c10 / torch_npu caching-allocator constants (see the module docstring).
SMALL_SIZE, SMALL_BUFFER, MIN_LARGE_ALLOC, LARGE_BUFFER = MIB, 2 * MIB, 10 * MIB, 20 * MIB
CUDA_ROUND_LARGE, NPU_ROUND_LARGE = 2 * MIB, 16 << 10


class PoolModel:
    """A graph pool as bookkeeping only: `allocate` / `release` in the order the captures make them,
    then `reserved_bytes`. Requests of up to `small_size` bytes (0: none) come from a pool of their
    own, as in the caching allocators."""

    def __init__(self, large: SimPool, small: SimPool | None = None, small_size: int = 0) -> None:
        self.large, self.small, self.small_size = large, small, small_size

    def allocate(self, nbytes: int) -> Any:
        pool = self.small if self.small is not None and nbytes <= self.small_size else self.large
        return pool, pool.allocate(nbytes)

    def release(self, handle: Any) -> None:
        pool, block = handle
        pool.release(block)

    def reserved_bytes(self) -> int:
        return sum(p.stats()["reserved_bytes"] for p in (self.large, self.small) if p is not None)


def sim_pool_model(segment_bytes: int) -> PoolModel:
    """The simulator's graph pool: its own allocator, segments of `segment_bytes`."""
    return PoolModel(SimPool("graph model", segment_bytes, backed=False))


def caching_allocator_model(round_large: int) -> PoolModel:
    """A device caching allocator's pool (see the module docstring), large requests rounded up to
    `round_large`."""
    def large_segment(size: int) -> int:
        return LARGE_BUFFER if size < MIN_LARGE_ALLOC else -(-size // round_large) * round_large

    small = SimPool("small model", SMALL_BUFFER, backed=False)
    return PoolModel(SimPool("large model", LARGE_BUFFER, backed=False, segment_size=large_segment), small, SMALL_SIZE)


#: What makes a fresh model of each device runtime's graph pool, by runtime name.
DEVICE_POOLS: dict[str, Callable[[], PoolModel]] = {
    "cuda": lambda: caching_allocator_model(CUDA_ROUND_LARGE),
    "npu": lambda: caching_allocator_model(NPU_ROUND_LARGE),
}


def pool_model(runtime: Any) -> PoolModel | None:
    """A fresh model of `runtime`'s graph pool (None for a runtime without graphs)."""
    if runtime.name == "sim":
        return sim_pool_model(runtime.describe()["segment_bytes"])
    make = DEVICE_POOLS.get(runtime.name)
    return make() if make is not None else None


def one_kernel(runtime: Any) -> Callable[[Any], bool]:
    """Whether a capture on `runtime` records a call of an op (overload) as one kernel: on the
    simulator its device kernels, any other op as the ops its body issues (`sim/dispatch.py`); on a
    device every op, which launches its kernels itself."""
    kernels = getattr(runtime, "device_kernels", None)
    return kernels.is_kernel if kernels is not None else (lambda op: True)
