"""The fake torch_npu's FIA v2 (`npu_fused_infer_attention_score_v2.out` and
`_npu_fused_infer_attention_score_v2_get_max_workspace`), in its MLA form, for `tests/fake_torch_npu.py`
(its form with `learnable_sink` and no rope inputs is `tests/fake_torch_npu_features.py`).

The ops are defined from the wheel's schema strings (the fixture), so a call with a wrong name, order
or kind fails as on the device. They compute the real result with the project's reference MLA kernel
and refuse what torch_npu 2.14's `_op_plugin_docs.py` forbids for this call, each rule quoting its line
(npu_fused_infer_attention_score_v2: "query_rope和key_rope输入时即为MLA场景", L8690-8704, and the TND rules
for a query d of 512, L8718-8738). One departure, vLLM-Ascend's practice: a sequence of 0 query tokens
is accepted (its padding sends them: `mla_v1.py`, `pad_actual_seq_len_q_mtp_disable_pad`, "[1, 2, 4, 5,
6, 6, 7, 8]"), though the docs say "1-16". The max-workspace query answers the reference tiling's most
for the query's tokens over every KV length the block table holds, in the query's dtype.
"""
from __future__ import annotations

from typing import Any

import torch

from ascend_compile.ops import reference, tiling, validate
from tests import fake_torch_npu as base
from tests import fake_torch_npu_features, fake_torch_npu_sources

#: The FIA v2 arguments the fake computes with; any other must keep its default.
_USED = {
    "query_rope", "key_rope", "atten_mask", "actual_seq_qlen", "actual_seq_kvlen", "block_table",
    "num_query_heads", "num_key_value_heads", "softmax_scale", "input_layout", "sparse_mode", "block_size",
    "workspace", "out", "learnable_sink", "pre_tokens", "next_tokens",
}
#: Arguments that do not change the result of the calls the fake accepts: the `.out` overload's
#: softmax_lse is reserved ("当前预留，暂不支持", L9059) whatever the flag. pre/next_tokens are ignored by
#: the MLA form's sparse_mode 0 without a mask and 3 ("忽略入参pre_tokens、next_tokens", L8771, L8773) and
#: make the band of the sinks form's sparse 4 (`tests/fake_torch_npu_features.py`).
_IGNORED = {"inner_precise", "return_softmax_lse"}
_DOC = "npu_fused_infer_attention_score_v2, torch_npu 2.14 _op_plugin_docs.py"
_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


