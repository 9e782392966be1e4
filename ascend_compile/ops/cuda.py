"""The device-length attention ops, and the CUDA kernels (Triton) of the `ascend` ops.

PA and FIA of the contract take host-side lengths, which a device graph freezes at capture (Ascend
refreshes them with task updates). A CUDA graph has no task updates, so on CUDA the kernels read
lengths from device buffers instead and a captured graph stays correct for every length:

- `ascend.paged_attention_dev(query, key_cache, value_cache, block_table, seq_lens, scale, workspace, out, num_splits)`
- `ascend.fused_infer_attention_dev(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, workspace, out, num_splits, window=None, soft_cap=None, sinks=None)`

`seq_lens [B]` and `query_start_loc [B+1]` are int32 device tensors with the meaning they have in
`ascend.attention` (the reference kernels check their values; the CUDA kernels cannot without a
host sync, so there `query_start_loc[B]` must be T and lengths must fit the block table).
`num_splits` (S), fixed on the host per bucket graph, is the split-K capacity: S partial records
per query token, so the workspace is fixed too, `dev_workspace_nbytes` (none with S == 1). How
the capacity is spent is the kernel's choice: the reference kernels split every sequence S ways;
the CUDA kernels decide on the device from the lengths (`ops/cuda_triton.py`): decode spreads
the `B * S` records over the sequences in proportion to their lengths (a long sequence among
short ones gets far more than S splits), FIA uses up to S splits per sequence. The result is the
same either way. FIA takes the attention features of `ops/features.py` (PA none, as on Ascend): a
window bounds the keys read to each sequence's span, not the workspace, the same for every length.

Their default kernels (CPU and any other device) are the reference split-K kernels with that split
count, reading the lengths on the host. For CUDA tensors this module registers Triton kernels
(`ops/cuda_triton.py`, imported on first use, so the package imports without triton) for these
two ops, for `ascend.reshape_and_cache` and for the unified `ascend.attention`; none of them
synchronises with the host, so each can be captured in a CUDA graph. MLA's device-length op and
CUDA kernels are `ops/cuda_mla.py`'s; its split rule (`gpu_splits`) and tiles (`mla_tile`) are here.
"""
from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType
from typing import Callable, Optional

import torch

from ..errors import WorkspaceTooSmall
from . import library, reference, tiling, validate

#: Each split covers at least this many KV tokens (and at least one block) of `max_model_len`.
MIN_SPLIT_TOKENS = 256
#: Upper bound on the split count of one call.
MAX_SPLITS = 32
#: Programs per streaming multiprocessor the split count aims for.
PROGRAMS_PER_SM = 2
#: The least split capacity of a PA (decode) graph whose lengths allow two splits: spare records
#: let the device schedule rebalance uneven batches even when the batch alone fills the GPU
#: (a uniform batch then still runs one split per sequence). Costs `B * 2 * H * (D + 1) * 4` bytes.
PA_MIN_SPLITS = 2

#: Rows (query heads x tokens) of one program of the MLA kernels (`ops/cuda_triton_mla.py`): the
#: smallest `tl.dot` operand; more would spill their 512-wide accumulator.
MLA_TILE_ROWS = 16

#: The split count of a kernel node in a bucket graph: (kernel, shape, bucket tokens) -> splits.
SplitsFn = Callable[[str, tiling.AttentionShape, int], int]


