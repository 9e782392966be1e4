"""The attention kernels on Ascend: bindings to torch_npu 2.14, and their workspace queries.

PA runs as `torch_npu._npu_paged_attention` (ATB) and FIA as
`torch_npu.npu_fused_infer_attention_score.out` (aclnn), each called with exactly the argument names
and order of the schemas in the torch_npu 2.14 wheel (`tests/fixtures/torch_npu_2_14_schemas.txt`):

- PA: `(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
  context_lens, out, *, workspace=)`, `context_lens` a CPU int32 tensor (ATB reads it on the host);
  `workspace` is keyword-only.
- FIA: TND layout, K/V caches viewed as `[num_blocks, block_size, KVH*D]`, `block_table` and
  `block_size` (paged KV), `actual_seq_lengths` cumulative query ends (last == T),
  `actual_seq_lengths_kv` per-sequence lengths, `sparse_mode=3` (rightDownCausal: each sequence's
  query tokens are the last of its KV, causal among themselves) with the 2048x2048 mask that mode
  requires, `workspace=`, and `out=[attention_out, softmax_lse]` (the registered overload takes `out`
  as a list).

Ascend gives no formula for the workspace these kernels need, only queries
(`_npu_paged_attention_get_workspace`, `_npu_fused_infer_attention_score_get_max_workspace`) that
answer for given host lengths. `NpuWorkspaceQuery` asks them; `passes.probe.ProbedWorkspaceNeed`
asks it at compile time over a set of lengths and keeps the maximum and the length that needs it;
nothing is queried or allocated at replay.

torch_npu is imported lazily, by `load_torch_npu`: importing this module needs no NPU.
"""
from __future__ import annotations

import importlib
import time
from types import ModuleType
from typing import Any, Callable, Sequence

import torch

from . import library, tiling
from .tiling import AttentionShape

#: FIA's sparse_mode for causal attention whose queries end their sequence (rightDownCausal).
FIA_SPARSE_MODE = 3
#: The side of the optimised causal mask FIA's sparse modes 2-4 take.
FIA_MASK_SIZE = 2048


def load_torch_npu() -> ModuleType:
    """Import torch_npu (which also installs `torch.npu`), with an error saying what is missing."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as err:
        raise ImportError(
            "runtime: 'npu' needs torch_npu (pip install torch-npu matching your torch and CANN; "
            "see docs/ascend.md)"
        ) from err


def fia_causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 mask of FIA sparse_mode 3: True above the diagonal (masked out)."""
    return torch.triu(torch.ones(FIA_MASK_SIZE, FIA_MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)


def paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: Sequence[int],
    scale: float,
    out: torch.Tensor,
) -> tuple[Any, ...]:
    """The positional arguments of `_npu_paged_attention` and of its workspace query."""
    lens = torch.tensor(list(context_lens), dtype=torch.int32)
    return (
        query, key_cache, value_cache, int(key_cache.shape[2]), int(query.shape[1]), float(scale),
        block_table, lens, out,
    )


