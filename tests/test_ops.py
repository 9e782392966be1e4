"""The op library: kernels against a dense reference, real workspaces, clear errors, opcheck."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ascend_compile.ops  # noqa: F401
from ascend_compile.errors import WorkspaceTooSmall
from ascend_compile.ops import reference, tiling
from tests.helpers import TOLERANCE, make_problem

ops = torch.ops.ascend
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_pa(p, workspace=None):
    shape = tiling.AttentionShape.of(p.query, p.key_cache)
    need = tiling.workspace_nbytes(tiling.PA, shape, p.seq_lens)
    ws = torch.empty(need, dtype=torch.uint8) if workspace is None else workspace
    out = torch.empty_like(p.query)
    ops.paged_attention(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, p.scale, ws, out)
    return out


def run_fia(p):
    shape = tiling.AttentionShape.of(p.query, p.key_cache)
    need = tiling.workspace_nbytes(tiling.FIA, shape, p.seq_lens, p.query_lens)
    ws = torch.empty(need, dtype=torch.uint8)
    out = torch.empty_like(p.query)
    ops.fused_infer_attention(
        p.query, p.key_cache, p.value_cache, p.block_table, p.query_start_loc[1:], p.seq_lens, p.scale, ws, out
    )
    return out


def run_attention(p):
    seq_lens, loc = p.tensors()
    return ops.attention(p.query, p.key_cache, p.value_cache, p.block_table, seq_lens, loc, p.scale)


@st.composite
def problems(draw, decode: bool):
    ratio = draw(st.sampled_from([1, 2, 8]))
    kv_heads = draw(st.sampled_from([1, 2]))
    dim = draw(st.sampled_from([64, 128]))
    block = draw(st.sampled_from([16, 128]))
    max_blocks = draw(st.integers(1, 3))
    largest = max_blocks * block
    special = [0, 1, block - 1, block, block + 1, largest]
    lens = draw(st.lists(st.one_of(st.sampled_from(special), st.integers(0, largest)), min_size=1, max_size=4))
    lens = [min(n, largest) for n in lens]
    if decode:
        qlens = [1] * len(lens)
    else:
        qlens = [draw(st.integers(1, min(n, 6))) if n else draw(st.integers(0, 1)) for n in lens]
    dtype = draw(st.sampled_from(DTYPES))
    return make_problem(lens, qlens, heads=kv_heads * ratio, kv_heads=kv_heads, dim=dim, block_size=block,
                        max_blocks=max_blocks, dtype=dtype, seed=draw(st.integers(0, 1000)))


def assert_close(out, p):
    ref = p.dense()
    tol = TOLERANCE[p.query.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@settings(max_examples=40, deadline=None)
@given(problems(decode=True))
def test_pa_matches_dense(p):
    assert_close(run_pa(p), p)


@settings(max_examples=40, deadline=None)
@given(problems(decode=False))
def test_fia_matches_dense(p):
    assert_close(run_fia(p), p)


@settings(max_examples=40, deadline=None)
@given(st.booleans().flatmap(lambda decode: problems(decode)))
def test_attention_matches_dense(p):
    assert_close(run_attention(p), p)


@pytest.mark.parametrize("lens", [[300, 4096, 4097, 17], [5000, 1025, 0, 2048]])
def test_long_sequences_use_many_splits_and_match(lens):
    p = make_problem(lens, heads=8, kv_heads=2, dim=64, block_size=128)
    shape = tiling.AttentionShape.of(p.query, p.key_cache)
    assert tiling.workspace_nbytes(tiling.PA, shape, lens) > 0
    assert tiling.workspace_nbytes(tiling.FIA, shape, lens) > 0
    assert_close(run_pa(p), p)
    assert_close(run_fia(p), p)


def test_chunked_prefill_with_splits_matches():
    p = make_problem([2100, 40], query_lens=[7, 40], heads=4, kv_heads=1, dim=64, block_size=128)
    assert_close(run_fia(p), p)
    assert_close(run_attention(p), p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pa_and_fia_agree_on_decode(dtype):
    p = make_problem([1, 15, 16, 17, 700, 0, 3000], heads=8, kv_heads=2, dim=64, block_size=16, dtype=dtype)
    torch.testing.assert_close(run_pa(p).float(), run_fia(p).float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_padding_rows_are_zero():
    p = make_problem([0, 20, 0], heads=4, kv_heads=4, dim=64)
    out = run_pa(p)
    assert out[0].abs().max() == 0 and out[2].abs().max() == 0
    assert out[1].abs().max() > 0


def test_a_step_with_no_query_tokens_attends_nothing():
    """Sequences with cached keys but no query token this step (a step of zero tokens) give an empty
    output, as every kernel's loop over tokens would; found by tests/test_differential.py."""
    p = make_problem([4, 30], [0, 0], heads=4, kv_heads=2, dim=16)
    assert p.query.shape[0] == 0
    assert run_fia(p).shape == (0, 4, 16)
    seq_lens, loc = p.tensors()
    assert ops.attention(p.query, p.key_cache, p.value_cache, p.block_table, seq_lens, loc, p.scale).shape == (0, 4, 16)


