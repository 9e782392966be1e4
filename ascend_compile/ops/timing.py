"""Time the attention kernels on a device, for the `auto` kernel policy."""
from __future__ import annotations

import time

import torch

from . import tiling


def time_kernel(
    kernel: str,
    shape: tiling.AttentionShape,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int = 3,
) -> float:
    """Median seconds of one decode call of `kernel` for `batch` sequences of `seq_len` tokens."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    blocks_per_seq = -(-seq_len // shape.block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    query = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen).to(device=device, dtype=dtype)
    lens = [seq_len] * batch
    out = torch.empty_like(query)
    workspace = torch.empty(tiling.workspace_nbytes(kernel, shape, lens), dtype=torch.uint8, device=device)
    scale = shape.head_dim**-0.5
    if kernel == tiling.PA:
        def call() -> None:
            torch.ops.ascend.paged_attention(query, key_cache, value_cache, block_table, lens, scale, workspace, out)
    else:
        ends = list(range(1, batch + 1))

        def call() -> None:
            torch.ops.ascend.fused_infer_attention(
                query, key_cache, value_cache, block_table, ends, lens, scale, workspace, out
            )
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
