"""The documented constraints of the torch_npu kernels the NPU path calls, as checks.

A device refuses a call outside these, or computes something else. The NPU target checks every kernel
node against them at compile time (`targets.NpuTarget.check_graph`) and refuses naming the layer, the
kernel and the rule; the runner keeps FIA's block rule on each step (`fia_block_count`); the fake
torch_npu enforces the same lines when called. Each rule cites where it is written, in the torch_npu
2.14.0 wheel: `torch_npu/_op_plugin_docs.py` (aclnn ops) and `torch_npu/op_plugin/atb/_atb_api_docs.py`
(ATB ops). Each check raises a ValueError starting with the argument's name.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

PA_KERNEL = "torch_npu._npu_paged_attention (ATB PagedAttention)"
FIA_KERNEL = "torch_npu.npu_fused_infer_attention_score"
CACHE_WRITE_KERNEL = "torch_npu.npu_scatter_pa_kv_cache"

#: ATB paged attention's block sizes: "因硬件限制，block_size %16 == 0，推荐 block_size = 128。因硬件限制，
#: block_size <= 128。" (hardware limits: a multiple of 16, at most 128; `_atb_api_docs.py`, the
#: `_npu_paged_attention_v2` docstring: v1, which we call, has none, and both are ATB's
#: PagedAttentionOperation). The same docstring allows 256 when `block_size = head_size = 256` on A2 in
#: a narrower case ("当block_size = head_size = 256时 ... 输入格式需满足BSND、非量化、decoder场景"); we do not
#: take that exception.
PA_BLOCK_MULTIPLE = 16
PA_MAX_BLOCK_SIZE = 128

#: Paged FIA's block sizes: "在使能page attention场景下, block_size最小为128, 最大为512, 且要求是128的倍数"
#: (at least 128, at most 512, a multiple of 128; `_op_plugin_docs.py`, npu_fused_infer_attention_score,
#: query length > 1). Decode alone (query length 1) allows any multiple of 16 up to 512, but an FIA graph
#: serves steps of several query tokens too. vLLM-Ascend runs its caches at 128.
FIA_BLOCK_SIZES = (128, 256, 384, 512)

#: Where each kernel's contiguity rule is written.
CONTIGUITY_SOURCES = {
    FIA_KERNEL: "_op_plugin_docs.py: query, key and value '不支持非连续的Tensor' (non-contiguous tensors are "
                "not supported)",
    CACHE_WRITE_KERNEL: "_op_plugin_docs.py: '输入参数不支持非连续' (inputs may not be non-contiguous)",
    PA_KERNEL: "no PA doc line; torch_npu's ATB plugin (lib/libop_plugin_atb.so) holds the error 'at_tensor is "
               "not contiguous', and a contiguous copy of a cache would copy all of it per call",
}


def check_pa_block_size(block_size: int) -> None:
    """Refuse a KV-cache block size ATB's paged attention does not take (see `PA_BLOCK_MULTIPLE`)."""
    if block_size % PA_BLOCK_MULTIPLE or not 0 < block_size <= PA_MAX_BLOCK_SIZE:
        raise ValueError(
            f"block_size: {PA_KERNEL} takes KV-cache blocks that are a multiple of {PA_BLOCK_MULTIPLE} and at most "
            f"{PA_MAX_BLOCK_SIZE} tokens ('因硬件限制，block_size %16 == 0 ... block_size <= 128', _atb_api_docs.py), "
            f"got {block_size}; allocate the KV cache with block_size=128, or use kernel_policy='fia'"
        )


def check_fia_block_size(block_size: int) -> None:
    """Refuse a KV-cache block size paged FIA does not take (see `FIA_BLOCK_SIZES`)."""
    if block_size not in FIA_BLOCK_SIZES:
        raise ValueError(
            f"block_size: torch_npu's paged FIA (npu_fused_infer_attention_score) takes KV-cache blocks of "
            f"{list(FIA_BLOCK_SIZES)} tokens (a multiple of 128, at most 512: 'block_size最小为128, 最大为512, 且要求是128"
            f"的倍数', _op_plugin_docs.py), got {block_size}; allocate the KV cache with block_size=128, as "
            f"vLLM-Ascend does"
        )


def check_contiguous(kernel: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse a non-contiguous tensor among `tensors` (argument name -> tensor) of `kernel`."""
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(
                f"{name}: {kernel} takes contiguous tensors ({CONTIGUITY_SOURCES[kernel]}), got shape "
                f"{tuple(tensor.shape)} with strides {tuple(tensor.stride())} (e.g. one half of a "
                f"[num_blocks, 2, ...] KV cache): give the layer contiguous key and value caches"
            )


def fia_block_count(kv_lens: Iterable[int], block_size: int) -> int:
    """The cache blocks FIA counts for these KV lengths: the sum of each sequence's blocks."""
    return sum((n + block_size - 1) // block_size for n in kv_lens)


def check_fia_num_blocks(num_blocks: int, kv_lens: Iterable[int], block_size: int) -> None:
    """Refuse a paged FIA call whose sequences need more blocks than the cache has: "blocknum不能小于根据
    actual_seq_lengths_kv和blockSize计算的每个batch的block数量之和" (`_op_plugin_docs.py`,
    npu_fused_infer_attention_score, page attention). Padding sequences count too (one block each at
    their KV length of at least 1), whatever block their table row names."""
    needed = fia_block_count(kv_lens, block_size)
    if num_blocks < needed:
        raise ValueError(
            f"key_cache: {FIA_KERNEL} needs at least as many cache blocks as its sequences' KV lengths take "
            f"('blocknum不能小于根据actual_seq_lengths_kv和blockSize计算的每个batch的block数量之和', _op_plugin_docs.py): "
            f"{needed} blocks of {block_size}, padding sequences included, but the cache has {num_blocks}"
        )
