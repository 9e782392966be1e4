"""The kernel rules' own contract (`ascend_compile/ops/npu/rules.py`), check by check: each takes what its
documented bound takes, to the bound, and refuses what lies past it with a ValueError whose message starts
with the argument it names and names the kernel, the rule's source line and what it got (the compile prefixes
the layer: `tests/test_npu_kernel_rules.py`). Plain calls, no compile: mutmut's tests for this module."""
from __future__ import annotations

import re

import pytest
import torch

from ascend_compile.ops.npu import rules

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _refusal(check, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        check(*args, **kwargs)
    return str(info.value)


# ----------------------------------------------------------------------------- block sizes


@pytest.mark.parametrize("block_size", [16, 32, 64, 112, 128])
def test_pa_takes_multiples_of_16_up_to_128(block_size):
    rules.check_pa_block_size(block_size)


@pytest.mark.parametrize("block_size", [0, -16, 8, 24, 144, 256])
def test_pa_refuses_other_block_sizes_naming_block_size(block_size):
    message = _refusal(rules.check_pa_block_size, block_size)
    assert message.startswith(f"block_size: {rules.PA_KERNEL} takes KV-cache blocks that are a multiple of 16 and "
                              f"at most 128 tokens"), message
    assert f"got {block_size};" in message


@pytest.mark.parametrize("block_size", [128, 256, 384, 512])
def test_paged_fia_takes_multiples_of_128_up_to_512(block_size):
    rules.check_fia_block_size(block_size)


@pytest.mark.parametrize("block_size", [0, 16, 64, 130, 640])
def test_paged_fia_refuses_other_block_sizes_naming_block_size(block_size):
    message = _refusal(rules.check_fia_block_size, block_size)
    assert message.startswith("block_size: torch_npu's paged FIA") and "[128, 256, 384, 512]" in message
    assert f"got {block_size};" in message


# ----------------------------------------------------------------------------- FIA heads and head dim


@pytest.mark.parametrize("heads", [(64, 1, 16), (129, 2, 16), (256, 4, 256), (8, 8, 64), (4, 2, 192)])
def test_fia_takes_up_to_64_query_heads_per_kv_head_256_heads_and_a_head_dim_of_16s_up_to_256(heads):
    rules.check_fia_heads(*heads)  # 129 over 2: 64 whole query heads per KV head, as the kernel counts


def test_fia_refuses_more_than_64_query_heads_per_kv_head_naming_num_key_value_heads():
    message = _refusal(rules.check_fia_heads, 130, 2, 16)
    assert message == (f"num_key_value_heads: {rules.FIA_KERNEL} takes at most 64 query heads per KV head "
                       f"('比值不能大于64', L8116), got 130 query heads over 2")


def test_fia_refuses_more_than_256_heads_naming_num_heads():
    message = _refusal(rules.check_fia_heads, 272, 16, 16)
    assert message == (f"num_heads: {rules.FIA_KERNEL} takes at most 256 heads ('支持N轴小于等于256', L8204, L8271), "
                       f"got 272")


@pytest.mark.parametrize("head_dim", [8, 24, 272, 512])
def test_fia_refuses_a_head_dim_off_16s_or_above_256_naming_query(head_dim):
    message = _refusal(rules.check_fia_heads, 4, 2, head_dim)
    assert message.startswith(f"query: {rules.FIA_KERNEL} takes a head dim that is a multiple of 16 "
                              f"('D轴需16对齐', L8210) and at most 256 in TND"), message
    assert message.endswith(f"got {head_dim}")


def test_the_first_unmet_fia_rule_is_the_one_named():
    assert _refusal(rules.check_fia_heads, 520, 1, 24).startswith("num_key_value_heads: ")
    assert _refusal(rules.check_fia_heads, 520, 16, 24).startswith("num_heads: ")


# ----------------------------------------------------------------------------- TND and MLA list sizes


def test_a_tnd_call_takes_4096_sequences_and_refuses_more_naming_capture_sizes_and_the_kernel():
    rules.check_tnd_sequences(4096)
    assert _refusal(rules.check_tnd_sequences, 4097).startswith(
        f"capture_sizes: {rules.FIA_KERNEL} takes at most 4096 sequences per TND call")
    assert "a graph of 4097 tokens may be called with 4097" in _refusal(rules.check_tnd_sequences, 4097)
    assert _refusal(rules.check_tnd_sequences, 5000, rules.SINKS_KERNEL).startswith(
        f"capture_sizes: {rules.SINKS_KERNEL} takes")


def test_an_mla_call_takes_4096_sequences_and_refuses_more_naming_capture_sizes_and_the_kernel():
    rules.check_mla_sequences(4096)
    message = _refusal(rules.check_mla_sequences, 4097)
    assert message.startswith(f"capture_sizes: {rules.MLA_KERNEL} takes at most 4096 sequences per call")
    assert "a bucket of 4097 tokens" in message
    assert _refusal(rules.check_mla_sequences, 4097, "k").startswith("capture_sizes: k takes")


# ----------------------------------------------------------------------------- PA head size, dtypes, contiguity


@pytest.mark.parametrize("head_dim", [1, 64, 256])
def test_pa_takes_head_sizes_in_0_256(head_dim):
    rules.check_pa_head_size(head_dim)


@pytest.mark.parametrize("head_dim", [0, -1, 257])
def test_pa_refuses_head_sizes_outside_0_256_naming_query(head_dim):
    message = _refusal(rules.check_pa_head_size, head_dim)
    assert message.startswith(f"query: {rules.PA_KERNEL} takes head sizes in (0, 256]") and f"got {head_dim};" in message


@pytest.mark.parametrize("kernel", [rules.PA_KERNEL, rules.FIA_KERNEL])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_pa_and_fia_take_half_precision_queries_with_caches_of_their_dtype(kernel, dtype):
    rules.check_attention_dtype(kernel, dtype, dtype)


@pytest.mark.parametrize("kernel, source", [(rules.PA_KERNEL, "_atb_api_docs.py L254, L272"),
                                            (rules.FIA_KERNEL, "_op_plugin_docs.py L8065, L8224")])
@pytest.mark.parametrize("query, cache", [(F32, F32), (BF16, F16), (F16, F32), (F32, BF16)])
def test_pa_and_fia_refuse_other_dtypes_naming_query_and_their_docs_line(kernel, source, query, cache):
    message = _refusal(rules.check_attention_dtype, kernel, query, cache)
    assert message.startswith(f"query: {kernel} takes float16 or bfloat16 queries")
    assert f"('float16/bf16', {source}), got a {query} query and {cache} caches" in message


@pytest.mark.parametrize("kernel", list(rules.CONTIGUITY_SOURCES))
def test_a_non_contiguous_tensor_is_refused_by_its_argument_name_with_the_kernels_source(kernel):
    cache = torch.zeros(4, 2, 8, 16)
    rules.check_contiguous(kernel, {"key_cache": cache[:, 0].contiguous(), "query": torch.zeros(3, 16)})
    message = _refusal(rules.check_contiguous, kernel, {"query": torch.zeros(3, 16), "value_cache": cache[:, 1]})
    assert message.startswith(f"value_cache: {kernel} takes contiguous tensors ({rules.CONTIGUITY_SOURCES[kernel]}), "
                              f"got shape (4, 8, 16) with strides (256, 16, 1)"), message


# ----------------------------------------------------------------------------- FIA's block count


def test_fia_counts_each_sequences_blocks_rounding_up():
    assert rules.fia_block_count([1, 128, 129, 256, 0], 128) == 1 + 1 + 2 + 2 + 0
    assert rules.fia_block_count([17], 16) == 2
    assert rules.fia_block_count([], 128) == 0


def test_a_paged_fia_call_takes_as_many_blocks_as_its_lengths_need_and_refuses_fewer_naming_the_cache():
    rules.check_fia_num_blocks(4, [1, 128, 129], 128)
    message = _refusal(rules.check_fia_num_blocks, 3, [1, 128, 129], 128)
    assert message.startswith(f"key_cache: {rules.FIA_KERNEL} needs at least as many cache blocks")
    assert message.endswith("4 blocks of 128, padding sequences included, but the cache has 3")
    assert _refusal(rules.check_fia_num_blocks, 1, [200], 128, rules.SINKS_KERNEL, "value_cache").startswith(
        f"value_cache: {rules.SINKS_KERNEL} needs")


# ----------------------------------------------------------------------------- MLA


@pytest.mark.parametrize("heads", rules.MLA_QUERY_HEADS)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_mla_takes_its_documented_heads_block_sizes_and_dtypes(heads, block_size, dtype):
    rules.check_mla_shape(heads, 512, 64, block_size, dtype)


@pytest.mark.parametrize("shape, start", [
    ((16, 128, 64, 128, BF16), "q_nope: {k} takes kv_lora_rank (the query's d) 512 with paged caches"),
    ((16, 512, 32, 128, BF16), "q_pe: {k} takes rope d 64 ('query_rope和keyRope的d为64', L8726), got 32"),
    ((3, 512, 64, 128, BF16), "q_nope: {k} takes query heads [1, 2, 4, 8, 16, 32, 64, 128]"),
    ((256, 512, 64, 128, BF16), "q_nope: {k} takes query heads"),
    ((16, 512, 64, 64, BF16), "block_size: {k} takes KV-cache blocks of [16, 128] tokens"),
    ((16, 512, 64, 128, F32), "q_nope: {k} takes float16 or bfloat16 queries and caches ('数据类型支持float16、bfloat16', "
                              "L8597-8598), got torch.float32"),
])
def test_mla_refuses_each_shape_outside_its_form_naming_the_argument(shape, start):
    message = _refusal(rules.check_mla_shape, *shape)
    assert message.startswith(start.format(k=rules.MLA_KERNEL)), message


def test_mla_sparse_mode_is_0_for_one_query_token_and_3_above():
    assert rules.mla_sparse_mode([]) == 0
    assert rules.mla_sparse_mode([1, 1, 1]) == 0
    assert rules.mla_sparse_mode([1, 2]) == 3
    assert rules.mla_sparse_mode(iter([16])) == 3


def test_an_mla_step_is_refused_above_16_query_tokens_or_on_the_other_sparse_mode():
    for mode in (None, 3):
        assert rules.mla_step_refusal([1, 16], mode) is None
        assert rules.mla_step_refusal([1, 17], mode) == (
            f"{rules.MLA_KERNEL} takes 1-16 query tokens per sequence ('支持query每个batch的s为1-16', L8724), and a "
            f"sequence of the step has 17")
    assert rules.mla_step_refusal([1, 1], 0) is None
    assert rules.mla_step_refusal([], 0) is None
    assert rules.mla_step_refusal([1, 1], None) is None
    assert rules.mla_step_refusal([1, 1], 3) == ("the step's longest sequence has 1 query tokens, which takes "
                                                 "sparse_mode 0 (L8697), and the graph's kernels were captured with 3")
    assert rules.mla_step_refusal([], 3) == ("the step's longest sequence has 0 query tokens, which takes "
                                             "sparse_mode 0 (L8697), and the graph's kernels were captured with 3")
    assert rules.mla_step_refusal([2, 1], 0) == ("the step's longest sequence has 2 query tokens, which takes "
                                                 "sparse_mode 3 (L8697), and the graph's kernels were captured with 0")


# ----------------------------------------------------------------------------- sinks


@pytest.mark.parametrize("head_dim", [64, 100, 128])
def test_sinks_take_a_bfloat16_per_head_vector_with_bfloat16_queries_and_value_dims_up_to_128(head_dim):
    rules.check_sinks(BF16, BF16, (4,), 4, head_dim)
    rules.check_sinks(BF16, BF16, [8], 8, head_dim)


@pytest.mark.parametrize("args, start", [
    ((BF16, F16, (4,), 4, 64), "sinks: {k} takes a bfloat16 (Q_N,) = (4,) learnable_sink"),
    ((BF16, BF16, (5,), 4, 64), "sinks: {k} takes a bfloat16 (Q_N,) = (4,) learnable_sink"),
    ((BF16, BF16, (1, 4), 4, 64), "sinks: {k} takes"),
    ((F16, BF16, (4,), 4, 64), "query: {k} takes bfloat16 queries with learnable_sink ('数据类型仅支持BFLOAT16', "
                               "L8733): run the model in torch.bfloat16, got torch.float16"),
    ((BF16, BF16, (4,), 4, 129), "value_cache: {k} takes a value head dim of at most 128 with learnable_sink"),
])
def test_sinks_outside_learnable_sinks_rules_are_refused_naming_the_argument(args, start):
    message = _refusal(rules.check_sinks, *args)
    assert message.startswith(start.format(k=rules.SINKS_KERNEL)), message
    if start.startswith("sinks"):
        assert re.search(r"got torch\.\w+ \(.*\)$", message), message