def test_workspace_one_byte_short_fails_clearly():
    p = make_problem([600, 900], heads=4, kv_heads=2, dim=64)
    need = tiling.workspace_nbytes(tiling.PA, tiling.AttentionShape.of(p.query, p.key_cache), p.seq_lens)
    assert need > 0
    with pytest.raises(WorkspaceTooSmall, match=f"needs {need} bytes.*given {need - 1} bytes"):
        run_pa(p, torch.empty(need - 1, dtype=torch.uint8))


def test_corrupting_the_workspace_between_split_and_reduce_changes_the_result(monkeypatch):
    p = make_problem([600, 900], heads=4, kv_heads=2, dim=64)
    clean = run_pa(p)
    seen = []

    def corrupt(ws):
        seen.append(ws.numel())
        ws.mul_(3.0)

    monkeypatch.setattr(reference, "between_split_and_reduce", corrupt)
    dirty = run_pa(p)
    assert seen and seen[0] > 0
    assert not torch.allclose(clean, dirty, atol=1e-3)


def test_single_split_sequences_need_no_workspace():
    p = make_problem([200, 100], heads=4, kv_heads=2, dim=64)
    assert run_pa(p, torch.empty(0, dtype=torch.uint8)).abs().max() > 0


# ---------------------------------------------------------------- errors


def _attn_args(p):
    seq_lens, loc = p.tensors()
    return [p.query, p.key_cache, p.value_cache, p.block_table, seq_lens, loc, p.scale]


def test_error_head_count_not_multiple_of_kv_heads():
    p = make_problem([5], heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="query: expected a head count that is a multiple of the KV head count 2"):
        run_attention(p)


@pytest.mark.parametrize("index,name", [(3, "block_table"), (4, "seq_lens"), (5, "query_start_loc")])
def test_error_metadata_not_int32(index, name):
    args = _attn_args(make_problem([5, 7]))
    args[index] = args[index].long()
    with pytest.raises(ValueError, match=f"{name}: expected dtype torch.int32"):
        ops.attention(*args)


def test_error_cache_dtype_differs_from_query():
    args = _attn_args(make_problem([5]))
    args[1] = args[1].half()
    with pytest.raises(ValueError, match=r"key_cache: expected dtype torch.float32 \(the query's\), got torch.float16"):
        ops.attention(*args)


def test_error_block_id_out_of_range():
    p = make_problem([20, 5], block_size=16)
    p.block_table[0, 1] = p.key_cache.shape[0]
    with pytest.raises(ValueError, match="block_table: expected block ids in .* got block .* at row 0, column 1"):
        run_attention(p)


def test_unused_block_ids_are_not_checked():
    p = make_problem([5], block_size=16, max_blocks=2)
    p.block_table[0, 1] = -7
    run_attention(p)


def test_error_seq_len_larger_than_its_blocks():
    p = make_problem([20], block_size=16, max_blocks=2)
    p.seq_lens = [33]
    with pytest.raises(ValueError, match="seq_lens|context_lens|actual_seq_lengths_kv"):
        run_attention(p)
    with pytest.raises(ValueError, match=r"context_lens: expected lengths of at most 32 .* got 33 for sequence 0"):
        run_pa(p, torch.empty(10**6, dtype=torch.uint8))