def mla_tile(num_heads: int, rows: int = MLA_TILE_ROWS) -> tuple[int, int]:
    """(heads per program, query tokens per tile) of the MLA kernels: every head when they fit in
    `rows` (then as many query tokens of a sequence as fill the rows), else `rows` heads of one token."""
    heads = min(num_heads, rows)
    return heads, max(1, rows // heads)


def mla_head_groups(num_heads: int, rows: int = MLA_TILE_ROWS) -> int:
    """Programs of the MLA kernels per query tile and split: head groups, each reading the keys once."""
    return -(-num_heads // mla_tile(num_heads, rows)[0])


def dev_workspace_nbytes(num_tokens: int, shape: tiling.AttentionShape, num_splits: int) -> int:
    """Workspace bytes of a device-length op: float32 partials and log-sum-exps of every split of
    every query token, `num_tokens * num_splits * H * (D + 1) * 4`, or 0 with one split (the
    kernel then writes its output directly). The same for every sequence length."""
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: expected a positive int, got {num_splits!r}")
    if num_splits == 1:
        return 0
    return num_tokens * num_splits * tiling.split_record_nbytes(shape)


def choose_num_splits(
    num_programs: int, max_len: int, block_size: int, num_sms: int, min_splits: int = 1
) -> int:
    """The split count for a call of `num_programs` programs per split over lengths up to `max_len`.

    Enough splits that the launch fills every SM `PROGRAMS_PER_SM` times over (and at least
    `min_splits`), but no split shorter than `MIN_SPLIT_TOKENS` tokens (nor a block) of `max_len`,
    and at most `MAX_SPLITS`.
    """
    for name, value in (("num_programs", num_programs), ("max_len", max_len), ("block_size", block_size),
                        ("num_sms", num_sms)):
        if value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value}")
    wanted = max(math.ceil(PROGRAMS_PER_SM * num_sms / num_programs), min_splits)
    longest = max(1, math.ceil(max_len / max(block_size, MIN_SPLIT_TOKENS)))
    return max(1, min(wanted, longest, MAX_SPLITS))


def gpu_splits(num_sms: int, max_model_len: int) -> SplitsFn:
    """The split rule of bucket graphs on a GPU with `num_sms` SMs: one program per sequence and
    KV head (MLA: head group, `mla_head_groups`) per split, a bucket of `bucket` tokens serving as
    many sequences; PA graphs get at least `PA_MIN_SPLITS` (spare capacity for the device schedule
    to rebalance)."""

    def splits(kernel: str, shape: tiling.AttentionShape, bucket: int) -> int:
        least = PA_MIN_SPLITS if kernel == tiling.PA else 1
        per_split = mla_head_groups(shape.num_heads) if shape.latent else shape.num_kv_heads
        return choose_num_splits(bucket * per_split, max_model_len, shape.block_size, num_sms, least)

    return splits


@functools.lru_cache(maxsize=None)
def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def triton_kernels(module: str = "cuda_triton") -> ModuleType:
    """A Triton kernel module of this package (`cuda_triton`, `cuda_triton_mla`), imported on first
    use so the package imports without triton."""
    try:
        return importlib.import_module(f"{__package__}.{module}")
    except ImportError as err:
        raise RuntimeError(
            f"ascend CUDA kernels need triton, which could not be imported ({err}); install it with the "
            f"version matching your torch"
        ) from err


def check_dev_attention(
    kernel: str,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    workspace: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
) -> None:
    """The checks of a device-length op that read no device data (so they cost no host sync)."""
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected a 1-D [B] torch.int32 tensor, got shape {tuple(seq_lens.shape)}")
    num_seqs = seq_lens.shape[0]
    validate.check_int32_vector("seq_lens", seq_lens, num_seqs, query.device)
    if query_start_loc is not None:
        validate.check_int32_vector("query_start_loc", query_start_loc, num_seqs + 1, query.device)
    validate.check_attention_tensors(query, key_cache, value_cache, block_table, num_seqs)
    if query_start_loc is None and query.shape[0] != num_seqs:
        raise ValueError(
            f"query: PA is decode-only and expects one query token per sequence ({num_seqs} seq_lens), "
            f"got {query.shape[0]} tokens"
        )
    library._check_out(query, workspace, out)
    needed = dev_workspace_nbytes(query.shape[0], tiling.AttentionShape.of(query, key_cache), num_splits)
    if workspace.numel() < needed:
        raise WorkspaceTooSmall(kernel, needed, workspace.numel())


@torch.library.custom_op("ascend::paged_attention_dev", mutates_args=("workspace", "out"))
def paged_attention_dev(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
) -> None:
    """PA reading `seq_lens` from a device tensor, with `num_splits` fixed splits (reference kernel)."""
    check_dev_attention(tiling.PA, query, key_cache, value_cache, block_table, seq_lens, None, workspace, out, num_splits)
    lens = seq_lens.tolist()
    library.check_paged_attention(query, key_cache, value_cache, block_table, lens, workspace, out)
    num = query.shape[0]
    reference.split_k_attention(
        tiling.PA, query, key_cache, value_cache, block_table, list(range(num)), [1] * num, lens,
        scale, workspace, out, num_splits=num_splits,
    )


@paged_attention_dev.register_fake
def _(query, key_cache, value_cache, block_table, seq_lens, scale, workspace, out, num_splits) -> None:
    return None


@paged_attention_dev.register_kernel("cuda")
def _(query, key_cache, value_cache, block_table, seq_lens, scale, workspace, out, num_splits) -> None:
    check_dev_attention(tiling.PA, query, key_cache, value_cache, block_table, seq_lens, None, workspace, out, num_splits)
    triton_kernels().attention_dev(
        query, key_cache, value_cache, block_table.contiguous(), seq_lens.contiguous(), None,
        scale, workspace, out, num_splits,
    )


@torch.library.custom_op("ascend::fused_infer_attention_dev", mutates_args=("workspace", "out"))
def fused_infer_attention_dev(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> None:
    """FIA reading `query_start_loc` and `seq_lens` from device tensors, with `num_splits` fixed
    splits and the features of `ops/features.py` (reference kernel)."""
    check_dev_attention(
        tiling.FIA, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, workspace, out, num_splits
    )
    features = library.check_features(query, window, soft_cap, sinks)
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    validate.query_lens_from_start_loc(starts, query.shape[0])
    query_lens = library.check_fused_infer_attention(
        query, key_cache, value_cache, block_table, starts[1:], lens, workspace, out, features=features
    )
    reference.split_k_attention(
        tiling.FIA, query, key_cache, value_cache, block_table, starts[:-1], query_lens, lens,
        scale, workspace, out, num_splits=num_splits, features=features, sinks=sinks,
    )


@fused_infer_attention_dev.register_fake
def _(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, workspace, out, num_splits,
      window=None, soft_cap=None, sinks=None) -> None:
    return None


@fused_infer_attention_dev.register_kernel("cuda")
def _(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, workspace, out, num_splits,
      window=None, soft_cap=None, sinks=None) -> None:
    check_dev_attention(
        tiling.FIA, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, workspace, out, num_splits
    )
    library.check_features(query, window, soft_cap, sinks)
    triton_kernels().attention_dev(
        query, key_cache, value_cache, block_table.contiguous(), seq_lens.contiguous(),
        query_start_loc.contiguous(), scale, workspace, out, num_splits,
        window=window, soft_cap=soft_cap, sinks=sinks,
    )


@torch.library.register_kernel("ascend::attention", "cuda")
def _attention_cuda(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The unified op on CUDA: the FIA kernel with the layer's features, split for the block
    table's capacity, no host sync."""
    library.check_attention_metadata(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    library.check_features(query, window, soft_cap, sinks)
    shape = tiling.AttentionShape.of(query, key_cache)
    splits = choose_num_splits(
        max(1, seq_lens.shape[0] * shape.num_kv_heads), max(1, block_table.shape[1] * shape.block_size),
        shape.block_size, device_sm_count(query.device),
    )
    workspace = torch.empty(dev_workspace_nbytes(query.shape[0], shape, splits), dtype=torch.uint8, device=query.device)
    out = torch.empty_like(query)
    triton_kernels().attention_dev(
        query, key_cache, value_cache, block_table.contiguous(), seq_lens.contiguous(),
        query_start_loc.contiguous(), scale, workspace, out, splits, window=window, soft_cap=soft_cap, sinks=sinks,
    )
    return out


@torch.library.register_kernel("ascend::reshape_and_cache", "cuda")
def _reshape_and_cache_cuda(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`reshape_and_cache` on CUDA without a host sync: slot -1 is skipped, and so is any slot
    outside the cache (the reference raises for those, which needs the slots on the host)."""
    library.check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    triton_kernels().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.contiguous())
