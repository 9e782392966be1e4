"""The documented constraints of the torch_npu kernels the NPU path calls, as checks.

A device refuses a call outside these, or computes something else. The NPU target checks every kernel
node against them at compile time (`targets.NpuTarget.check_graph`) and refuses naming the layer, the
kernel and the rule; the runner keeps FIA's block rule on each step (`fia_block_count`); the fake
torch_npu enforces the same lines when called. Each rule cites where it is written, in the torch_npu
2.14.0 wheel: `torch_npu/_op_plugin_docs.py` (aclnn ops) and `torch_npu/op_plugin/atb/_atb_api_docs.py`
(ATB ops), or, where the kernel's source (CANN ops-transformer) is narrower than the docs on every version
read, the source's lines (FIA's TND head dim and list sizes); what differs between versions is asked of the
device (`ops/npu/form_probe.py`). Each check raises a ValueError starting with the argument's name.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

PA_KERNEL = "torch_npu._npu_paged_attention (ATB PagedAttention)"
FIA_KERNEL = "torch_npu.npu_fused_infer_attention_score"
MLA_KERNEL = "torch_npu.npu_fused_infer_attention_score_v2 (MLA: query_rope/key_rope)"
SINKS_KERNEL = "torch_npu.npu_fused_infer_attention_score_v2 (learnable_sink)"
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

#: The dtypes of PA's and FIA's queries and caches: half precision. FIA: query "数据类型支持float16、bfloat16、
#: int8" (`_op_plugin_docs.py` L8065), key and value float16/bfloat16/int8/int4 (L8067, L8070), and with page
#: attention no int8 query ("不支持输入query为int8的场景", L8224); int8 and int4 caches are the quantised forms,
#: which take antiquant scales this binding does not pass. ATB's PA: query "支持float16/bf16/int8" (`_atb_api_docs.py`
#: L254), the caches alike (L255, L262; int8 is its quantised form), `out` "数据类型为float16/bf16" (L272). Neither
#: takes float32: a float32 model would pass every other check and fail at its first kernel. L8065 is FIA's
#: parameter list for every layout: TND's own list says "数据类型仅支持BFLOAT16" (L8193-8197; v2 L8733), as the
#: kernel source c29bc106 does for TND (`prompt_flash_attention_tiling.cpp` L3813-3815), while bfbbec83's SplitFuse
#: path also takes float16 (`fused_infer_attention_score_tiling.cpp` L975-977). So float16 is not refused here for
#: FIA: a float16 FIA layer is asked of the device (`ops/npu/form_probe.py`).
ATTENTION_DTYPES = (torch.float16, torch.bfloat16)

#: Where each kernel's contiguity rule is written.
CONTIGUITY_SOURCES = {
    FIA_KERNEL: "_op_plugin_docs.py: query, key and value '不支持非连续的Tensor' (non-contiguous tensors are "
                "not supported)",
    CACHE_WRITE_KERNEL: "_op_plugin_docs.py: '输入参数不支持非连续' (inputs may not be non-contiguous)",
    MLA_KERNEL: "_op_plugin_docs.py, npu_fused_infer_attention_score_v2: key and key_rope '不支持非连续的Tensor' "
                "(L8590, L8598)",
    PA_KERNEL: "no PA doc line; torch_npu's ATB binding makes every input contiguous, a copy (op-plugin "
               "AtbCommon.cpp, ParamSetter::Input: tensor.contiguous()), which for a cache copies all of it per "
               "call: refused for that cost",
}

#: FIA's head rules: "num_heads与num_key_value_heads的比值不能大于64" (at most 64 query heads per KV head,
#: `_op_plugin_docs.py` L8116); "支持N轴小于等于256" (L8204 for Q_S > 1, L8271 for Q_S 1); "输入类型全为float16、
#: bfloat16时, D轴需16对齐" (a head dim that is a multiple of 16, L8210, Q_S > 1: an FIA graph serves steps of
#: several query tokens). L8204, L8210 and L8271 are the docs' general lists ("当Q_S大于1时" L8201-8210, "当Q_S等于1时"
#: L8269-8271: the BSH/BSND/BNSD constraints; L8204 names BSH and BSND), not TND's own, which is narrower (N
#: 8/16/32/64/128 with Q_N = K_N and D 192, L8193-8197; v2 D 128 or 192, L8730-8731) and is not applied here: the
#: head dims within these bounds are asked of the device (`ops/npu/form_probe.py`). The head dim's bound is the
#: kernel source's, narrower than the docs' 512 (L8204, L8271):
#: every call here is TND without rope and D != 512, which takes the PFA tiling in ops-transformer c29bc106
#: (`fused_infer_attention_score_tiling.cpp` L700-716), whose TND rule is D 64 or 128, or 192 in narrow cases
#: (`prompt_flash_attention_tiling.cpp` L3800-3803); a later source (the ops-transformer mirror at bfbbec83,
#: 2025-12) adds a SplitFuse path refusing D > 256 in TND (`fused_infer_attention_score_tiling.cpp` L1035-1038)
#: and otherwise keeps that PFA rule (L3680-3683). No version read takes D > 256; which D up to 256 a device
#: takes depends on its version, asked of the device per layer form (`ops/npu/form_probe.py`).
FIA_MAX_HEAD_RATIO = 64
FIA_MAX_HEADS = 256
FIA_MAX_HEAD_DIM = 256
FIA_HEAD_DIM_MULTIPLE = 16
#: FIA's TND length lists: at most 4096 entries each. The kernel source refuses more (ops-transformer c29bc106
#: `attention/prompt_flash_attention/op_host/prompt_flash_attention_tiling.cpp` L4275-4278 with
#: `MAX_VAR_LEN_SEQ_LEN` = 4096, `prompt_flash_attention_tiling_const.h` L62: "Array length of the query's actual
#: sequence lengths ... must be less than or equal to 4096 when input layout is TND"), and so does the max-workspace
#: query, whose stand-in arrays keep the lists' sizes: on a device that refusal is a RuntimeError, not a ValueError.
#: A graph's calls hold at most as many entries as its key has tokens (a decode graph exactly that many), so a key
#: above this is refused.
TND_MAX_SEQUENCES = 4096
#: ATB PA's head size: "head_size范围为（0, 256]" (`_atb_api_docs.py` L278; the wider (0, 576] of L280 is
#: for unequal key/value head sizes, which `ascend.attention` does not have).
PA_MAX_HEAD_DIM = 256


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


def check_fia_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Refuse head counts and a head dim FIA does not take (`FIA_MAX_HEAD_RATIO` and the constants beside it)."""
    rules = (
        ("num_key_value_heads", num_heads // num_kv_heads <= FIA_MAX_HEAD_RATIO,
         f"at most {FIA_MAX_HEAD_RATIO} query heads per KV head ('比值不能大于64', L8116)",
         f"{num_heads} query heads over {num_kv_heads}"),
        ("num_heads", num_heads <= FIA_MAX_HEADS, f"at most {FIA_MAX_HEADS} heads ('支持N轴小于等于256', L8204, L8271)",
         num_heads),
        ("query", head_dim <= FIA_MAX_HEAD_DIM and head_dim % FIA_HEAD_DIM_MULTIPLE == 0,
         f"a head dim that is a multiple of {FIA_HEAD_DIM_MULTIPLE} ('D轴需16对齐', L8210) and at most "
         f"{FIA_MAX_HEAD_DIM} in TND (kernel source: prompt_flash_attention_tiling.cpp L3800-3803 takes D 64, 128 "
         f"or 192, the later SplitFuse path at most 256, fused_infer_attention_score_tiling.cpp L1035-1038)",
         head_dim),
    )
    _refuse_unmet(rules, FIA_KERNEL)


