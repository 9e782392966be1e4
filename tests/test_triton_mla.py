"""MLA's CUDA path on the CPU: the Triton MLA kernels (`ops/cuda_triton_mla.py`) through Triton's
interpreter against the dense oracle of tests/mla_helpers.py (the latent decompressed into per-head
K/V and attended the long way), the workspace they write, their cache write, the device-length op's
reference kernel (`ops/cuda_mla.py`), and the kernels compiled for Hopper (sm_90) without a GPU.

Without CUDA, tests/conftest.py sets `TRITON_INTERPRET=1`, so the kernels run on CPU tensors; with
CUDA they run compiled on the GPU. Problems are small (latent 32, rope 8, a few heads) but for one
test at DeepSeek's 512 + 64: the interpreter is slow.
"""
from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch

import ascend_compile.ops  # noqa: F401
from ascend_compile.errors import WorkspaceTooSmall
from ascend_compile.ops import cuda, tiling
from tests.helpers import triton_kernels
from tests.mla_helpers import make_mla_problem
from tests.sm90 import HOPPER_SHARED, compile_rows

ops = torch.ops.ascend
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = dict(atol=2e-5, rtol=1e-4)
#: Small knobs so that short sequences split: 16-key tiles, splits of one tile and up.
SPLITTY = dict(key_tile=16, min_split_tiles=1)
#: Lengths around the 16-token blocks and key tiles, a padding sequence (0 keys, one query token).
LENS = [1, 15, 16, 17, 33, 0, 50]
MIXED = [1, 3, 16, 2, 5, 1, 7]


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    """`ops/cuda_triton_mla.py`: interpreted on the CPU (tests/conftest.py), compiled with CUDA."""
    return triton_kernels("cuda_triton_mla", DEVICE)


def shape_of(p) -> tiling.AttentionShape:
    return tiling.AttentionShape.of_mla(p.q_nope, p.q_pe, p.kv_c_cache)


def run_triton(kernels, p, num_splits, guard=0, **knobs):
    """The Triton MLA on problem `p` into an output and a workspace full of garbage (NaN bytes) of
    exactly `dev_workspace_nbytes` plus `guard` bytes: (latent output, workspace), on the CPU."""
    seq_lens, loc = p.tensors()
    nbytes = cuda.dev_workspace_nbytes(p.q_nope.shape[0], shape_of(p), num_splits)
    ws = torch.full((nbytes + guard,), 0xFF, dtype=torch.uint8)
    out = torch.full_like(p.q_nope, float("nan"))
    args = [t.to(DEVICE) for t in (p.q_nope, p.q_pe, p.kv_c_cache, p.k_pe_cache, p.block_table, loc, seq_lens)]
    ws, out_dev = ws.to(DEVICE), out.to(DEVICE)
    kernels.mla_attention_dev(*args, p.scale, ws, out_dev, num_splits, **knobs)
    return out_dev.cpu(), ws.cpu()


def reference_dev(p, num_splits):
    """The device-length op's reference kernel on the CPU: the latent output."""
    seq_lens, loc = p.tensors()
    ws = torch.empty(cuda.dev_workspace_nbytes(p.q_nope.shape[0], shape_of(p), num_splits), dtype=torch.uint8)
    out = torch.empty_like(p.q_nope)
    ops.mla_fused_infer_attention_dev(p.q_nope, p.q_pe, p.kv_c_cache, p.k_pe_cache, p.block_table, loc, seq_lens,
                                      p.scale, ws, out, num_splits)
    return out


def assert_oracle(latent, p):
    """The latent output, up-projected, is the dense oracle's; padding sequences' rows are zeros."""
    torch.testing.assert_close(p.up_project(latent), p.dense(), **TOL)
    loc = p.query_start_loc
    for b, n in enumerate(p.seq_lens):
        if n == 0:
            assert torch.equal(latent[loc[b]:loc[b + 1]], torch.zeros_like(latent[loc[b]:loc[b + 1]]))


@pytest.mark.parametrize("heads", [1, 4, 16])
@pytest.mark.parametrize("query_lens", [[1] * len(LENS), MIXED], ids=["decode", "mixed"])
def test_triton_mla_equals_the_dense_oracle(kernels, heads, query_lens):
    """One latent head for 1, 4 and 16 query heads, decode and mixed (causal chunks), split 3 ways."""
    p = make_mla_problem(LENS, query_lens, heads=heads, seed=heads)
    latent, _ = run_triton(kernels, p, 3, **SPLITTY)
    assert_oracle(latent, p)


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("block_size", [8, 12, 32])  # below, not a multiple of, a multiple of the key tile
def test_triton_mla_splits_and_block_sizes(kernels, splits, block_size):
    """Each split count, with the per-key block lookup (8, 12) and one lookup per key tile (32)."""
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 0]
    p = make_mla_problem(lens, [1, 2, 1, 4, 9, 1], heads=4, block_size=block_size, seed=splits + block_size)
    latent, _ = run_triton(kernels, p, splits, **SPLITTY)
    assert_oracle(latent, p)