def test_error_query_start_loc_not_increasing():
    args = _attn_args(make_problem([5, 7, 9]))
    args[5] = torch.tensor([0, 2, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc: expected non-decreasing cumulative query offsets"):
        ops.attention(*args)


def test_error_query_start_loc_not_ending_at_tokens():
    args = _attn_args(make_problem([5, 7, 9]))
    args[5] = torch.tensor([0, 1, 2, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc: expected offsets ending at the number of query tokens 3"):
        ops.attention(*args)


def test_error_pa_given_several_tokens_per_sequence():
    p = make_problem([5, 7], query_lens=[2, 1])
    with pytest.raises(ValueError, match="query: PA is decode-only"):
        run_pa(p)


def test_error_query_longer_than_its_sequence():
    p = make_problem([3, 7], query_lens=[2, 1])
    p.seq_lens = [1, 7]
    with pytest.raises(ValueError, match="actual_seq_lengths_kv: expected a length covering the sequence's 2 query tokens"):
        run_fia(p)


def test_reshape_and_cache_writes_slots_and_skips_padding():
    kc = torch.zeros(4, 2, 1, 3)
    vc = torch.zeros(4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3) + 1
    ops.reshape_and_cache(key, -key, kc, vc, torch.tensor([5, -1, 0]))
    assert torch.equal(kc.view(-1, 1, 3)[5], key[0])
    assert torch.equal(vc.view(-1, 1, 3)[0], -key[2])
    assert kc.count_nonzero() == 6


def test_reshape_and_cache_errors():
    kc = torch.zeros(4, 2, 1, 3)
    key = torch.ones(2, 1, 3)
    with pytest.raises(ValueError, match="slot_mapping: expected slots below 8"):
        ops.reshape_and_cache(key, key, kc, kc.clone(), torch.tensor([8, 0]))
    with pytest.raises(ValueError, match="slot_mapping: expected a \\[2\\] torch.int32 or torch.int64 tensor"):
        ops.reshape_and_cache(key, key, kc, kc.clone(), torch.tensor([1, 0], dtype=torch.int16))
    with pytest.raises(ValueError, match="key_cache: expected dtype torch.float32"):
        ops.reshape_and_cache(key, key, kc.half(), kc.clone(), torch.tensor([1, 0]))


# ---------------------------------------------------------------- opcheck


def test_opcheck_all_ops():
    p = make_problem([40, 7], heads=4, kv_heads=2, dim=16)
    seq_lens, loc = p.tensors()
    ws = torch.empty(1 << 16, dtype=torch.uint8)
    cases = [
        (ops.attention.default, (p.query, p.key_cache, p.value_cache, p.block_table, seq_lens, loc, p.scale)),
        (ops.paged_attention.default,
         (p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, p.scale, ws, torch.empty_like(p.query))),
        (ops.fused_infer_attention.default,
         (p.query, p.key_cache, p.value_cache, p.block_table, [1, 2], p.seq_lens, p.scale, ws, torch.empty_like(p.query))),
        (ops.reshape_and_cache.default,
         (torch.randn(2, 2, 16), torch.randn(2, 2, 16), p.key_cache.clone(), p.value_cache.clone(), torch.tensor([3, -1]))),
        (ops.workspace.default, (64, torch.device("cpu"))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


# ---------------------------------------------------------------- tiling


def test_pa_workspace_peaks_at_an_interior_length():
    shape = tiling.AttentionShape(8, 2, 64, 128)
    peak = tiling.max_workspace(tiling.PA, shape, 1, 8192)
    at_max_len = tiling.workspace_nbytes(tiling.PA, shape, [8192])
    assert 1 < peak.argmax_len < 8192
    assert peak.nbytes > at_max_len
    assert peak.nbytes == tiling.workspace_nbytes(tiling.PA, shape, [peak.argmax_len])


def test_workspace_nbytes_is_a_sum_over_tokens():
    shape = tiling.AttentionShape(4, 2, 64, 16)
    one = tiling.workspace_nbytes(tiling.FIA, shape, [3000])
    assert one == 3 * 4 * 65 * 4
    assert tiling.workspace_nbytes(tiling.FIA, shape, [3000, 10], [5, 1]) == 5 * one


@pytest.mark.parametrize("index,name", [(1, "key_cache"), (3, "block_table"), (4, "seq_lens")])
def test_error_tensor_on_another_device(index, name):
    args = _attn_args(make_problem([5, 7]))
    args[index] = args[index].to("meta")
    with pytest.raises(ValueError, match=f"{name}: expected device cpu \\(the query's\\), got meta"):
        ops.attention(*args)