def _refuse_unmet(rules: Iterable[tuple[str, bool, str, Any]], kernel: str) -> None:
    """Raise for the first of `rules` (argument, met, what `kernel` takes, what it got) not met, naming
    the argument."""
    for arg, ok, expected, got in rules:
        if not ok:
            raise ValueError(f"{arg}: {kernel} takes {expected}, got {got}")


def check_tnd_sequences(count: int, kernel: str = FIA_KERNEL) -> None:
    """Refuse a graph key whose calls may hold more than `TND_MAX_SEQUENCES` sequences (`count`: its tokens)."""
    if count > TND_MAX_SEQUENCES:
        raise ValueError(f"capture_sizes: {kernel} takes at most {TND_MAX_SEQUENCES} sequences per TND call (kernel "
                         f"source prompt_flash_attention_tiling.cpp L4275-4278, MAX_VAR_LEN_SEQ_LEN), and a graph of "
                         f"{count} tokens may be called with {count}; use sizes of at most {TND_MAX_SEQUENCES} tokens")


def check_pa_head_size(head_dim: int) -> None:
    """Refuse a head dim ATB's paged attention does not take (`PA_MAX_HEAD_DIM`)."""
    if not 0 < head_dim <= PA_MAX_HEAD_DIM:
        raise ValueError(f"query: {PA_KERNEL} takes head sizes in (0, {PA_MAX_HEAD_DIM}] ('head_size范围为（0, 256]', "
                         f"_atb_api_docs.py L278), got {head_dim}; use kernel_policy='fia'")


