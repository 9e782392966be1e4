"""The fake torch_npu's FIA attention features (`ascend_compile/ops/npu/features.py`), for
`tests/fake_torch_npu.py` and `tests/fake_torch_npu_mla.py`: the sparse modes' masks and FIA's band
(`band_window`, used by FIA v1 and v2 alike), and FIA v2's form with `learnable_sink` (`sinks_out`,
`sinks_max_workspace`: TND, paged KV, no rope inputs). Each rule quotes its line of torch_npu 2.14's
`_op_plugin_docs.py`; what the docs leave open follows vLLM-Ascend's practice, said where.

The band is computed as the docs define it, so an argument off by one changes the result: the keys
`j` of the query at position `p` (its sequence's last queries end at its last key: "参数起点为右下角",
L1645) with `p - pre_tokens <= j <= p + next_tokens` ("next_tockens取值为0 ... 表示causal场景", L1638; a
band of `pre_tokens = next_tokens = 0` is one key, "pre_tockens取值必须大于等于next_tockens的绝对值",
L1640, "preTokens + nextTokens >= 0", L8200, L8735). The fake computes the windows that end at the
query's own key (`next_tokens` 0, what a causal sliding window is) and refuses others as not
implemented.

At Q_S 1 (a TND call whose every sequence has one query token: the IncreFlashAttention branch, L8056)
the fake follows the docs by default: `pre_tokens` and `next_tokens` have no effect there ("Q_S为1时该参数
无效", L8110, L8111; v2 L8629, L8630), nor does `sparse_mode` ("Q_S为1且不带rope输入时该参数无效", L8117, L8635),
so such a call attends every key. `FakeNpu.band_at_single_query = True` (`install(..., band_at_single_query=
True)`) applies the band there too, the reading vLLM-Ascend's decode graphs rely on (`attention_v1.py`
`full_graph_fia` passes `pre_tokens` at one token per sequence). `"broken"` plays a device whose band there is
neither (about half the keys `pre_tokens` means), `"refused"` one refusing the call (`SINGLE_QUERY_BROKEN`). Which
one a device computes, the binding asks it (`ascend_compile/ops/npu/band_probe.py`).

How many keys a band of `pre_tokens` P attends at all is the fake's other switch, `FakeNpu.band_reading`
(`install(..., band_reading=)`, `BAND_READINGS`): the docs' P + 1 by default, vLLM-Ascend's P (its
`pre_tokens = W`), or P + 2 (neither); the binding's edge probe asks the device which.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ascend_compile.ops import reference, tiling, validate
from ascend_compile.ops.features import AttentionFeatures
from tests import fake_torch_npu as base
from tests import fake_torch_npu_sources

_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
#: The keys a band of `pre_tokens` P attends beyond P, by the fake's reading (`install(..., band_reading=)`):
#: the docs' (P before the query's own, and its own: L1636-1645, L8200), vLLM-Ascend's (`pre_tokens = W`,
#: `attention_v1.py` L942: P keys, its own among them), and one neither reading means (P + 2), to test
#: the refusal.
BAND_READINGS = {"docs": 1, "vllm-ascend": 0, "neither": 2}
_DOC = "torch_npu 2.14 _op_plugin_docs.py"


def _require(ok: bool, arg: str, expected: str, got: Any) -> None:
    if not ok:
        base._fail(arg, f"{expected} ({_DOC})", got)


def band_window(kw: dict[str, Any], query_lens: Sequence[int], kv_lens: Sequence[int]) -> int | None:
    """The window (`ops/features.py`: keys attended, the query's own included) a call of sparse mode 3
    or 4 computes, None for 3 (causal); the mask and the band's arguments checked as the docs ask."""
    mode = kw["sparse_mode"]
    _require(mode in (3, 4), "sparse_mode", "3 (rightDownCausal) or 4 (band), the modes with a mask the fake "
             "implements (L8121-8122)", mode)
    mask = kw["atten_mask"]
    _require(mask is not None and tuple(mask.shape) == (2048, 2048) and mask.dtype in _MASK_DTYPES, "atten_mask",
             "the (2048, 2048) bool/int8/uint8 mask sparse_mode 3 and 4 take ('sparse_mode=2、3、4时, atten_mask的shape"
             "需要为(S, S)...S的值需要固定为2048', L8214)", None if mask is None else f"{mask.dtype} {tuple(mask.shape)}")
    _require(bool(mask[0, 1]) and not bool(mask[1, 0]) and not bool(mask[0, 0]), "atten_mask",
             "the lower-triangular mask, True (masked) strictly above the diagonal ('需要用户保证传入的atten_mask为下三角', "
             "L8214)", "another mask")
    if mode == 3:
        return None  # "sparse_mode=1、2、3的场景忽略入参pre_tokens、next_tokens" (L8215, L8773)
    pre, nxt = int(kw["pre_tokens"]), int(kw["next_tokens"])
    for q, kv in zip(query_lens, kv_lens):
        _require(pre >= -q and nxt >= -kv and pre + nxt >= 0, "pre_tokens", "preTokens >= -actual_seq_qlen, "
                 "nextTokens >= -actual_seq_kvlen and preTokens + nextTokens >= 0 for sparse_mode 4 (L8200, L8735)",
                 f"pre_tokens={pre}, next_tokens={nxt} for query length {q}, KV length {kv}")
    if nxt != 0:
        raise NotImplementedError(f"next_tokens: the fake computes bands ending at the query's own key (0), got {nxt}")
    single = getattr(base._ACTIVE, "band_at_single_query", False)
    if all(q == 1 for q in query_lens) and single in SINGLE_QUERY_BROKEN:
        return broken_single_query_band(single, pre)
    if all(q == 1 for q in query_lens) and not single:
        return None  # "Q_S为1时该参数无效" (L8110, L8111, L8629, L8630): every key of the sequence attended
    keys = pre + BAND_READINGS[getattr(base._ACTIVE, "band_reading", "docs")]
    if keys < 1:
        raise NotImplementedError(f"pre_tokens: a band of {pre} attends no key under the fake's reading")
    return keys  # docs: keys p - pre_tokens .. p, pre_tokens before the query's own, and its own


#: The one-query-token band of a device neither reading describes (`install(..., band_at_single_query=)`): "broken", a
#: band of about half the keys `pre_tokens` means (wrong, silently); "refused", the call refused (the device's
#: RuntimeError). No source read here does either: the docs say the band has no effect at Q_S 1 (L8110), the older
#: kernel source has a branch of its own there (c29bc106 `prompt_flash_attention_tiling.cpp` L5027-5043: a whole head
#: group per block where every sequence has one query token) whose band no device was seen to compute; so the
#: binding's probe must read either as "not applied" (`ascend_compile/ops/npu/band_probe.py`).
SINGLE_QUERY_BROKEN = ("broken", "refused")


def broken_single_query_band(how: str, pre: int) -> int:
    """The window a one-query-token band call computes on a device whose band there is `how` (`SINGLE_QUERY_BROKEN`)."""
    if how == "refused":
        base.device_refusal("sparse_mode", "no band (sparse_mode 4) when every sequence has one query token (this "
                            "fake device's one-query-token branch refuses it)", 4)
    return max(1, (pre + 1) // 2)


def _sinks_layout(query, key, value, kw) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int],
                                                  int | None]:
    """Checks of FIA v2's call with `learnable_sink` (TND, paged KV); (4-D key cache, value cache, ends,
    KV lengths, query lengths, window)."""
    sinks = kw["learnable_sink"]
    tokens, heads, dim = query.shape
    _require(sinks is not None and sinks.dtype == torch.bfloat16 and tuple(sinks.shape) == (heads,), "learnable_sink",
             f"a bfloat16 ({heads},) tensor ('数据类型支持bfloat16...shape输入为(Q_N,)', L8625)",
             None if sinks is None else f"{sinks.dtype} {tuple(sinks.shape)}")
    _require(kw["input_layout"] == "TND", "input_layout", "'TND' with learnable_sink ('仅支持TND、NTD_TND', L8756; "
             "the layout the fake implements)", repr(kw["input_layout"]))
    _require(query.dtype == torch.bfloat16, "query", "bfloat16 ('数据类型仅支持BFLOAT16', L8733)", query.dtype)
    fake_torch_npu_sources.check_one_half_dtype(query, key, value)  # the device's refusal, a RuntimeError
    base._contiguous(f"{_DOC}, npu_fused_infer_attention_score_v2: '不支持非连续的Tensor', L8589-8593", query=query,
                     key=key, value=value, learnable_sink=sinks)
    _require(kw["num_query_heads"] == heads and heads <= 256, "num_query_heads", f"the query's {heads} heads, at most "
             "256 ('支持N轴小于等于256', L8762)", kw["num_query_heads"])
    kv_heads = kw["num_key_value_heads"]
    _require(key.dim() == 3 and value.shape == key.shape and kv_heads >= 1 and key.shape[2] == kv_heads * dim,
             "key", f"[num_blocks, block_size, KVH*{dim}] caches ('(blocknum, blocksize, H)', L8777) for "
             f"num_key_value_heads={kv_heads}", tuple(key.shape))
    _require(heads % kv_heads == 0 and heads // kv_heads <= 64, "num_key_value_heads",
             "a divisor of num_query_heads, at most 64 query heads per KV head ('比值不能大于64', L8627)", kv_heads)
    _require(dim <= 128 and dim % 16 == 0, "value", "a head dim of at most 128 ('仅支持value的d小于等于128', L8757), "
             "a multiple of 16 ('D轴需16对齐', L8768)", dim)
    table, block_size = kw["block_table"], key.shape[1]
    _require(table is not None and table.dtype == torch.int32 and table.dim() == 2, "block_table",
             "a 2-D int32 table (paged KV, L8775, L8780)", None if table is None else table.dtype)
    _require(kw["block_size"] == block_size and block_size % 128 == 0 and 128 <= block_size <= 512, "block_size",
             f"the cache's block size {block_size}, a multiple of 128 in [128, 512] (L8776)", kw["block_size"])
    ends, kv_lens = kw["actual_seq_qlen"], kw["actual_seq_kvlen"]
    _require(ends is not None and kv_lens is not None, "actual_seq_qlen",
             "both actual_seq_qlen and actual_seq_kvlen ('必须传入', L8720)", None)
    ends, kv_lens = list(ends), list(kv_lens)
    _require(len(kv_lens) == len(ends) == table.shape[0], "actual_seq_kvlen", f"one length per batch, {len(ends)} "
             f"(L8720; block_table's first dim, L8780)", len(kv_lens))
    base.tnd_entries(ends, kv_lens, "'元素个数不大于4096', L8738; prompt_flash_attention_tiling.cpp L4275-4278")
    query_lens = validate.query_lens_from_ends(ends, tokens, "actual_seq_qlen")  # non-decreasing, last == T (L8720)
    capacity = table.shape[1] * block_size
    _require(all(0 <= n <= capacity for n in kv_lens), "actual_seq_kvlen",
             f"lengths in [0, {capacity}] ('第二维长度不能小于maxBlockNumPerSeq', L8780)", kv_lens)
    needed = sum(-(-n // block_size) for n in kv_lens)
    _require(key.shape[0] >= needed, "key", f"at least {needed} blocks ('blocknum不能小于...的block数量之和', L8777)",
             f"{key.shape[0]} blocks")
    fake_torch_npu_sources.check(base.kernel_source(), query.dtype, heads, kv_heads, dim, block_size, kw["sparse_mode"],
                                 True, kw.get("inner_precise", 0))
    window = band_window(kw, query_lens, kv_lens)
    shape4 = (key.shape[0], block_size, kv_heads, dim)
    return key.view(shape4), value.view(shape4), ends, kv_lens, query_lens, window


def sinks_out(query, key, value, kw):
    """`npu_fused_infer_attention_score_v2.out` with `learnable_sink`, computed with the reference FIA: the
    sink of each head joins its softmax's denominator (the "Sink Token" absorbing attention score, L8625)."""
    key4, value4, ends, kv_lens, query_lens, window = _sinks_layout(query, key, value, kw)
    out = kw["out"]
    _require(len(out) == 2, "out", "[attention_out, softmax_lse]", f"{len(out)} tensors")
    attention_out, softmax_lse = out  # softmax_lse reserved (L9059): any tensor, never written
    _require(attention_out.shape == query.shape and attention_out.dtype == query.dtype, "out",
             f"an attention_out like the query {tuple(query.shape)} (L8677)", tuple(attention_out.shape))
    workspace = kw["workspace"]
    features = AttentionFeatures(window, None, True)
    if workspace is None:  # aclnn allocates its own scratch
        spans = [features.span(n, q) for n, q in zip(kv_lens, query_lens)]
        workspace = torch.empty(tiling.workspace_nbytes(tiling.FIA, tiling.AttentionShape.of(query, key4), spans,
                                                        query_lens), dtype=torch.uint8)
    if kw["workspace"] is not None:  # aclnn's own is sized by its own tiling
        base.fia_workspace_check(query, key4, kw, kw["sparse_mode"] == 4, True, workspace)
    base._executed(tiling.FIA, kv_lens)
    reference.fused_infer_attention(query, key4, value4, kw["block_table"], ends, kv_lens, query_lens,
                                    kw["softmax_scale"], workspace, attention_out, features, kw["learnable_sink"])
    return attention_out, softmax_lse


def sinks_max_workspace(query, key, value, kw):
    """The most the call can need for these shapes at any lengths ("获取最大workspace size", L8961): the
    reference tiling's maximum for the query's tokens over every KV length the block table holds, in
    the query's dtype. The arguments must still be valid ones."""
    key4, *_ = _sinks_layout(query, key, value, kw)
    capacity = kw["block_table"].shape[1] * key4.shape[1]
    nbytes = tiling.max_workspace(tiling.FIA, tiling.AttentionShape.of(query, key4), query.shape[0], capacity).nbytes
    nbytes = base.fia_workspace_answer(query, key4, kw, kw["sparse_mode"] == 4, True, nbytes)
    return torch.empty(-(-nbytes // query.element_size()), dtype=query.dtype, device=query.device)
