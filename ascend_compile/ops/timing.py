"""Time the attention kernels on a device, for the `auto` kernel policy (on CUDA, the device-length
ops that CUDA graphs run)."""
from __future__ import annotations

import time
from typing import Callable

import torch

from .. import ledger, plan_cache
from . import cuda, tiling


@plan_cache.remembered("kernel_timing")
@ledger.timed("kernel_timing")
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
    scale = shape.head_dim**-0.5
    if device.type == "cuda":
        call = _device_length_call(kernel, shape, query, key_cache, value_cache, block_table, seq_len, scale, out)
    else:
        workspace = torch.empty(tiling.workspace_nbytes(kernel, shape, lens), dtype=torch.uint8, device=device)
        ends = list(range(1, batch + 1))

        def call() -> None:
            if kernel == tiling.PA:
                torch.ops.ascend.paged_attention(query, key_cache, value_cache, block_table, lens, scale, workspace, out)
            else:
                torch.ops.ascend.fused_infer_attention(
                    query, key_cache, value_cache, block_table, ends, lens, scale, workspace, out
                )
    synchronize = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return median_seconds(call, synchronize, warmup=1, iters=repeats)


def median_seconds(run: Callable[[], object], synchronize: Callable[[], object], warmup: int, iters: int) -> float:
    """Median wall-clock seconds of `run()` over `iters` timed calls, after `warmup` untimed ones.

    Each timed call is bracketed by `synchronize()` (waiting for the device), so it measures the
    work `run` queued and not only its launch. The one timing loop of the package: `time_kernel`
    here and `ops.npu.kernels.time_kernel` both use it.
    """
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _device_length_call(
    kernel: str,
    shape: tiling.AttentionShape,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    out: torch.Tensor,
) -> Callable[[], None]:
    """On CUDA, one call of the device-length op that CUDA graphs run for `kernel` (its Triton
    kernel), split for `seq_len` as bucket graphs are split for `max_model_len`."""
    batch, device = query.shape[0], query.device
    splits = cuda.choose_num_splits(batch * shape.num_kv_heads, seq_len, shape.block_size, cuda.device_sm_count(device))
    workspace = torch.empty(cuda.dev_workspace_nbytes(batch, shape, splits), dtype=torch.uint8, device=device)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    if kernel == tiling.PA:
        return lambda: torch.ops.ascend.paged_attention_dev(
            query, key_cache, value_cache, block_table, seq_lens, scale, workspace, out, splits
        )
    start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return lambda: torch.ops.ascend.fused_infer_attention_dev(
        query, key_cache, value_cache, block_table, start_loc, seq_lens, scale, workspace, out, splits
    )