def check_attention_dtype(kernel: str, query: torch.dtype, cache: torch.dtype) -> None:
    """Refuse a PA or FIA call whose query or caches are not float16/bfloat16 of one dtype (`ATTENTION_DTYPES`)."""
    source = "_atb_api_docs.py L254, L272" if kernel == PA_KERNEL else "_op_plugin_docs.py L8065, L8224"
    if query not in ATTENTION_DTYPES or cache != query:
        raise ValueError(
            f"query: {kernel} takes float16 or bfloat16 queries, with caches of the query's dtype ('float16/bf16', "
            f"{source}), got a {query} query and {cache} caches; run the model in torch.bfloat16 or torch.float16"
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


def check_fia_num_blocks(num_blocks: int, kv_lens: Iterable[int], block_size: int, kernel: str = FIA_KERNEL,
                         cache: str = "key_cache") -> None:
    """Refuse a paged FIA call whose sequences need more blocks than the cache has: "blocknum不能小于根据
    actual_seq_lengths_kv和blockSize计算的每个batch的block数量之和" (`_op_plugin_docs.py`,
    npu_fused_infer_attention_score, page attention; FIA v2 alike, L8777). Padding sequences count too
    (one block each at their KV length of at least 1), whatever block their table row names."""
    needed = fia_block_count(kv_lens, block_size)
    if num_blocks < needed:
        raise ValueError(
            f"{cache}: {kernel} needs at least as many cache blocks as its sequences' KV lengths take "
            f"('blocknum不能小于根据actual_seq_lengths_kv和blockSize计算的每个batch的block数量之和', _op_plugin_docs.py): "
            f"{needed} blocks of {block_size}, padding sequences included, but the cache has {num_blocks}"
        )


# FIA v2's MLA form. Line numbers are of torch_npu 2.14.0's `_op_plugin_docs.py`, whose section
# "query_rope和key_rope输入时即为MLA场景" (L8690) and TND rules for a query d of 512 (L8718-8738) these are.

#: "query的d只支持512、128" (L8695); the d=128 form takes no page attention ("不支持...page attention", L8715),
#: and the latent cache is paged, so 512 it is. KV heads: "key、value的n为1" (L8725), which the op's one
#: latent head is by its shape.
MLA_LATENT_DIM = 512
#: "query_rope和keyRope的d为64" (L8726; L8699-8700 alike).
MLA_ROPE_DIM = 64
#: "要求query的n为1/2/4/8/16/32/64/128" (L8725, L8699).
MLA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
#: "必须开启PageAttention，此时block_size支持16、128" (L8703). The paged rule for query lengths above 1
#: outside MLA asks for multiples of 128 (L8776); the MLA section is the one for this call, and
#: vLLM-Ascend runs its MLA caches at 128.
MLA_BLOCK_SIZES = (16, 128)
#: "支持query每个batch的s为1-16" (L8724; "query的s为1-16", L8699).
MLA_MAX_QUERY_LEN = 16
#: "actual_seq_qlen和actual_seq_kvlen的元素个数不大于4096" (L8738): a graph has as many sequences as its bucket.
#: L8738 ends the section for a query d other than 512 (from L8729); the d 512 section (L8718-8727) states no
#: count, so this is applied as a conservative bound, unverified for d 512.
MLA_MAX_SEQUENCES = 4096
#: query_rope / key_rope: "数据类型支持float16、bfloat16" (L8597-8598), "与query一致" (L8691-8692).
MLA_DTYPES = (torch.float16, torch.bfloat16)


def check_mla_shape(num_heads: int, latent_dim: int, rope_dim: int, block_size: int, dtype: torch.dtype) -> None:
    """Refuse an MLA layer FIA v2's MLA form does not take (the constants above)."""
    rules = (
        ("q_nope", latent_dim == MLA_LATENT_DIM, f"kv_lora_rank (the query's d) {MLA_LATENT_DIM} with paged "
                                                 f"caches ('query的d只支持512、128', L8695; d 128 has no page attention, "
                                                 f"L8715)", latent_dim),
        ("q_pe", rope_dim == MLA_ROPE_DIM, f"rope d {MLA_ROPE_DIM} ('query_rope和keyRope的d为64', L8726)", rope_dim),
        ("q_nope", num_heads in MLA_QUERY_HEADS, f"query heads {list(MLA_QUERY_HEADS)} ('要求query的n为"
                                                 f"1/2/4/8/16/32/64/128', L8725)", num_heads),
        ("block_size", block_size in MLA_BLOCK_SIZES, f"KV-cache blocks of {list(MLA_BLOCK_SIZES)} tokens "
                                                      f"('block_size支持16、128', L8703)", block_size),
        ("q_nope", dtype in MLA_DTYPES, "float16 or bfloat16 queries and caches ('数据类型支持float16、bfloat16', "
                                        "L8597-8598)", dtype),
    )
    _refuse_unmet(rules, MLA_KERNEL)


def check_mla_sequences(count: int, kernel: str = MLA_KERNEL) -> None:
    """Refuse a graph of more sequences than FIA v2's length lists may hold (`MLA_MAX_SEQUENCES`)."""
    if count > MLA_MAX_SEQUENCES:
        raise ValueError(f"capture_sizes: {kernel} takes at most {MLA_MAX_SEQUENCES} sequences per call "
                         f"('actual_seq_qlen和actual_seq_kvlen的元素个数不大于4096', L8738), and a bucket of {count} "
                         f"tokens is captured with {count}; use smaller capture sizes")


def mla_sparse_mode(query_lens: Iterable[int]) -> int:
    """FIA v2's MLA sparse mode for these query lengths: 0 (no mask) when no sequence has more than one query
    token, else 3 (rightDownCausal, with the 2048x2048 mask). The d 512 section ties the mode to Q_S
    ("Q_S等于1时只支持sparse=0且不传mask，Q_S大于1时只支持sparse=3且传入mask", L8697, for every layout); TND's own list
    takes 0 without a mask or 3 with it whatever the query lengths (L8719), as the kernel source does
    (c29bc106 `fused_infer_attention_score_tiling_check_feature.cpp` L215-220, mask rules L239-248; bfbbec83
    `arch32/fused_infer_attention_score_tiling_check_feature.cpp` L179-183, L209-218, 4 too). This choice is
    within both; that a graph keeps its capture's mode (`mla_step_refusal`) is this project's rule, not
    the kernel's."""
    return 3 if max(query_lens, default=0) > 1 else 0


def mla_step_refusal(query_lens: Sequence[int], sparse_mode: int | None) -> str | None:
    """Why a call of these (padded) query lengths cannot be issued to a task captured with
    `sparse_mode`, or None: more than 16 query tokens in a sequence (`MLA_MAX_QUERY_LEN`), or lengths
    needing the other sparse mode (a task update re-issues the captured call's kernel; None: an eager call,
    which takes the mode of its own lengths)."""
    longest = max(query_lens, default=0)
    if longest > MLA_MAX_QUERY_LEN:
        return (f"{MLA_KERNEL} takes 1-{MLA_MAX_QUERY_LEN} query tokens per sequence ('支持query每个batch的s为1-16', "
                f"L8724), and a sequence of the step has {longest}")
    if sparse_mode is not None and mla_sparse_mode(query_lens) != sparse_mode:
        return (f"the step's longest sequence has {longest} query tokens, which takes sparse_mode "
                f"{mla_sparse_mode(query_lens)} (L8697), and the graph's kernels were captured with {sparse_mode}")
    return None


# FIA v2 with `learnable_sink` (attention sinks, `ops/npu/features.py`), lines of the same docs.

#: "learnable_sink: ...数据类型支持bfloat16, 数据格式支持ND, shape输入为(Q_N,)" (L8625); the query: the TND
#: section for a d other than 512 allows "数据类型仅支持BFLOAT16" (L8733), as vLLM-Ascend serves gpt-oss (its
#: "bf16 version", `docs/source/tutorials/models/gpt-oss-120b.md`). The same section's head dims ("Q_D、K_D、V_D
#: 等于128", L8730) are not applied: vLLM-Ascend calls this form for gpt-oss, whose head dim is 64, and the kernel
#: source takes D 64 as 128 in TND (c29bc106 `prompt_flash_attention_tiling.cpp` L3799-3803; bfbbec83 L3680-3683).
SINKS_DTYPE = torch.bfloat16
#: "learnable_sink的参数约束如下：仅支持TND、NTD_TND；仅支持value的d小于等于128" (L8755-8757). The kernel source is
#: narrower, a value d of 64 or 128 only (c29bc106 `prompt_flash_attention_tiling.cpp` L3668-3671; bfbbec83
#: L3556-3558): this bound is the docs', and a sinks layer of another d up to 128 is asked of the device
#: (`ops/npu/form_probe.py`).
SINKS_MAX_HEAD_DIM = 128


def check_sinks(query: torch.dtype, sinks: torch.dtype, sinks_shape: Sequence[int], num_heads: int,
                head_dim: int) -> None:
    """Refuse sinks FIA v2's `learnable_sink` does not take (`SINKS_DTYPE`, `SINKS_MAX_HEAD_DIM`)."""
    rules = (
        ("sinks", sinks == SINKS_DTYPE and tuple(sinks_shape) == (num_heads,),
         f"a bfloat16 (Q_N,) = ({num_heads},) learnable_sink ('数据类型支持bfloat16...shape输入为(Q_N,)', L8625); keep "
         f"the sinks in bfloat16", f"{sinks} {tuple(sinks_shape)}"),
        ("query", query == SINKS_DTYPE, "bfloat16 queries with learnable_sink ('数据类型仅支持BFLOAT16', L8733): run "
                                        "the model in torch.bfloat16", query),
        ("value_cache", head_dim <= SINKS_MAX_HEAD_DIM, f"a value head dim of at most {SINKS_MAX_HEAD_DIM} with "
                                                        f"learnable_sink ('仅支持value的d小于等于128', L8757)", head_dim),
    )
    _refuse_unmet(rules, SINKS_KERNEL)
