"""MLA on Ascend: the `ascend` MLA kernel and cache write bound to torch_npu 2.14, and the kernel's
workspace query.

- `ascend.mla_fused_infer_attention` runs as `torch_npu.npu_fused_infer_attention_score_v2.out` in its
  MLA form ("query_rope和key_rope输入时即为MLA场景", `_op_plugin_docs.py` L8690), called as vLLM-Ascend's
  decode path calls it (`vllm_ascend/attention/mla_v1.py`, `_forward_decode` and `update_graph_params`):
  the absorbed query `q_nope` as `query` and `q_pe` as `query_rope`, the latent cache as both `key` and
  `value` and the rope cache as `key_rope`, each viewed `[num_blocks, 1, block_size, d]` (the
  `(blocknum, KV_N, blocksize, D)` layout TND takes, L8777; the op's caches `[num_blocks, block_size, d]`
  are the same memory with one KV head), `num_key_value_heads=1`, `block_table`, `block_size`,
  `input_layout="TND"` with `actual_seq_qlen` cumulative and `actual_seq_kvlen` per sequence (L8720,
  L8723), `workspace=` and `out=[attention_out, softmax_lse]` (the registered overload takes `out` as a
  list, `tests/fixtures/torch_npu_2_14_schemas.txt`).
- Its sparse mode follows the call's query lengths (`npu_rules.mla_sparse_mode`: L8697 by Q_S; TND's list,
  L8719, and the kernel source take 0 or 3 whatever the query lengths): 0 without a mask when no sequence
  has more than one query token, else 3 with the 2048x2048 causal mask. A graph keeps one mode for its
  whole life (this project's rule, a task update re-issuing its captured call): the NPU target gives MLA
  buckets a decode graph and a mixed graph, and its step guard sends a step needing the other mode to eager (`passes/npu_checks.py`).
- The workspace: `_npu_fused_infer_attention_score_v2_get_max_workspace` with the same arguments, which
  "获取最大workspace size" (L8961), asked once per graph (`ops/npu/workspace_queries.py`).
- `ascend.mla_cache_write` runs as `torch_npu.npu_scatter_pa_kv_cache(..., cache_mode="Norm")`, the
  write `NpuKernels.reshape_and_cache` issues, with the latent as its key and the rope key as its value,
  one head each: "其中k_head_size与v_head_size 可以不同" (its scenario 2, L6996). vLLM-Ascend writes its
  MLA caches with `npu_kv_rmsnorm_rope_cache` instead (`mla_v1.py`, `exec_kv_decode`), which fuses the
  latent's RMSNorm and the key's rope into the write: the op pair leaves both to the model, so the plain
  write is the one that matches it.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Sequence

import torch

from .. import mla, validate
from . import rules as npu_rules


def query_lens_of(ends: Sequence[int]) -> list[int]:
    """Per-sequence query lengths from cumulative query ends."""
    return [int(b) - int(a) for a, b in zip([0, *ends[:-1]], ends)]


def fia_v2_mla_args(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_cache: torch.Tensor,
    k_pe_cache: torch.Tensor,
    block_table: torch.Tensor,
    actual_seq_qlen: Sequence[int],
    actual_seq_kvlen: Sequence[int],
    scale: float,
    atten_mask: torch.Tensor,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments of FIA v2's MLA form, in schema order, shared by the `.out`
    call and the workspace query; `atten_mask` is passed only where the sparse mode takes it."""
    num_blocks, block_size, latent_dim = kv_c_cache.shape
    npu_rules.check_mla_shape(int(q_nope.shape[1]), int(latent_dim), int(k_pe_cache.shape[2]), int(block_size),
                              q_nope.dtype)
    sparse_mode = npu_rules.mla_sparse_mode(query_lens_of(actual_seq_qlen))
    key = kv_c_cache.view(num_blocks, 1, block_size, latent_dim)
    kwargs = {
        "query_rope": q_pe,
        "key_rope": k_pe_cache.view(num_blocks, 1, block_size, k_pe_cache.shape[2]),
        "atten_mask": atten_mask if sparse_mode else None,
        "actual_seq_qlen": [int(n) for n in actual_seq_qlen],
        "actual_seq_kvlen": [int(n) for n in actual_seq_kvlen],
        "block_table": block_table,
        "num_query_heads": int(q_nope.shape[1]),
        "num_key_value_heads": 1,
        "softmax_scale": float(scale),
        "input_layout": "TND",
        "sparse_mode": sparse_mode,
        "block_size": int(block_size),
    }
    return (q_nope, key, key), kwargs


def mla_attention(
    torch_npu: ModuleType,
    atten_mask: torch.Tensor,
    softmax_lse: torch.Tensor,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_cache: torch.Tensor,
    k_pe_cache: torch.Tensor,
    block_table: torch.Tensor,
    actual_seq_qlen: list[int],
    actual_seq_kvlen: list[int],
    scale: float,
    workspace: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """`ascend.mla_fused_infer_attention` as `npu_fused_infer_attention_score_v2.out`, reading no tensor
    on the host (the block ids are not checked: the ACL graph records the call once). Its batch is the
    lists' length and its block table has exactly that many rows ("第一维长度需等于B", L8780)."""
    block_table = validate.sequence_rows(block_table, len(actual_seq_kvlen))
    mla.check_mla_kernel(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, actual_seq_qlen, actual_seq_kvlen,
                         workspace, out, check_data=False)
    args, kwargs = fia_v2_mla_args(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, actual_seq_qlen,
                                   actual_seq_kvlen, scale, atten_mask)
    torch_npu.npu_fused_infer_attention_score_v2.out(*args, **kwargs, workspace=workspace, out=[out, softmax_lse])


def mla_workspace(torch_npu: ModuleType, atten_mask: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                  kv_c_cache: torch.Tensor, k_pe_cache: torch.Tensor, block_table: torch.Tensor,
                  actual_seq_qlen: Sequence[int], actual_seq_kvlen: Sequence[int], scale: float) -> torch.Tensor:
    """The workspace FIA v2's query returns for these shapes (the most any lengths can need)."""
    args, kwargs = fia_v2_mla_args(q_nope, q_pe, kv_c_cache, k_pe_cache, block_table, actual_seq_qlen,
                                   actual_seq_kvlen, scale, atten_mask)
    return torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(*args, **kwargs)


def mla_cache_write(torch_npu: ModuleType, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_c_cache: torch.Tensor,
                    k_pe_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`ascend.mla_cache_write` as `npu_scatter_pa_kv_cache` in its ND scenario: the latent `[T, 1, d]`
    and rope key `[T, 1, rope]` into caches viewed `[num_blocks, block_size, 1, d]`, with `cache_mode="Norm"`
    and contiguous inputs ("输入参数不支持非连续", L7030: a copy of this step's tokens only; non-contiguous
    caches are refused at compile time). It reads no device data on the host; int32 and int64 slots pass
    as they are ("slot_mapping...数据类型支持int32和int64", L7019), and slot -1 marks padding tokens, as for
    `NpuKernels.reshape_and_cache` (the kernel source skips negative slots; not a documented contract)."""
    mla.check_mla_cache_write(kv_c, k_pe, kv_c_cache, k_pe_cache, slot_mapping)
    blocks = kv_c_cache.shape[:2]
    torch_npu.npu_scatter_pa_kv_cache(
        kv_c.contiguous().unsqueeze(1), k_pe.contiguous().unsqueeze(1), kv_c_cache.view(*blocks, 1, kv_c.shape[1]),
        k_pe_cache.view(*blocks, 1, k_pe.shape[1]), slot_mapping.contiguous(), cache_mode="Norm",
    )