def _arguments(schema: torch.FunctionSchema, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments with the schema's defaults filled in, refusing what the fake does not compute."""
    defaults = {a.name: a.default_value for a in schema.arguments if a.kwarg_only and a.has_default_value()}
    for name, value in kwargs.items():
        if name not in _USED and name not in _IGNORED and not base._same(value, defaults.get(name)):
            raise NotImplementedError(f"{name}: the fake FIA v2 does not implement it (leave it at its default)")
    return {**defaults, **kwargs}


def _require(ok: bool, arg: str, expected: str, got: Any) -> None:
    if not ok:
        base._fail(arg, f"{expected} ({_DOC})", got)


def _mla_layout(query, key, value, kw) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int]]:
    """Checks of an MLA call (TND, paged KV); (latent cache, rope cache as `[NB, BS, d]`, ends, KV lens,
    query lens)."""
    query_rope, key_rope = kw["query_rope"], kw["key_rope"]
    if kw["learnable_sink"] is not None:
        raise NotImplementedError("learnable_sink: the fake's MLA form does not compute sinks")
    _require(query_rope is not None and key_rope is not None, "key_rope",
             "query_rope and key_rope together ('要求同时配置或同时不配置', L8693)", "only one of them")
    _require(kw["input_layout"] == "TND", "input_layout", "'TND' (the layout the fake implements; L8722)",
             repr(kw["input_layout"]))
    _require(query.dtype in (torch.float16, torch.bfloat16), "query", "float16 or bfloat16 (L8589; int8 is the "
             "quantized form)", query.dtype)
    for name, t, like in (("query_rope", query_rope, query), ("key", key, query), ("value", value, key),
                          ("key_rope", key_rope, key)):
        _require(t.dtype == like.dtype, name, f"dtype {like.dtype} ('与query一致' / '与key一致', L8691-8692)", t.dtype)
    base._contiguous(f"{_DOC}: '不支持非连续的Tensor', L8589-8598", query=query, key=key, value=value,
                     query_rope=query_rope, key_rope=key_rope)
    tokens, heads, dim = query.shape
    _require(dim == 512, "query", "d 512 with paged KV ('query的d只支持512、128', L8695; d 128: no page attention, "
             "L8715)", dim)
    _require(tuple(query_rope.shape) == (tokens, heads, 64), "query_rope", f"shape {(tokens, heads, 64)} "
             "('query_rope的shape中d为64，其余维度与query一致', L8699)", tuple(query_rope.shape))
    _require(kw["num_query_heads"] == heads and heads in _HEADS, "num_query_heads", f"the query's {heads} heads, "
             "one of 1/2/4/.../128 ('要求query的n为1/2/4/8/16/32/64/128', L8725)", kw["num_query_heads"])
    _require(kw["num_key_value_heads"] == 1, "num_key_value_heads", "1 ('key、value的n为1', L8725)",
             kw["num_key_value_heads"])
    _require(key.dim() == 4 and key.shape[1] == 1 and key.shape[3] == 512, "key",
             "a [blocknum, 1, blocksize, 512] cache ('key的n为1，d为512', L8700; the (blocknum, KV_N, blocksize, D) "
             "layout, L8777)", tuple(key.shape))
    _require(value.shape == key.shape, "value", "key's shape ('key、value中对应tensor的shape需要完全一致')",
             tuple(value.shape))
    _require(tuple(key_rope.shape) == (*key.shape[:3], 64), "key_rope", f"shape {(*key.shape[:3], 64)} "
             "('keyRope的shape中d为64，其余维度与key一致', L8700)", tuple(key_rope.shape))
    num_blocks, block_size = key.shape[0], key.shape[2]
    table = kw["block_table"]
    _require(table is not None and table.dtype == torch.int32 and table.dim() == 2, "block_table",
             "a 2-D int32 table ('必须开启PageAttention', L8703; L8780)", None if table is None else table.dtype)
    _require(kw["block_size"] == block_size and block_size in (16, 128), "block_size",
             f"the cache's block size {block_size}, 16 or 128 ('block_size支持16、128', L8703)", kw["block_size"])
    ends, kv_lens = kw["actual_seq_qlen"], kw["actual_seq_kvlen"]
    _require(ends is not None and kv_lens is not None, "actual_seq_qlen",
             "both actual_seq_qlen and actual_seq_kvlen ('必须传入', L8720)", None)
    ends, kv_lens = list(ends), list(kv_lens)
    _require(len(kv_lens) == len(ends) == table.shape[0], "actual_seq_kvlen", f"one length per batch, "
             f"{len(ends)} (its length is the batch, L8720, L8723; block_table's first dim, L8780)", len(kv_lens))
    # L8738 closes the d != 512 section (from L8729); applied to d 512 too as a bound, unverified there.
    base.tnd_entries(ends, kv_lens, "'元素个数不大于4096', L8738; prompt_flash_attention_tiling.cpp L4275-4278")
    query_lens = validate.query_lens_from_ends(ends, tokens, "actual_seq_qlen")  # non-decreasing, last == T
    _require(max(query_lens, default=0) <= 16, "actual_seq_qlen", "at most 16 query tokens per batch "
             "('支持query每个batch的s为1-16', L8724)", max(query_lens, default=0))
    capacity = table.shape[1] * block_size
    _require(all(0 <= n <= capacity for n in kv_lens), "actual_seq_kvlen",
             f"lengths in [0, {capacity}] ('值不大于KV_S', L8723)", kv_lens)
    needed = sum(-(-n // block_size) for n in kv_lens)
    _require(num_blocks >= needed, "key", f"at least {needed} blocks ('blocknum不能小于...的block数量之和', L8777)",
             f"{num_blocks} blocks")
    mask = kw["atten_mask"]
    if max(query_lens, default=0) <= 1:
        _require(kw["sparse_mode"] == 0 and mask is None, "sparse_mode",
                 "0 without a mask for Q_S 1 ('Q_S等于1时只支持sparse=0且不传mask', L8697)", kw["sparse_mode"])
    else:
        _require(kw["sparse_mode"] == 3, "sparse_mode", "3 for Q_S above 1 ('Q_S大于1时只支持sparse=3且传入mask', L8697)",
                 kw["sparse_mode"])
        _require(mask is not None and tuple(mask.shape) == (2048, 2048) and mask.dtype in _MASK_DTYPES, "atten_mask",
                 "the (2048, 2048) bool/int8/uint8 mask of sparse_mode 3 (L8607)",
                 None if mask is None else f"{mask.dtype} {tuple(mask.shape)}")
        _require(bool(mask[0, 1]) and not bool(mask[1, 0]) and not bool(mask[0, 0]), "atten_mask",
                 "the causal mask, masked strictly above the diagonal ('下三角', L8772)", "another mask")
    latent = key.view(num_blocks, block_size, 512)
    rope = key_rope.view(num_blocks, block_size, 64)
    return latent, rope, ends, kv_lens, query_lens


def _mla_form(kw: dict[str, Any]) -> bool:
    """Whether a call is the MLA form ("query_rope和key_rope输入时即为MLA场景", L8690); else the fake's other
    form, `learnable_sink` (`tests/fake_torch_npu_features.py`)."""
    return kw["query_rope"] is not None or kw["key_rope"] is not None


def fia_v2_out(query, key, value, **kwargs):
    kw = _arguments(torch.ops.npu.npu_fused_infer_attention_score_v2.out._schema, kwargs)
    if not _mla_form(kw):
        return fake_torch_npu_features.sinks_out(query, key, value, kw)
    latent, rope, ends, kv_lens, query_lens = _mla_layout(query, key, value, kw)
    out = kw["out"]
    _require(len(out) == 2, "out", "[attention_out, softmax_lse]", f"{len(out)} tensors")
    attention_out, softmax_lse = out
    _require(attention_out.shape == query.shape and attention_out.dtype == query.dtype, "out",
             f"an attention_out like the query {tuple(query.shape)} (value's D, L8677)", tuple(attention_out.shape))
    workspace = kw["workspace"]
    shape = tiling.AttentionShape.of_mla(query, kw["query_rope"], latent)
    device_max = fake_torch_npu_sources.mla_max_workspace(base.kernel_source())
    if device_max is not None and workspace is not None:  # the later source's need: at most its max, by cores
        _require(workspace.numel() * workspace.element_size() >= device_max, "workspace",
                 f"at least the {device_max} bytes of the max-workspace query", workspace.numel())
        workspace = None  # the reference kernel's own scratch
    if workspace is None:  # aclnn allocates its own scratch
        workspace = torch.empty(tiling.workspace_nbytes(tiling.MLA, shape, kv_lens, query_lens), dtype=torch.uint8)
    base._executed(tiling.MLA, kv_lens)
    reference.mla_fused_infer_attention(query, kw["query_rope"], latent, rope, kw["block_table"], ends, kv_lens,
                                        query_lens, kw["softmax_scale"], workspace, attention_out)
    return attention_out, softmax_lse  # softmax_lse reserved (L9059): any tensor, not written


def fia_v2_out_meta(query, key, value, **kwargs):
    return kwargs["out"][0], kwargs["out"][1]


def fia_v2_max_workspace(query, key, value, **kwargs):
    """The most the call can need for these shapes at any lengths ("获取最大workspace size", L8961): the
    reference tiling's maximum for the query's tokens over every KV length the block table holds, in the
    query's dtype. The lengths must still be valid ones."""
    kw = _arguments(torch.ops.npu._npu_fused_infer_attention_score_v2_get_max_workspace.default._schema, kwargs)
    if not _mla_form(kw):
        return fake_torch_npu_features.sinks_max_workspace(query, key, value, kw)
    latent, *_ = _mla_layout(query, key, value, kw)
    shape = tiling.AttentionShape.of_mla(query, kw["query_rope"], latent)
    nbytes = fake_torch_npu_sources.mla_max_workspace(base.kernel_source()) or tiling.max_workspace(
        tiling.MLA, shape, query.shape[0], kw["block_table"].shape[1] * latent.shape[1]).nbytes
    return torch.empty(-(-nbytes // query.element_size()), dtype=query.dtype, device=query.device)


def register(npu: torch.library.Library) -> None:
    """The fake's implementations of the FIA v2 ops the fixture defines in `npu`."""
    npu.impl("npu_fused_infer_attention_score_v2.out", fia_v2_out, "CPU")
    npu.impl("npu_fused_infer_attention_score_v2.out", fia_v2_out_meta, "Meta")
    npu.impl("_npu_fused_infer_attention_score_v2_get_max_workspace", fia_v2_max_workspace, "CPU")