@pytest.mark.parametrize("heads, tile_rows", [(16, 4), (20, 16)])
def test_triton_mla_head_groups(kernels, heads, tile_rows):
    """More heads than a program's rows: head groups of `tile_rows` heads (16 heads in 4 groups; 20
    heads in a group of 16 and one of 4), each reading the keys once."""
    p = make_mla_problem([40, 9, 0, 23], [1, 3, 1, 2], heads=heads, seed=heads)
    latent, _ = run_triton(kernels, p, 2, tile_rows=tile_rows, **SPLITTY)
    assert_oracle(latent, p)


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 6, 1, 3]], ids=["decode", "mixed"])
def test_triton_mla_at_deepseek_dims(kernels, query_lens):
    """kv_lora_rank 512, rope 64, 16 heads (DeepSeek-V3 at TP 8): split, and on the default tiles."""
    p = make_mla_problem([5, 40, 0, 33], query_lens, heads=16, kv_lora_rank=512, rope_dim=64, qk_nope_dim=32,
                         v_dim=16, seed=7)
    assert_oracle(run_triton(kernels, p, 2, **SPLITTY)[0], p)
    assert_oracle(run_triton(kernels, p, 1)[0], p)


def test_triton_mla_bf16_matches_the_reference_op(kernels):
    p = make_mla_problem([9, 40, 16, 0], [1, 5, 2, 1], heads=8, dtype=torch.bfloat16, seed=8)
    latent, _ = run_triton(kernels, p, 2, **SPLITTY)
    torch.testing.assert_close(latent.float(), reference_dev(p, 2).float(), atol=3e-2, rtol=3e-2)


def test_triton_mla_rope_part_is_in_the_score(kernels):
    p = make_mla_problem([50, 70], [1, 3], seed=9)
    expected = p.dense()
    p.q_pe = torch.zeros_like(p.q_pe)
    assert (p.up_project(run_triton(kernels, p, 2, **SPLITTY)[0]) - expected).abs().max() > 1e-3


def test_triton_mla_workspace_holds_the_split_records(kernels):
    """The workspace is really used: the records of each token whose sequence used more than one
    split (`_fia_num_splits` on the device) are written and combine into the output; the others,
    and a guard behind the workspace, keep their garbage bytes."""
    heads, rank, splits = 4, 32, 3
    p = make_mla_problem([40, 33, 3, 0, 70], [1, 9, 2, 1, 2], heads=heads, kv_lora_rank=rank, seed=10)
    latent, ws = run_triton(kernels, p, splits, guard=64, **SPLITTY)
    assert_oracle(latent, p)
    assert torch.equal(ws[-64:], torch.full((64,), 0xFF, dtype=torch.uint8))
    tokens = p.q_nope.shape[0]
    floats = ws[:-64].view(torch.float32)
    partials = floats[:tokens * splits * heads * rank].view(tokens, splits, heads, rank)
    lse = floats[tokens * splits * heads * rank:].view(tokens, splits, heads)
    # 4-token query tiles (16 rows of 4 heads): 3 key tiles, 1 query tile -> 3 splits; 3 query tiles -> 1;
    # 1 key tile -> 1; no keys -> 1; 5 key tiles -> 3
    per_seq = [3, 1, 1, 1, 3]
    for token, n in enumerate(n for n, q in zip(per_seq, p.query_lens) for _ in range(q)):
        if n == 1:
            assert torch.isnan(lse[token]).all() and torch.isnan(partials[token]).all(), token
            continue
        assert torch.isfinite(lse[token]).all(), token
        weights = torch.softmax(lse[token] * torch.log(torch.tensor(2.0)), dim=0)  # base-2 log-sum-exps
        torch.testing.assert_close((weights.unsqueeze(-1) * partials[token]).sum(0), latent[token], **TOL)