def fused_infer_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    actual_seq_lengths: Sequence[int],
    actual_seq_lengths_kv: Sequence[int],
    scale: float,
    atten_mask: torch.Tensor,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments of `npu_fused_infer_attention_score` (TND, paged KV), in
    schema order, shared by the `.out` call and the workspace query."""
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    key = key_cache.view(num_blocks, block_size, kv_heads * head_dim)
    value = value_cache.view(num_blocks, block_size, kv_heads * head_dim)
    kwargs = {
        "atten_mask": atten_mask,
        "actual_seq_lengths": [int(n) for n in actual_seq_lengths],
        "actual_seq_lengths_kv": [int(n) for n in actual_seq_lengths_kv],
        "block_table": block_table,
        "num_heads": int(query.shape[1]),
        "scale": float(scale),
        "input_layout": "TND",
        "num_key_value_heads": int(kv_heads),
        "sparse_mode": FIA_SPARSE_MODE,
        "block_size": int(block_size),
    }
    return (query, key, value), kwargs


class NpuKernels:
    """The `ascend` kernel ops bound to torch_npu on one device: what `NpuRuntime.kernel` returns.

    The calls match the ops' signatures, so capture and task updates issue them in place of the ops.
    The constant tensors they pass (FIA's causal mask, and the `[1]` softmax_lse FIA writes when
    `softmax_lse_flag` is False) are made once, here, outside any capture: a tensor first made inside
    a capture would be uninitialised for every other graph, and one made during a task update would be
    freed while the updated task still points at it.
    """

    def __init__(self, torch_npu: ModuleType, device: torch.device) -> None:
        self.torch_npu = torch_npu
        self.device = torch.device(device)
        self.atten_mask = fia_causal_mask(self.device)
        self.softmax_lse = torch.empty(1, dtype=torch.float32, device=self.device)

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: list[int],
        scale: float,
        workspace: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """`ascend.paged_attention` as `torch_npu._npu_paged_attention` with a caller workspace."""
        library.check_paged_attention(
            query, key_cache, value_cache, block_table, context_lens, workspace, out, check_data=False
        )
        args = paged_attention_args(query, key_cache, value_cache, block_table, context_lens, scale, out)
        self.torch_npu._npu_paged_attention(*args, workspace=workspace)

    def fused_infer_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        actual_seq_lengths: list[int],
        actual_seq_lengths_kv: list[int],
        scale: float,
        workspace: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """`ascend.fused_infer_attention` as `torch_npu.npu_fused_infer_attention_score.out`."""
        library.check_fused_infer_attention(
            query, key_cache, value_cache, block_table, actual_seq_lengths, actual_seq_lengths_kv,
            workspace, out, check_data=False,
        )
        args, kwargs = fused_infer_attention_args(
            query, key_cache, value_cache, block_table, actual_seq_lengths, actual_seq_lengths_kv, scale,
            self.atten_mask,
        )
        self.torch_npu.npu_fused_infer_attention_score.out(
            *args, **kwargs, workspace=workspace, out=[out, self.softmax_lse]
        )

    def workspace_nbytes(
        self,
        kernel: str,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        query_ends: Sequence[int],
        kv_lens: Sequence[int],
        scale: float,
        out: torch.Tensor,
    ) -> int:
        """Bytes `kernel` needs for these host lengths, from torch_npu's workspace query.

        Both queries return a 1-D tensor whose element count is the byte size (FIA's has the query's
        dtype: only its length means anything)."""
        if kernel == tiling.PA:
            args = paged_attention_args(query, key_cache, value_cache, block_table, kv_lens, scale, out)
            return int(self.torch_npu._npu_paged_attention_get_workspace(*args).numel())
        if kernel == tiling.FIA:
            args, kwargs = fused_infer_attention_args(
                query, key_cache, value_cache, block_table, query_ends, kv_lens, scale, self.atten_mask
            )
            return int(self.torch_npu._npu_fused_infer_attention_score_get_max_workspace(*args, **kwargs).numel())
        raise ValueError(f"kernel: expected {tiling.PA!r} or {tiling.FIA!r}, got {kernel!r}")

    def call(self, kernel: str, *args: Any) -> None:
        """Run `kernel` ("paged_attention" or "fused_infer_attention") with the ascend op's arguments."""
        if kernel == tiling.PA:
            self.paged_attention(*args)
        elif kernel == tiling.FIA:
            self.fused_infer_attention(*args)
        else:
            raise ValueError(f"kernel: expected {tiling.PA!r} or {tiling.FIA!r}, got {kernel!r}")


class NpuWorkspaceQuery:
    """Asks torch_npu's workspace queries for host lengths, on probe tensors of a given dtype.

    A `passes.probe.WorkspaceQuery`: `(kernel, shape, query_lens, kv_lens, max_blocks) -> bytes`.
    The probe tensors are small: the queries read no tensor data, so every block-table row
    (`max_blocks` wide, like the runner's static block table) points at the same blocks of a
    cache sized for one sequence of `max_blocks` blocks (made once per shape). Used at compile
    time only.
    """

    def __init__(self, kernels: NpuKernels, dtype: torch.dtype) -> None:
        self.kernels = kernels
        self.dtype = dtype
        self._caches: dict[tuple[AttentionShape, int], torch.Tensor] = {}

    def __call__(
        self, kernel: str, shape: AttentionShape, query_lens: Sequence[int], kv_lens: Sequence[int], max_blocks: int
    ) -> int:
        device = self.kernels.device
        tokens, num_seqs = sum(query_lens), len(kv_lens)
        cache = self._caches.get((shape, max_blocks))
        if cache is None:
            cache = self._caches[(shape, max_blocks)] = torch.empty(
                (max_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim), dtype=self.dtype, device=device
            )
        block_table = torch.arange(max_blocks, dtype=torch.int32, device=device).repeat(num_seqs, 1)
        query = torch.empty(tokens, shape.num_heads, shape.head_dim, dtype=self.dtype, device=device)
        ends, total = [], 0
        for n in query_lens:
            total += n
            ends.append(total)
        return self.kernels.workspace_nbytes(
            kernel, query, cache, cache, block_table, ends, kv_lens, shape.head_dim**-0.5, torch.empty_like(query)
        )


def time_kernel(
    kernels: NpuKernels,
    synchronize: Callable[[], None],
    kernel: str,
    shape: AttentionShape,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    repeats: int = 3,
) -> float:
    """Median seconds of one decode call of the torch_npu `kernel` for `batch` sequences of
    `seq_len` tokens, for the "auto" kernel policy (`synchronize` waits for the device)."""
    device = kernels.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    blocks_per_seq = -(-seq_len // shape.block_size)
    cache_shape = (batch * blocks_per_seq, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    block_table = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    query = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty_like(query)
    lens, ends = [seq_len] * batch, list(range(1, batch + 1))
    scale = shape.head_dim**-0.5
    nbytes = kernels.workspace_nbytes(kernel, query, key_cache, value_cache, block_table, ends, lens, scale, out)
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = (lens,) if kernel == tiling.PA else (ends, lens)
    args = (query, key_cache, value_cache, block_table, *host, scale, workspace, out)
    kernels.call(kernel, *args)
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        kernels.call(kernel, *args)
        synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
