"""MLA on CUDA: the device-length form of the MLA kernel, and CUDA kernels for MLA's op pair.

- `ascend.mla_fused_infer_attention_dev(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, query_start_loc, seq_lens, scale, workspace, out, num_splits)`
  `ascend.mla_fused_infer_attention` (`ops/mla.py`: absorbed latent attention, causal among a
  sequence's query tokens, padding sequences zero) reading `query_start_loc [B+1]` and
  `seq_lens [B]` (int32) from device tensors instead of host lists, so a CUDA graph captured with
  it is right for every length, with `num_splits` (S) fixed on the host per bucket graph. Its
  workspace is fixed too: `cuda.dev_workspace_nbytes(T, shape, S)` of the MLA shape (records of
  the latent's dim), none with S == 1, whatever the lengths.

Its default kernel (CPU and any other device) is the reference MLA kernel split S ways, reading the
lengths on the host. On CUDA tensors it is the Triton kernel (`ops/cuda_triton_mla.py`), which
decides the splits each sequence uses on the device; neither synchronises with the host there, and
on CUDA `query_start_loc[B]` must be T and lengths must fit the block table (checking them would
need the host). This module also registers CUDA kernels for `ascend.mla_attention` (the Triton
kernel, split for the block table's capacity; the reference past the checked dims) and `ascend.mla_cache_write` (a device op: slot -1,
and any slot outside the cache, skipped without reading the slots on the host).

The Triton kernels' tiles are checked for sm_90 up to DeepSeek's dims, `MLA_MAX_LATENT` +
`MLA_MAX_ROPE` (`tests/test_triton_mla.py`); a layer with larger ones is refused at compile time
(`check_mla_tiles`, asked by `targets.CudaTarget`).
"""
from __future__ import annotations

import torch

from ..errors import WorkspaceTooSmall
from . import cuda, mla, reference, tiling, validate
from .library import _check_out

#: The largest latent (kv_lora_rank) and rope dims the Triton MLA kernels' tiles were checked for on
#: sm_90: DeepSeek-V2/V3's 512 and 64 (a K tile of 32 x 576 and a 16 x 512 float32 accumulator).
MLA_MAX_LATENT = 512
MLA_MAX_ROPE = 64


def fits_triton_tiles(shape: tiling.AttentionShape) -> bool:
    """Whether an MLA shape's dims are within those the Triton kernels' tiles were checked for on sm_90."""
    return shape.head_dim <= MLA_MAX_LATENT and shape.rope_dim <= MLA_MAX_ROPE


def check_mla_tiles(shape: tiling.AttentionShape) -> None:
    """Refuse MLA dims above those the Triton kernels' tiles were checked for on sm_90."""
    if not fits_triton_tiles(shape):
        raise ValueError(
            f"runtime 'cuda' serves latent attention of kv_lora_rank <= {MLA_MAX_LATENT} and rope_dim <= "
            f"{MLA_MAX_ROPE} (the Triton MLA kernels' tiles, checked for sm_90's shared memory and registers), "
            f"got kv_lora_rank {shape.head_dim} and rope_dim {shape.rope_dim}"
        )


def check_dev_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_cache: torch.Tensor, k_pe_cache: torch.Tensor,
                  block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  workspace: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """The checks of the device-length MLA op that read no device data (so they cost no host sync)."""
    mla.check_mla_metadata(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, seq_lens, query_start_loc)
    _check_out(q_nope, workspace, out)
    shape = tiling.AttentionShape.of_mla(q_nope, q_pe, kv_c_cache)
    needed = cuda.dev_workspace_nbytes(q_nope.shape[0], shape, num_splits)
    if workspace.numel() < needed:
        raise WorkspaceTooSmall(tiling.MLA, needed, workspace.numel())


@torch.library.custom_op("ascend::mla_fused_infer_attention_dev", mutates_args=("workspace", "out"))
def mla_fused_infer_attention_dev(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_cache: torch.Tensor,
    k_pe_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
) -> None:
    """The MLA kernel reading its lengths from device tensors, `num_splits` fixed splits (reference kernel)."""
    check_dev_mla(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, query_start_loc, seq_lens, workspace, out,
                  num_splits)
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    validate.query_lens_from_start_loc(starts, q_nope.shape[0])
    query_lens = mla.check_mla_kernel(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, starts[1:], lens,
                                      workspace, out)
    reference.mla_fused_infer_attention(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, starts[1:], lens,
                                        query_lens, scale, workspace, out, num_splits=num_splits)


@mla_fused_infer_attention_dev.register_fake
def _(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, query_start_loc, seq_lens, scale, workspace, out,
      num_splits) -> None:
    return None


@mla_fused_infer_attention_dev.register_kernel("cuda")
def _(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, query_start_loc, seq_lens, scale, workspace, out,
      num_splits) -> None:
    check_dev_mla(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, query_start_loc, seq_lens, workspace, out,
                  num_splits)
    cuda.triton_kernels("cuda_triton_mla").mla_attention_dev(
        q_nope, q_pe, kv_c_cache, k_pe_cache, block_table.contiguous(), query_start_loc.contiguous(),
        seq_lens.contiguous(), scale, workspace, out, num_splits,
    )


@torch.library.register_kernel("ascend::mla_attention", "cuda")
def _mla_attention_cuda(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_cache: torch.Tensor, k_pe_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """MLA's op on CUDA: the Triton kernel, split for the block table's capacity, no host sync; for
    dims past the checked tiles (`fits_triton_tiles`), the reference kernel, lengths read on the host."""
    mla.check_mla_metadata(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, seq_lens, query_start_loc)
    shape = tiling.AttentionShape.of_mla(q_nope, q_pe, kv_c_cache)
    if not fits_triton_tiles(shape):
        return mla.attend_with_host_lengths(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, seq_lens,
                                            query_start_loc, scale)
    splits = cuda.choose_num_splits(
        max(1, seq_lens.shape[0] * cuda.mla_head_groups(shape.num_heads)),
        max(1, block_table.shape[1] * shape.block_size), shape.block_size, cuda.device_sm_count(q_nope.device),
    )
    workspace = torch.empty(cuda.dev_workspace_nbytes(q_nope.shape[0], shape, splits), dtype=torch.uint8,
                            device=q_nope.device)
    out = torch.empty_like(q_nope)
    cuda.triton_kernels("cuda_triton_mla").mla_attention_dev(
        q_nope, q_pe, kv_c_cache, k_pe_cache, block_table.contiguous(), query_start_loc.contiguous(),
        seq_lens.contiguous(), scale, workspace, out, splits,
    )
    return out


@torch.library.register_kernel("ascend::mla_cache_write", "cuda")
def _mla_cache_write_cuda(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_c_cache: torch.Tensor, k_pe_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """MLA's cache write on CUDA without a host sync: slot -1 is skipped, and so is any slot outside
    the cache (the reference raises for those, which needs the slots on the host)."""
    mla.check_mla_cache_write(kv_c, k_pe, kv_c_cache, k_pe_cache, slot_mapping)
    cuda.triton_kernels("cuda_triton_mla").mla_cache_write(kv_c, k_pe, kv_c_cache, k_pe_cache,
                                                           slot_mapping.contiguous())
