"""The attention features (`ops/features.py`) on torch_npu 2.14's FIA, bound the way vLLM-Ascend calls
them (`vllm_ascend/attention/attention_v1.py` at 182b75ea, `AscendAttentionBackendImpl`; lines `Lnnnn`
below are of the torch_npu 2.14.0 wheel's `torch_npu/_op_plugin_docs.py`).

- **window**: FIA's band mode, `sparse_mode=4` with the 2048x2048 lower-triangular mask that mode takes
  ("sparse_mode为4时, 代表band模式的mask, 需要传入优化后的atten_mask矩阵(2048*2048)", L8122; "需要用户保证传入的
  atten_mask为下三角", L8214): the same mask as sparse 3, as vLLM-Ascend passes its causal mask
  (`AttentionMaskBuilder.get_splitfuse_attn_mask`, `vllm_ascend/attention/attention_mask.py` L50-54) to
  both. `next_tokens=0` as vLLM-Ascend passes it (`full_graph_fia` L941-943 and the update L891-909;
  eager L1418-1433), and `pre_tokens` `W - 1` (the docs' band) or `W` (vLLM-Ascend's), as the device's own
  edge probe finds (`band_tokens`, `ops/npu/band_probe.py`). At one
  query token per sequence the docs say the band's arguments have no effect (L8110-8111) and vLLM-Ascend
  relies on them: the device's own probe decides, and windowed decode steps it would not band run
  eagerly (`ops/npu/band_probe.py`).
- **sinks**: FIA v2's `learnable_sink`, one bfloat16 logit per query head (L8625), called as vLLM-Ascend's
  sinks path calls it (`full_graph_fia_v2` L1089-1210, its update L689-708, eager L1375-1400):
  `npu_fused_infer_attention_score_v2.out(query, key, value, atten_mask=, actual_seq_qlen=, actual_seq_kvlen=,
  block_table=, learnable_sink=, num_query_heads=, num_key_value_heads=, softmax_scale=, pre_tokens=,
  next_tokens=0, input_layout="TND", sparse_mode=4 with a window else 3, block_size=, workspace=, out=)`, the
  caches viewed `[num_blocks, block_size, KVH*D]` as for FIA v1 (its `_get_fia_params`, L1281-1339; "kv cache
  排布支持(blocknum, blocksize, H)", L8777). Its workspace is the v2 max-workspace query's answer with the same
  arguments, as vLLM-Ascend asks it (L1113-1157).
- **soft-cap**: not served. Neither FIA takes a logit soft-cap (their signatures, L8061 and L8585), and
  vLLM-Ascend's impl takes `logits_soft_cap` (L499) but neither keeps nor passes it (L509-531): a layer
  with one is refused at compile time (`passes/npu_checks.py`), and by the binding (`SOFT_CAP_REFUSAL`).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Sequence

import torch

from . import rules as npu_rules

#: FIA's sparse mode for causal attention whose queries end their sequence (rightDownCausal, L8121).
CAUSAL_SPARSE_MODE = 3
#: FIA's band mode (L8122): the keys between `pre_tokens` before and `next_tokens` after each query's own.
BAND_SPARSE_MODE = 4
#: `pre_tokens`' default, "2147483647" (L8110), which vLLM-Ascend passes as its `SWA_INT_MAX` without a window.
MAX_TOKENS = 2147483647

SOFT_CAP_REFUSAL = (
    "torch_npu 2.14's npu_fused_infer_attention_score and npu_fused_infer_attention_score_v2 take no logit "
    "soft-cap (their signatures, _op_plugin_docs.py L8061, L8585), and vLLM-Ascend does not serve one on FIA "
    "(vllm_ascend/attention/attention_v1.py: AscendAttentionBackendImpl takes logits_soft_cap, L499, and drops it)"
)


def sparse_mode(pre_tokens: int | None) -> int:
    """FIA's sparse mode for a layer whose band is `pre_tokens` (None without a window): band (4) with
    one, rightDownCausal (3) without."""
    return CAUSAL_SPARSE_MODE if pre_tokens is None else BAND_SPARSE_MODE


def band_tokens(pre_tokens: int | None) -> dict[str, int]:
    """FIA's `pre_tokens` and `next_tokens` for a layer whose window is the band of `pre_tokens` (what the
    device's edge probe found for its window: `ops/npu/band_probe.pre_tokens`); none without one (sparse
    3 ignores them: "sparse_mode=1、2、3的场景忽略入参pre_tokens、next_tokens", L8215, L8773).

    Our window `W` is `W` keys, the query's own included (`ops/features.py`: keys in `(p - W, p]`). FIA's
    band is every key `j` with `p - pre_tokens <= j <= p + next_tokens` for the query at `p`, counted from
    the bottom-right corner ("参数起点为右下角", L1645: a sequence's queries are the last of its keys; the band
    is drawn in npu_fusion_attention's section, L1636-1645, whose sparse modes FIA's list repeats, L8117-8122), so
    by the docs `pre_tokens` counts the keys *before* the query's own and `pre_tokens = W - 1`, `next_tokens = 0`:

    - causal attention is `next_tokens=0` ("next_tockens取值为0, pre_tockens大于等于Sq, 表示causal场景",
      L1638): the query's own key is inside the band at a distance of 0;
    - a band is not empty as long as `pre_tokens + next_tokens >= 0` (L8200, L8735; "pre_tockens取值必须大于等于
      next_tockens的绝对值", L1640): `pre_tokens = next_tokens = 0` leaves one key, the query's own;
    - rows attend nothing only once `pre_tokens < 0` (the int8-output interception of sparse 4, L8249).

    vLLM-Ascend passes `pre_tokens=self.sliding_window`, vLLM's `W` (attention_v1.py L942, L1127, L1204, L1431),
    which by these lines attends `W + 1` keys: one more than vLLM's own FlashAttention backend
    (`window_size=(W - 1, 0)`) and transformers' mask. Neither reading is assumed: the device's edge probe
    decides which of `W - 1` and `W` attends `W` keys (`ops/npu/band_probe.py`), and refuses windows where
    neither does."""
    if pre_tokens is None:
        return {}
    return {"pre_tokens": int(pre_tokens), "next_tokens": 0}


def sinks_arguments(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    actual_seq_qlen: Sequence[int],
    actual_seq_kvlen: Sequence[int],
    scale: float,
    atten_mask: torch.Tensor,
    pre_tokens: int | None,
    sinks: torch.Tensor,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments of FIA v2 with `learnable_sink` (TND, paged KV), shared by the
    `.out` call and the workspace query; the documented constraints checked first (`npu_rules`)."""
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    npu_rules.check_fia_block_size(int(block_size))  # "block_size最小为128, 最大为512, 且要求是128的倍数", L8776
    npu_rules.check_sinks(query.dtype, sinks.dtype, tuple(sinks.shape), int(query.shape[1]), int(head_dim))
    kwargs = {  # in the schema's order, as every binding here passes them
        "atten_mask": atten_mask,
        "actual_seq_qlen": [int(n) for n in actual_seq_qlen],
        "actual_seq_kvlen": [int(n) for n in actual_seq_kvlen],
        "block_table": block_table,
        "learnable_sink": sinks,
        "num_query_heads": int(query.shape[1]),
        "num_key_value_heads": int(kv_heads),
        "softmax_scale": float(scale),
        "pre_tokens": MAX_TOKENS,  # vLLM-Ascend's SWA_INT_MAX and next_tokens=0 without a window (L1204-1205)
        "next_tokens": 0,
        **band_tokens(pre_tokens),
        "input_layout": "TND",
        "sparse_mode": sparse_mode(pre_tokens),
        "block_size": int(block_size),
    }
    shape = (num_blocks, block_size, kv_heads * head_dim)
    return (query, key_cache.view(shape), value_cache.view(shape)), kwargs


def sinks_attention(torch_npu: ModuleType, atten_mask: torch.Tensor, softmax_lse: torch.Tensor, query: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                    actual_seq_qlen: Sequence[int], actual_seq_kvlen: Sequence[int], scale: float,
                    pre_tokens: int | None, sinks: torch.Tensor, workspace: torch.Tensor, out: torch.Tensor) -> None:
    """FIA with sinks as `npu_fused_infer_attention_score_v2.out`, into `out` (softmax_lse reserved, L9059)."""
    args, kwargs = sinks_arguments(query, key_cache, value_cache, block_table, actual_seq_qlen, actual_seq_kvlen,
                                   scale, atten_mask, pre_tokens, sinks)
    torch_npu.npu_fused_infer_attention_score_v2.out(*args, **kwargs, workspace=workspace, out=[out, softmax_lse])


def sinks_workspace(torch_npu: ModuleType, atten_mask: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_table: torch.Tensor, actual_seq_qlen: Sequence[int],
                    actual_seq_kvlen: Sequence[int], scale: float, pre_tokens: int | None,
                    sinks: torch.Tensor) -> torch.Tensor:
    """The workspace FIA v2's max-workspace query returns for this call's shapes ("获取最大workspace size", L8961)."""
    args, kwargs = sinks_arguments(query, key_cache, value_cache, block_table, actual_seq_qlen, actual_seq_kvlen,
                                   scale, atten_mask, pre_tokens, sinks)
    return torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(*args, **kwargs)