def test_triton_mla_one_launch_serves_every_length(kernels):
    """Fixed splits and workspace: the same buffers give the oracle's answer as the lengths change."""
    p = make_mla_problem([48, 48], [2, 2], heads=4, seed=11)
    ws = torch.empty(cuda.dev_workspace_nbytes(4, shape_of(p), 3), dtype=torch.uint8, device=DEVICE)
    q_nope, q_pe, kv_c, k_pe, table = (t.to(DEVICE) for t in (p.q_nope, p.q_pe, p.kv_c_cache, p.k_pe_cache,
                                                              p.block_table))
    out = torch.empty_like(q_nope)
    seq_lens = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    loc = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE)
    for lens in ([48, 2], [2, 17], [33, 48]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        kernels.mla_attention_dev(q_nope, q_pe, kv_c, k_pe, table, loc, seq_lens, p.scale, ws, out, 3, **SPLITTY)
        p.seq_lens = lens
        assert_oracle(out.cpu(), p)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_triton_mla_cache_write_skips_padding_and_outside_slots(kernels, slot_dtype):
    gen = torch.Generator().manual_seed(12)
    kv_c, k_pe = torch.randn(5, 32, generator=gen), torch.randn(5, 8, generator=gen)
    kv_c_cache, k_pe_cache = torch.randn(4, 8, 32, generator=gen), torch.randn(4, 8, 8, generator=gen)
    slots = torch.tensor([3, -1, 31, 8, -1], dtype=slot_dtype)
    expected_c, expected_p = kv_c_cache.clone(), k_pe_cache.clone()
    ops.mla_cache_write(kv_c, k_pe, expected_c, expected_p, slots)
    got_c, got_p = kv_c_cache.to(DEVICE), k_pe_cache.to(DEVICE)
    kernels.mla_cache_write(kv_c.to(DEVICE), k_pe.to(DEVICE), got_c, got_p, slots.to(DEVICE))
    assert torch.equal(got_c.cpu(), expected_c) and torch.equal(got_p.cpu(), expected_p)
    outside = torch.tensor([32, -1, 0, 1 << 20, 7], dtype=slot_dtype)  # past the cache: skipped, not written
    before_c, before_p = got_c.clone(), got_p.clone()
    kernels.mla_cache_write(kv_c.to(DEVICE), k_pe.to(DEVICE), got_c, got_p, outside.to(DEVICE))
    changed = (got_c != before_c).any(-1).nonzero().tolist()
    assert changed == [[0, 0], [0, 7]] and (got_p != before_p).any(-1).nonzero().tolist() == [[0, 0], [0, 7]]


# ---------------------------------------------------------------- the device-length op's reference kernel


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_dev_op_reference_path_matches_the_oracle(splits):
    p = make_mla_problem([0, 1, 16, 17, 130], [1, 1, 3, 2, 9], heads=4, seed=splits)
    assert_oracle(reference_dev(p, splits), p)


def test_dev_op_checks_the_workspace_and_arguments():
    p = make_mla_problem([20, 3], [2, 1], heads=4)
    seq_lens, loc = p.tensors()
    need = cuda.dev_workspace_nbytes(3, shape_of(p), 4)
    assert need == 3 * 4 * 4 * (32 + 1) * 4  # T * S * H * (kv_lora_rank + 1) floats: no rope in the records
    out = torch.empty_like(p.q_nope)
    args = (p.q_nope, p.q_pe, p.kv_c_cache, p.k_pe_cache, p.block_table)
    with pytest.raises(WorkspaceTooSmall, match=f"needs {need} bytes"):
        ops.mla_fused_infer_attention_dev(*args, loc, seq_lens, p.scale, torch.empty(need - 1, dtype=torch.uint8),
                                          out, 4)
    ws = torch.empty(need, dtype=torch.uint8)
    with pytest.raises(ValueError, match="seq_lens: expected dtype torch.int32"):
        ops.mla_fused_infer_attention_dev(*args, loc, seq_lens.long(), p.scale, ws, out, 4)
    with pytest.raises(ValueError, match="query_start_loc: expected a 1-D tensor of length 3"):
        ops.mla_fused_infer_attention_dev(*args, loc[:2], seq_lens, p.scale, ws, out, 4)
    with pytest.raises(ValueError, match="num_splits: expected a positive int"):
        ops.mla_fused_infer_attention_dev(*args, loc, seq_lens, p.scale, ws, out, 0)
    torch.library.opcheck(ops.mla_fused_infer_attention_dev.default, (*args, loc, seq_lens, p.scale, ws, out, 4))


def test_mla_splits_count_head_groups():
    """On a GPU, MLA graphs split for their programs: sequences x head groups of 16 heads."""
    rule = cuda.gpu_splits(num_sms=132, max_model_len=4096)
    small, wide = (tiling.AttentionShape(h, 1, 512, 64, rope_dim=64) for h in (16, 128))
    assert [cuda.mla_head_groups(h) for h in (1, 16, 20, 128)] == [1, 1, 2, 8]
    assert rule(tiling.MLA, small, 8) == cuda.choose_num_splits(8, 4096, 64, 132) == 16
    assert rule(tiling.MLA, wide, 8) == cuda.choose_num_splits(64, 4096, 64, 132) == 5


# ---------------------------------------------------------------- compiled for Hopper (no GPU needed)

#: The MLA kernels compiled for sm_90 (`tests/sm90.py`) as `mla_attention_dev` and `mla_cache_write`
#: launch them: the split kernel in bf16 and fp32 for 16 and 128 heads (head groups), one block-table
#: entry per key tile (block 64) and one per key (block 16); the reduce over 512-wide records.
COMPILE_SCRIPT = r"""
from ascend_compile.ops import cuda, cuda_triton_mla as m
from ascend_compile.ops.cuda_launch import REDUCE_SPLITS

for dt in ("bf16", "fp32"):
    types = {"q_nope": "*" + dt, "q_pe": "*" + dt, "kv_c_cache": "*" + dt, "k_pe_cache": "*" + dt,
             "block_table": "*i32", "seq_lens": "*i32", "query_start_loc": "*i32", "workspace": "*fp32",
             "out": "*" + dt, "scale_log2": "fp32"}
    for heads, block in ((16, 64), (16, 16), (128, 64)):
        head_rows, block_q = cuda.mla_tile(heads)
        consts = dict(NUM_HEADS=heads, HEAD_ROWS=head_rows, LATENT=512, ROPE=64, BLOCK_L=512, BLOCK_R=64,
                      BLOCK_N=m.MLA_KEY_TILE, BLOCK_Q=block_q, BLOCK_M=max(16, block_q * head_rows),
                      BLOCK_SIZE=block, MIN_TILES=m.MLA_MIN_SPLIT_TILES, DIRECT=False,
                      PRECISION="ieee" if dt == "fp32" else "tf32", DOT_FP32=False, NUM_STAGES=m.MLA_NUM_STAGES)
        report("split", dt, heads, block, result=build(m._mla_split_kernel, types, consts, m.MLA_NUM_STAGES,
                                                       m.MLA_NUM_WARPS, f"{m.MLA_KEY_TILE}x512x"))
    consts = dict(NUM_HEADS=16, HEAD_DIM=512, BLOCK_D=512, BLOCK_S=REDUCE_SPLITS, BLOCK_N=m.MLA_KEY_TILE, BLOCK_Q=1,
                  BLOCK_B=16, MIN_TILES=m.MLA_MIN_SPLIT_TILES, DECODE=False, WINDOW=False, HAS_SINKS=False)
    report("reduce", dt, 16, 0, result=build(m._reduce_kernel, {"seq_lens": "*i32", "query_start_loc": "*i32",
           "workspace": "*fp32", "out": "*" + dt, "sinks": "*i32"}, consts, 1))
    report("cache", dt, 0, 0, result=build(m._mla_cache_write_kernel, {"kv_c": "*" + dt, "k_pe": "*" + dt,
           "kv_c_cache": "*" + dt, "k_pe_cache": "*" + dt, "slot_mapping": "*i64"},
           dict(LATENT=512, ROPE=64, BLOCK_L=512, BLOCK_R=64), 1))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels are compiled and run for real")
def test_triton_mla_kernels_compile_for_hopper_without_spills():
    """At DeepSeek's 512 + 64 dims every MLA kernel compiles for sm_90 without spilling, within the
    227 KB of shared memory a Hopper program may use, and the split kernel's key loop is pipelined:
    its latent tiles are copied asynchronously into `MLA_NUM_STAGES - 1` shared buffers."""
    pytest.importorskip("triton", reason="needs triton")
    pytest.importorskip("triton.compiler", reason="needs triton's compiler API")
    from ascend_compile.ops.cuda_triton_mla import MLA_NUM_STAGES

    rows, stdout = compile_rows(COMPILE_SCRIPT)
    assert len(rows) == 10, stdout
    for kernel, dt, heads, block, regs, stack, shared, depth in rows:
        assert int(stack) <= 0, stdout  # no stack: nothing spilled
        assert int(shared) <= HOPPER_SHARED, stdout
        if kernel == "split":
            assert int(depth) >= MLA_NUM_STAGES - 1 >= 1, stdout


def test_the_kernel_benchmark_s_mla_case_calls_the_mla_kernel():
    """`benchmarks/gpu_kernels.py`'s MLA case on the CPU (the reference kernel behind the same op):
    the op it times computes MLA on its inputs, and its byte count is the latent cache read once."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import gpu_kernels
    finally:
        sys.path.pop(0)
    m = gpu_kernels.LatentPaged([300, 70], [1, 3], torch.device("cpu"))
    m.call(2)()
    expected = ops.mla_attention(m.q_nope, m.q_pe, m.kv_c_cache, m.k_pe_cache, m.block_table, m.seq_lens,
                                 m.query_start_loc, gpu_kernels.MLA_SCALE)
    torch.testing.assert_close(m.out.float(), expected.float(), atol=3e-2, rtol=3e-2)
    assert m.bytes == (370 * (512 + 64) + 4 * 16 * (2 * 512 + 64)) * 2
