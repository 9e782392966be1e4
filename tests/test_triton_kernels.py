"""The CUDA path on the CPU: the Triton kernels through Triton's interpreter against the reference,
the device-length ops' reference kernels, and `use_device_lengths` on the example model's graphs.

Without CUDA, tests/conftest.py sets `TRITON_INTERPRET=1` before triton is imported, so the kernel
tests run the kernels on CPU tensors; with CUDA they run them compiled, on the GPU. They skip when
triton (or numpy, which its interpreter needs) is missing. One more test compiles the kernels for
Hopper on the CPU (Triton ships its own ptxas) to catch what the interpreter does not check.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import os
import random
import subprocess
import sys
from types import ModuleType

import pytest
import torch
from torch import fx

import ascend_compile.ops  # noqa: F401
from ascend_compile.config import CompileConfig
from ascend_compile.errors import CaptureError, WorkspaceTooSmall
from ascend_compile.backend import backend
from ascend_compile.ops import cuda, tiling
from ascend_compile.ops.features import AttentionFeatures
from ascend_compile.torch_support import torch_release
from ascend_compile.passes.device_lengths import use_device_lengths
from ascend_compile.passes.fx_utils import clone_graph_module, is_op
from ascend_compile.passes.inner_compile import compile_inner
from ascend_compile.passes.kernel_call import HOST_LENGTH_OPS, HOST_META_KEY, KernelCall, host_sources, kernel_calls
from ascend_compile.passes.pipeline import rewrite_buckets
from ascend_compile.passes.workspaces import GraphKey
from ascend_compile.runtime import create_runtime
from ascend_compile.runtime.base import GraphRuntime
from ascend_compile.runtime.cuda import CudaRuntime
from ascend_compile.runtime.eager import EagerRuntime
from ascend_compile.runtime.sim import SimRuntime
from ascend_compile.targets import CudaTarget, Target
from examples.llama import LlamaConfig, PagedBatch, build
from tests.helpers import TOLERANCE, make_problem, triton_kernels
from tests.sm90 import HOPPER_SHARED, compile_rows

ops = torch.ops.ascend
backend_mod = importlib.import_module("ascend_compile.backend")  # the module, not the function it exports
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    """`ops/cuda_triton.py`: interpreted on the CPU (tests/conftest.py), compiled with CUDA."""
    return triton_kernels("cuda_triton", DEVICE)


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def run_triton(kernels, p, num_splits, decode, guard=0, workspace=False, **knobs):
    """The Triton attention on problem `p`, into an output and a workspace full of garbage (NaN
    bytes) of exactly `dev_workspace_nbytes` plus `guard` bytes; `knobs` go to `attention_dev`.
    Returns the output (and the workspace, with `workspace=True`)."""
    seq_lens, loc = p.tensors()
    shape = tiling.AttentionShape.of(p.query, p.key_cache)
    nbytes = cuda.dev_workspace_nbytes(p.query.shape[0], shape, num_splits)
    ws = torch.full((nbytes + guard,), 0xFF, dtype=torch.uint8)
    out = torch.full_like(p.query, float("nan"))
    args = on_device(p.query, p.key_cache, p.value_cache, p.block_table, seq_lens, loc, ws, out)
    query, key_cache, value_cache, block_table, seq_lens, loc, ws, out = args
    kernels.attention_dev(query, key_cache, value_cache, block_table, seq_lens, None if decode else loc,
                          p.scale, ws, out, num_splits, **knobs)
    return (out.cpu(), ws.cpu()) if workspace else out.cpu()


def reference_dev(p, num_splits, decode, **features):
    """The device-length op's reference kernel (`ops/reference.py`) on the CPU for problem `p`
    (FIA with `features`: window, soft_cap, sinks)."""
    seq_lens, loc = p.tensors()
    shape = tiling.AttentionShape.of(p.query, p.key_cache)
    ws = torch.empty(cuda.dev_workspace_nbytes(p.query.shape[0], shape, num_splits), dtype=torch.uint8)
    out = torch.empty_like(p.query)
    args = (p.query, p.key_cache, p.value_cache, p.block_table)
    if decode and not features:
        ops.paged_attention_dev(*args, seq_lens, p.scale, ws, out, num_splits)
    else:  # PA takes no features: decode with them is FIA of one token per sequence
        ops.fused_infer_attention_dev(*args, loc, seq_lens, p.scale, ws, out, num_splits, **features)
    return out


def assert_exact(out, p, num_splits, decode, **features):
    """`out` matches the reference kernel and the dense softmax within the float32 tolerance."""
    tol = dict(atol=TOLERANCE[torch.float32], rtol=1e-4)
    torch.testing.assert_close(out, reference_dev(p, num_splits, decode, **features), **tol)
    torch.testing.assert_close(out, p.dense(**features), **tol)


# ---------------------------------------------------------------- Triton kernels (interpreted on the CPU)


@pytest.mark.parametrize(
    "heads, kv_heads, splits",
    [(4, 2, 1), (4, 2, 3), (8, 1, 2), (2, 2, 4)],  # GQA, MQA (8 heads share 1), MHA
)
def test_triton_pa_matches_dense_across_block_boundaries(kernels, heads, kv_heads, splits):
    lens = [1, 15, 16, 17, 33, 0]  # around the 16-token blocks, and a padding row (length 0)
    p = make_problem(lens, heads=heads, kv_heads=kv_heads, dim=16, block_size=16, seed=heads + splits)
    out = run_triton(kernels, p, splits, decode=True)
    torch.testing.assert_close(out, p.dense(), atol=TOLERANCE[torch.float32], rtol=1e-4)
    assert torch.equal(out[5], torch.zeros_like(out[5]))  # padding rows yield zeros


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_fia_several_query_tokens_are_causal(kernels, splits):
    lens, qlens = [5, 16, 0, 33, 1], [3, 1, 1, 4, 1]  # a padding sequence (0 keys) keeps one token
    p = make_problem(lens, qlens, heads=4, kv_heads=1, dim=16, block_size=16, seed=splits)
    out = run_triton(kernels, p, splits, decode=False)
    torch.testing.assert_close(out, p.dense(), atol=TOLERANCE[torch.float32], rtol=1e-4)
    assert torch.equal(out[4], torch.zeros_like(out[4]))


def test_triton_fia_sequences_longer_than_a_tile_and_without_queries(kernels):
    # 4 kv heads of 2 grouped heads: 8 tokens per tile, so the 11-token sequence spans two tiles.
    lens, qlens = [11, 20, 6], [11, 0, 2]
    p = make_problem(lens, qlens, heads=8, kv_heads=4, dim=16, block_size=16, seed=3)
    out = run_triton(kernels, p, 2, decode=False)
    torch.testing.assert_close(out, p.dense(), atol=TOLERANCE[torch.float32], rtol=1e-4)


def test_triton_odd_head_dim_and_block_size(kernels):
    p = make_problem([7, 12, 13, 30], heads=6, kv_heads=2, dim=24, block_size=12, seed=5)
    for decode in (True, False):
        out = run_triton(kernels, p, 2, decode=decode)
        torch.testing.assert_close(out, p.dense(), atol=TOLERANCE[torch.float32], rtol=1e-4)


def test_triton_bf16_matches_reference_op(kernels):
    p = make_problem([9, 40, 16], heads=4, kv_heads=2, dim=32, block_size=16, dtype=torch.bfloat16, seed=7)
    seq_lens, _ = p.tensors()
    shape = tiling.AttentionShape.of(p.query, p.key_cache)
    ws = torch.empty(cuda.dev_workspace_nbytes(3, shape, 2), dtype=torch.uint8)
    expected = torch.empty_like(p.query)
    ops.paged_attention_dev(p.query, p.key_cache, p.value_cache, p.block_table, seq_lens, p.scale, ws, expected, 2)
    out = run_triton(kernels, p, 2, decode=True)
    # on a GPU the kernel multiplies bfloat16 probabilities by the values, as flash attention does
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_triton_one_launch_serves_every_length(kernels):
    """Fixed splits and workspace: the same buffers give the right answer as the lengths change."""
    base = make_problem([48, 48], heads=4, kv_heads=2, dim=16, block_size=16, seed=11)
    shape = tiling.AttentionShape.of(base.query, base.key_cache)
    ws = torch.empty(cuda.dev_workspace_nbytes(2, shape, 3), dtype=torch.uint8, device=DEVICE)
    query, key_cache, value_cache, block_table, out = on_device(
        base.query, base.key_cache, base.value_cache, base.block_table, torch.empty_like(base.query))
    seq_lens = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    for lens in ([48, 1], [0, 17], [33, 48]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        kernels.attention_dev(query, key_cache, value_cache, block_table, seq_lens, None, base.scale, ws, out, 3)
        base.seq_lens = lens
        torch.testing.assert_close(out.cpu(), base.dense(), atol=TOLERANCE[torch.float32], rtol=1e-4)


def test_triton_reshape_and_cache_skips_padding_slots(kernels):
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    key_cache, value_cache = torch.randn(4, 8, 2, 16, generator=gen), torch.randn(4, 8, 2, 16, generator=gen)
    slots = torch.tensor([3, -1, 31, 8, -1])
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    ops.reshape_and_cache(key, value, expected_k, expected_v, slots)
    key, value, key_cache, value_cache, slots = on_device(key, value, key_cache, value_cache, slots)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.cpu(), expected_k) and torch.equal(value_cache.cpu(), expected_v)


# Small knobs so that short sequences split: 16-key tiles, splits of one tile and up.
SPLITTY = dict(key_tile=16, min_split_tiles=1)


@pytest.mark.parametrize("block_size", [8, 12, 16, 64])  # below, not a multiple of, and multiples of the tile
def test_triton_constexpr_block_sizes(kernels, block_size):
    """`BLOCK_SIZE` is a compile-time constant: the per-key lookup (8, 12) and one lookup per tile
    (16, 32, 64 with 16-key tiles), around block boundaries, decode and FIA."""
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 0]
    p = make_problem(lens, heads=4, kv_heads=2, dim=16, block_size=block_size, seed=block_size)
    assert_exact(run_triton(kernels, p, 3, decode=True, **SPLITTY), p, 3, decode=True)
    m = make_problem(lens, [1, 2, 1, 3, 4, 1], heads=4, kv_heads=2, dim=16, block_size=block_size, seed=block_size)
    assert_exact(run_triton(kernels, m, 2, decode=False, **SPLITTY), m, 2, decode=False)


def test_decode_schedule_fits_the_workspace_and_balances():
    """The host mirror of the device schedule: never more units than the workspace holds, S splits
    for uniform batches, the long sequence of an uneven batch split far more than S times."""
    pytest.importorskip("triton", reason="the host schedule mirrors ops/cuda_triton_device.py, which imports triton")
    from ascend_compile.ops.cuda_launch import MIN_SPLIT_TILES, decode_schedule

    rng = random.Random(0)
    for _ in range(2000):
        num_seqs, splits = rng.randint(1, 40), rng.randint(2, 8)
        lens = [rng.choice([0, rng.randint(1, 64), rng.randint(1, 1 << 15)]) for _ in range(num_seqs)]
        chunk, units = decode_schedule(lens, splits, key_tile=16, min_split_tiles=rng.randint(1, 4))
        assert sum(units) <= num_seqs * splits and min(units) >= 1
        assert all(-(-n // 16) <= chunk * u for n, u in zip(lens, units))  # every tile has a unit
    assert decode_schedule([1024] * 8, 4) == (4, [4] * 8)  # uniform: S splits of 256 tokens
    assert decode_schedule([100] * 8, 4) == (MIN_SPLIT_TILES, [1] * 8)  # short: one split each, direct
    chunk, units = decode_schedule([32768] + [64] * 127, 2)  # one long sequence among short ones
    assert units[0] == 128 and units[1:] == [1] * 127 and chunk * 64 == 256  # vs 2 splits of 16384 keys
    # the GPU's fair share bounds the chunk: a large uniform batch keeps one unit per sequence (no
    # reduce), an uneven one still splits its long sequence (132 SMs x 3 programs, 8 KV heads)
    assert decode_schedule([1024] * 256, 2, num_kv_heads=8, slots=396)[1] == [1] * 256
    chunk, units = decode_schedule([32768] + [64] * 255, 2, num_kv_heads=8, slots=396)
    assert chunk == 16 and units[0] == 32 and units[1:] == [1] * 255


def test_triton_device_side_split_counts(kernels):
    """Which workspace records the kernels write is the device's schedule: decode units per
    sequence (a sequence of one unit writes its output directly), FIA splits per sequence, and
    nothing past the workspace (a guard behind it stays untouched)."""
    from ascend_compile.ops.cuda_launch import decode_schedule

    heads, dim, splits = 4, 16, 3
    p = make_problem([300, 5, 0, 90, 17], heads=heads, kv_heads=2, dim=dim, block_size=16, seed=21)
    chunk, units = decode_schedule(p.seq_lens, splits, key_tile=16, min_split_tiles=1)
    assert units == [7, 1, 1, 2, 1] and chunk == 3
    # with 8 slots, 28 tiles x 2 KV heads make a fair share of 7 tiles per unit
    assert decode_schedule(p.seq_lens, splits, key_tile=16, min_split_tiles=1, num_kv_heads=2, slots=8) == \
        (7, [3, 1, 1, 1, 1])
    records = 5 * splits
    for slots, units in ((kernels.UNBOUNDED_SLOTS, [7, 1, 1, 2, 1]), (8, [3, 1, 1, 1, 1])):
        out, ws = run_triton(kernels, p, splits, decode=True, guard=64, workspace=True, slots=slots, **SPLITTY)
        assert_exact(out, p, splits, decode=True)
        assert torch.equal(ws[-64:], torch.full((64,), 0xFF, dtype=torch.uint8))
        lse = ws[:-64].view(torch.float32)[records * heads * dim:].view(records, heads)
        written = [bool(torch.isfinite(lse[u]).all()) for u in range(records)]
        expected = [False] * records
        first = 0
        for n in units:
            for u in range(first, first + n):
                expected[u] = n > 1
            first += n
        assert written == expected, slots

    # FIA: min(S, ceil(kv tiles / 1), ceil(S / query tiles)) splits; 4-token tiles (16 rows, group 4)
    m = make_problem([40, 33, 3, 0], [1, 9, 2, 1], heads=8, kv_heads=2, dim=dim, block_size=16, seed=22)
    out, ws = run_triton(kernels, m, splits, decode=False, guard=64, workspace=True, **SPLITTY)
    assert_exact(out, m, splits, decode=False)
    assert torch.equal(ws[-64:], torch.full((64,), 0xFF, dtype=torch.uint8))
    tokens = m.query.shape[0]
    lse = ws[:-64].view(torch.float32)[tokens * splits * 8 * dim:].view(tokens, splits, 8)
    per_seq = [3, 1, 1, 1]  # 3 tiles / 1 query tile; 9 tokens = 3 query tiles; 1 tile; no keys
    token_splits = [n for n, q in zip(per_seq, m.query_lens) for _ in range(q)]
    for token, n in enumerate(token_splits):
        used = torch.isfinite(lse[token]).all(dim=1) | (lse[token] == float("-inf")).all(dim=1)
        assert used.tolist() == [n > 1 and s < n for s in range(splits)], token


@pytest.mark.parametrize("decode", [True, False])
def test_triton_uneven_batch(kernels, decode):
    """Very different lengths in one batch: the long sequence takes most of the units."""
    lens = [700, 3, 0, 40, 1, 260, 16]
    p = make_problem(lens, None if decode else [1, 2, 1, 5, 1, 17, 1], heads=4, kv_heads=1, dim=16,
                     block_size=16, seed=31)
    assert_exact(run_triton(kernels, p, 2, decode=decode, **SPLITTY), p, 2, decode=decode)
    if decode:
        from ascend_compile.ops.cuda_launch import decode_schedule

        chunk, units = decode_schedule(lens, 2, key_tile=16, min_split_tiles=1)
        assert units[0] >= 6 and sum(units) <= 14  # 2 fixed splits would leave 350 keys to one program


@pytest.mark.parametrize("rows, group", [(64, 4), (128, 2)])
def test_triton_prefill_large_query_tiles(kernels, rows, group):
    """FIA with 64- and 128-row query tiles: long chunks span several tiles, short and decode
    tokens share a batch with them, causal within each chunk."""
    heads = 2 * group
    lens, qlens = [90, 40, 9, 0], [90, 20, 1, 1]  # 90 tokens: 6 tiles of 16 (64 rows, group 4) or 2 of 64
    p = make_problem(lens, qlens, heads=heads, kv_heads=1, dim=16, block_size=16, seed=rows + group)
    out = run_triton(kernels, p, 2, decode=False, key_tile=32, min_split_tiles=1, tile_rows=rows)
    assert_exact(out, p, 2, decode=False)


def test_triton_launch_config_picks_large_tiles_for_prefill(kernels):
    from ascend_compile.ops import cuda_launch as launch

    bf16 = launch.launch_config
    assert bf16(torch.bfloat16, 128, False, 512, 4) == (launch.PREFILL_TILE_ROWS, launch.NUM_STAGES)
    assert bf16(torch.bfloat16, 128, False, 8, 8) == (launch.TILE_ROWS, launch.NUM_STAGES)  # one token each
    assert bf16(torch.bfloat16, 128, True, 8, 8) == (launch.TILE_ROWS, launch.NUM_STAGES)
    assert bf16(torch.float32, 128, False, 512, 4) == (launch.TILE_ROWS, launch.NUM_STAGES)  # the fallback
    assert bf16(torch.bfloat16, 256, False, 512, 4) == (launch.TILE_ROWS, launch.NUM_STAGES)
    # bf16 on the default launch: a prefill chunk through 64-row tiles, against the reference op
    p = make_problem([80, 5], [70, 1], heads=4, kv_heads=2, dim=32, block_size=16, dtype=torch.bfloat16, seed=41)
    out = run_triton(kernels, p, 1, decode=False)
    torch.testing.assert_close(out.float(), reference_dev(p, 1, decode=False).float(), atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------- attention features (ops/features.py)

SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])  # one logit per query head (4 heads)
#: Windows below (5), equal to (17, the second sequence's length) and above (100) the contexts,
#: the soft-cap (small enough to flatten the logits), the sinks, and their combinations.
FEATURES = {
    "window5": dict(window=5), "window17": dict(window=17), "window100": dict(window=100),
    "soft_cap": dict(soft_cap=0.7), "sinks": dict(sinks=SINKS), "window_sinks": dict(window=9, sinks=SINKS),
    "window_soft_cap": dict(window=12, soft_cap=1.5), "all": dict(window=17, soft_cap=1.5, sinks=SINKS),
}
FEATURE_LENS = [1, 17, 40, 0, 70]
FEATURE_QUERY_LENS = [1, 5, 12, 1, 20]  # chunked prefill: several query tokens per sequence


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("name", list(FEATURES))
def test_triton_features_match_dense(kernels, name, decode):
    """Each feature and combination, GQA (2 query heads per KV head), split three ways (the reduce
    adds the sinks), against the dense oracle and the reference kernel."""
    features = FEATURES[name]
    p = make_problem(FEATURE_LENS, None if decode else FEATURE_QUERY_LENS, heads=4, kv_heads=2, seed=51)
    assert_exact(run_triton(kernels, p, 3, decode=decode, **features, **SPLITTY), p, 3, decode, **features)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_triton_features_with_one_split(kernels, decode):
    """One split per sequence: the split kernel writes the output itself, sink included."""
    features = FEATURES["all"]
    p = make_problem(FEATURE_LENS, None if decode else FEATURE_QUERY_LENS, heads=4, kv_heads=2, seed=52)
    assert_exact(run_triton(kernels, p, 1, decode=decode, **features, **SPLITTY), p, 1, decode, **features)


def test_triton_window_with_large_query_tiles(kernels):
    """64-row tiles of 16 query tokens (8 heads on 2 KV heads) and a window of 7 keys, shorter than
    a tile: each tile starts at its first token's window and masks every row's own."""
    sinks = torch.linspace(-1.0, 1.0, 8)
    features = dict(window=7, soft_cap=3.0, sinks=sinks)
    p = make_problem([90, 40, 9, 0], [90, 20, 1, 1], heads=8, kv_heads=2, dim=16, block_size=16, seed=53)
    out = run_triton(kernels, p, 2, decode=False, key_tile=32, min_split_tiles=1, tile_rows=64, **features)
    assert_exact(out, p, 2, False, **features)


def test_triton_bf16_features_match_reference_op(kernels):
    """bfloat16 on the default launch (a prefill chunk through 64-row tiles) with every feature and
    bfloat16 sinks, within today's bfloat16 tolerance of the reference op."""
    features = dict(window=24, soft_cap=2.0, sinks=SINKS.to(torch.bfloat16))
    p = make_problem([80, 5], [70, 1], heads=4, kv_heads=2, dim=32, block_size=16, dtype=torch.bfloat16, seed=54)
    out = run_triton(kernels, p, 1, decode=False, **features)
    expected = reference_dev(p, 1, False, **features)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def null_blocks_before_spans(p, window):
    """Point every block-table entry wholly before a sequence's span (`features.py`) at a new block
    full of NaN, as a runtime that freed those blocks may leave them; returns how many."""
    block_size = p.key_cache.shape[1]
    nan_block = torch.full((1, *p.key_cache.shape[1:]), float("nan"), dtype=p.key_cache.dtype)
    nulled = p.key_cache.shape[0]
    p.key_cache, p.value_cache = torch.cat([p.key_cache, nan_block]), torch.cat([p.value_cache, nan_block])
    count = 0
    for b, (n, q) in enumerate(zip(p.seq_lens, p.query_lens)):
        first = (n - AttentionFeatures(window=window).span(n, q)) // block_size
        p.block_table[b, :first] = nulled
        count += first
    return count


@pytest.mark.parametrize("block_size", [16, 12])  # one block-table entry per key tile, one per key
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_triton_window_never_reads_blocks_before_the_span(kernels, block_size, decode):
    """Blocks before a window's span may be freed: with their entries pointing at a block of NaN,
    the output is still the oracle's (a value read from it would make the row NaN). A window of 15
    starts spans mid-tile, so first tiles begin in a nulled block (block size 12)."""
    window = 15
    p = make_problem([100, 70, 33, 15], None if decode else [1, 11, 6, 15], heads=4, kv_heads=2,
                     block_size=block_size, seed=55 + block_size)
    expected = p.dense(window=window)
    assert null_blocks_before_spans(p, window) >= 7
    out = run_triton(kernels, p, 3, decode=decode, window=window, **SPLITTY)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32], rtol=1e-4)
    torch.testing.assert_close(reference_dev(p, 3, decode, window=window), expected,
                               atol=TOLERANCE[torch.float32], rtol=1e-4)


def test_triton_window_schedule_and_splits_follow_the_span(kernels):
    """With a window, the decode schedule and FIA's split counts are those of each span's key
    tiles: the workspace records written are the window-aware host mirror's, not those of the
    whole sequences (`test_triton_device_side_split_counts` without a window)."""
    from ascend_compile.ops.cuda_launch import decode_schedule, span_tiles

    heads, dim, splits, window = 4, 16, 3, 20
    p = make_problem([300, 5, 0, 90, 17], heads=heads, kv_heads=2, dim=dim, block_size=16, seed=56)
    assert [span_tiles(n, 1, window, 16) for n in p.seq_lens] == [2, 1, 0, 2, 2]
    chunk, units = decode_schedule(p.seq_lens, splits, key_tile=16, min_split_tiles=1, window=window)
    assert (chunk, units) == (1, [2, 1, 1, 2, 2])  # [7, 1, 1, 2, 1] without the window
    out, ws = run_triton(kernels, p, splits, decode=True, workspace=True, window=window, **SPLITTY)
    assert_exact(out, p, splits, True, window=window)
    records = 5 * splits
    lse = ws.view(torch.float32)[records * heads * dim:].view(records, heads)
    written = [bool(torch.isfinite(lse[u]).all()) for u in range(records)]
    assert written == [n > 1 for n in units for _ in range(n)] + [False] * (records - sum(units))

    # FIA, 4-token tiles: 40 keys, 1 token: 2 span tiles, 2 splits (3 without the window); the rest 1
    m = make_problem([40, 33, 3, 0], [1, 9, 2, 1], heads=8, kv_heads=2, dim=dim, block_size=16, seed=57)
    out, ws = run_triton(kernels, m, splits, decode=False, workspace=True, window=10, **SPLITTY)
    assert_exact(out, m, splits, False, window=10)
    tokens = m.query.shape[0]
    lse = ws.view(torch.float32)[tokens * splits * 8 * dim:].view(tokens, splits, 8)
    token_splits = [n for n, q in zip([2, 1, 1, 1], m.query_lens) for _ in range(q)]
    for token, n in enumerate(token_splits):
        used = torch.isfinite(lse[token]).all(dim=1) | (lse[token] == float("-inf")).all(dim=1)
        assert used.tolist() == [n > 1 and s < n for s in range(splits)], token


#: Compiles the kernels for sm_90 (`tests/sm90.py`) with the options `attention_dev` launches them
#: with; prints, per variant, the registers and spilled bytes, the shared memory and how many K/V
#: tiles the key loop keeps in flight (0 for kernels without a key loop). The featured variants
#: (window, soft-cap, sinks: `ops/features.py`) are compiled beside the plain ones.
COMPILE_SCRIPT = r"""
from ascend_compile.ops import cuda_triton as ct

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
for dt in ("bf16", "fp32"):
    types = {"query": "*" + dt, "key_cache": "*" + dt, "value_cache": "*" + dt, "block_table": "*i32",
             "seq_lens": "*i32", "query_start_loc": "*i32", "workspace": "*fp32", "out": "*" + dt,
             "sinks": "*fp32", "scale_log2": "fp32", "cap_log2": "fp32"}
    plain = dict(WINDOW=False, SOFT_CAP=False, HAS_SINKS=False)
    featured = dict(WINDOW=True, SOFT_CAP=True, HAS_SINKS=True)
    base = dict(NUM_HEADS=16, GROUP=2, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=ct.KEY_TILE, BLOCK_B=256,
                MIN_TILES=ct.MIN_SPLIT_TILES, DIRECT=False, PRECISION="ieee" if dt == "fp32" else "tf32",
                DOT_FP32=False, **plain)
    # decode: the schedule with one block-table entry per tile (block 128) and per key (block 16)
    rows, stages = ct.launch_config(DTYPES[dt], 128, True, 256, 256)
    for block in (128, 16):
        consts = dict(base, BLOCK_Q=1, BLOCK_M=rows, BLOCK_SIZE=block, DECODE=True, NUM_STAGES=stages)
        report("split", dt, "decode", block, result=build(ct._split_kernel, types, consts, stages))
    # the JIT turns int arguments equal to 1 into constants (but not those in `_VARYING`): one split,
    # block table stride 1
    ones = dict(base, BLOCK_Q=1, BLOCK_M=rows, BLOCK_SIZE=128, DECODE=True, NUM_STAGES=stages, DIRECT=True,
                num_splits=1, stride_bt=1)
    report("split-ones", dt, "decode", 128, result=build(ct._split_kernel, types, ones, stages))
    # FIA: prefill chunks (64-row tiles in bf16) and one token per sequence (16 rows)
    for name, tokens, block in (("fia-prefill", 4096, 128), ("fia-prefill", 4096, 16), ("fia-tokens", 256, 128)):
        rows, stages = ct.launch_config(DTYPES[dt], 128, False, tokens, 256)
        if name == "fia-tokens" and ct.launch_config(DTYPES[dt], 128, False, 4096, 256)[0] == rows:
            continue  # the fallback's (fp32) prefill tiles are these: the same kernel again
        consts = dict(base, BLOCK_Q=ct.tile_tokens(2, rows), BLOCK_M=rows, BLOCK_SIZE=block, DECODE=False,
                      NUM_STAGES=stages)
        report("split", dt, name, block, result=build(ct._split_kernel, types, consts, stages))
    # every feature: decode with per-key block lookups (block 16), FIA prefill chunks with both kinds
    for name, decode, tokens, block in (("decode", True, 256, 16), ("fia-prefill", False, 4096, 128),
                                        ("fia-prefill", False, 4096, 16)):
        rows, stages = ct.launch_config(DTYPES[dt], 128, decode, tokens, 256)
        consts = dict(base, **featured, BLOCK_Q=1 if decode else ct.tile_tokens(2, rows), BLOCK_M=rows,
                      BLOCK_SIZE=block, DECODE=decode, NUM_STAGES=stages)
        report("split-features", dt, name, block, result=build(ct._split_kernel, types, consts, stages))
    for decode, switches in ((True, plain), (False, plain), (True, featured), (False, featured)):
        consts = dict(NUM_HEADS=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=ct.REDUCE_SPLITS, BLOCK_N=ct.KEY_TILE,
                      BLOCK_Q=8, BLOCK_B=256, MIN_TILES=ct.MIN_SPLIT_TILES, DECODE=decode, WINDOW=switches["WINDOW"],
                      HAS_SINKS=switches["HAS_SINKS"])
        report("reduce" if switches is plain else "reduce-features", dt, "decode" if decode else "fia", 0,
               result=build(ct._reduce_kernel, {"seq_lens": "*i32", "query_start_loc": "*i32", "workspace": "*fp32",
                                           "out": "*" + dt, "sinks": "*fp32"}, consts, 1))
    report("cache", dt, "-", 0, result=build(ct._cache_write_kernel,
           {"key": "*" + dt, "value": "*" + dt, "key_cache": "*" + dt, "value_cache": "*" + dt,
            "slot_mapping": "*i64"}, dict(HEAD_DIM=128, BLOCK=1024, NUM_ELEMENTS=1024), 1))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels are compiled and run for real")
@pytest.mark.skipif(torch_release() == (2, 10), reason="the sm_90 budgets are read with triton 3.8 and 3.9 (torch 2.13 "
                    "to 2.15); torch 2.10's triton 3.6 compiles to other figures, not yet checked (open)")
def test_triton_kernels_compile_for_hopper_without_spills():
    """Every kernel variant compiles for sm_90 without spilling, fits Hopper's shared memory, and
    the key loops keep K/V two tiles in flight (one with the fp32 fallback's 16-row tiles)."""
    pytest.importorskip("triton", reason="needs triton")
    pytest.importorskip("triton.compiler", reason="needs triton's compiler API")
    rows, stdout = compile_rows(COMPILE_SCRIPT)
    assert len(rows) == 27, stdout
    for kernel, dt, variant, block, regs, stack, shared, depth in rows:
        assert int(stack) <= 0, stdout  # no stack: nothing spilled
        assert int(shared) <= HOPPER_SHARED, stdout
        if kernel.startswith("split"):
            assert int(depth) >= 2, stdout


# ---------------------------------------------------------------- device-length ops (reference kernels)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_dev_ops_reference_path_matches_dense(splits):
    p = make_problem([0, 1, 16, 17, 40], heads=4, kv_heads=2, dim=16, block_size=16, seed=splits)
    seq_lens, loc = p.tensors()
    shape = tiling.AttentionShape.of(p.query, p.key_cache)
    ws = torch.empty(cuda.dev_workspace_nbytes(5, shape, splits), dtype=torch.uint8)
    out = torch.empty_like(p.query)
    ops.paged_attention_dev(p.query, p.key_cache, p.value_cache, p.block_table, seq_lens, p.scale, ws, out, splits)
    torch.testing.assert_close(out, p.dense(), atol=TOLERANCE[torch.float32], rtol=1e-4)

    m = make_problem([5, 16, 0, 33], [3, 1, 1, 4], heads=4, kv_heads=2, dim=16, block_size=16, seed=splits)
    seq_lens, loc = m.tensors()
    ws = torch.empty(cuda.dev_workspace_nbytes(9, shape, splits), dtype=torch.uint8)
    out = torch.empty_like(m.query)
    ops.fused_infer_attention_dev(m.query, m.key_cache, m.value_cache, m.block_table, loc, seq_lens, m.scale, ws, out,
                                  splits)
    torch.testing.assert_close(out, m.dense(), atol=TOLERANCE[torch.float32], rtol=1e-4)


def test_dev_ops_check_workspace_and_arguments():
    p = make_problem([20, 3], heads=4, kv_heads=2, dim=16, block_size=16)
    seq_lens, loc = p.tensors()
    shape = tiling.AttentionShape.of(p.query, p.key_cache)
    need = cuda.dev_workspace_nbytes(2, shape, 4)
    assert need == 2 * 4 * 4 * 17 * 4
    out = torch.empty_like(p.query)
    args = (p.query, p.key_cache, p.value_cache, p.block_table)
    with pytest.raises(WorkspaceTooSmall, match=f"needs {need} bytes"):
        ops.paged_attention_dev(*args, seq_lens, p.scale, torch.empty(need - 1, dtype=torch.uint8), out, 4)
    ws = torch.empty(need, dtype=torch.uint8)
    with pytest.raises(ValueError, match="seq_lens: expected dtype torch.int32"):
        ops.paged_attention_dev(*args, seq_lens.long(), p.scale, ws, out, 4)
    with pytest.raises(ValueError, match="query_start_loc: expected a 1-D tensor of length 3"):
        ops.fused_infer_attention_dev(*args, loc[:2], seq_lens, p.scale, ws, out, 4)
    with pytest.raises(ValueError, match="num_splits: expected a positive int"):
        ops.paged_attention_dev(*args, seq_lens, p.scale, ws, out, 0)
    with pytest.raises(ValueError, match="context_lens: expected lengths of at most 32"):
        ops.paged_attention_dev(*args, torch.tensor([33, 3], dtype=torch.int32), p.scale, ws, out, 4)


def test_dev_ops_opcheck():
    p = make_problem([40, 7], heads=4, kv_heads=2, dim=16)
    seq_lens, loc = p.tensors()
    ws = torch.empty(1 << 12, dtype=torch.uint8)
    args = (p.query, p.key_cache, p.value_cache, p.block_table)
    torch.library.opcheck(ops.paged_attention_dev.default, (*args, seq_lens, p.scale, ws, torch.empty_like(p.query), 3))
    torch.library.opcheck(ops.fused_infer_attention_dev.default,
                          (*args, loc, seq_lens, p.scale, ws, torch.empty_like(p.query), 3))
    torch.library.opcheck(ops.fused_infer_attention_dev.default,
                          (*args, loc, seq_lens, p.scale, ws, torch.empty_like(p.query), 3, 9, 1.5, SINKS))


def test_split_choice_fills_the_sms_within_bounds():
    assert cuda.choose_num_splits(8, 4096, 128, 132) == 16  # 8 programs: 2*132/8 = 33, capped at 4096/256
    assert cuda.choose_num_splits(16, 100_000, 128, 132) == 17
    assert cuda.choose_num_splits(2, 1 << 20, 16, 132) == cuda.MAX_SPLITS
    assert cuda.choose_num_splits(2048, 4096, 128, 132) == 1  # the batch alone fills the GPU
    assert cuda.choose_num_splits(8, 100, 16, 132) == 1  # shorter than one split's minimum
    rule = cuda.gpu_splits(num_sms=132, max_model_len=1024)
    shape = tiling.AttentionShape(num_heads=16, num_kv_heads=8, head_dim=128, block_size=128)
    assert [rule(tiling.PA, shape, b) for b in (1, 8, 32)] == [4, 4, 2]
    # a batch that fills the GPU alone: PA keeps spare capacity to rebalance uneven lengths, FIA none
    assert [rule(k, shape, 256) for k in (tiling.PA, tiling.FIA)] == [cuda.PA_MIN_SPLITS, 1]
    assert cuda.gpu_splits(num_sms=132, max_model_len=256)(tiling.PA, shape, 256) == 1  # too short to split
    with pytest.raises(ValueError, match="num_sms: expected a positive int"):
        cuda.choose_num_splits(8, 4096, 128, 0)


# ---------------------------------------------------------------- use_device_lengths on the model's graphs

MAX_LEN = 96


def splits_rule(kernel, shape, bucket):
    """A split rule that differs per kernel and bucket, so each rewritten node shows its own."""
    return {tiling.PA: 3, tiling.FIA: 2}[kernel] + (bucket >= 8)


@dataclasses.dataclass
class SplitsRuleTarget(CudaTarget):
    """CUDA's target (device-length kernels, fixed splits per bucket) with `splits_rule`, on any runtime."""

    def splits(self, config):
        return splits_rule


def device_length_model(model, capture_sizes, runtime):
    """`torch.compile` through the backend on CUDA's target, with `runtime` (a CPU one) and `splits_rule`."""
    config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=capture_sizes, pa_max_batch=4)
    artifacts = []
    torch._dynamo.reset()
    compile_fn = backend(config, on_compiled=artifacts.append, target=lambda device, c: SplitsRuleTarget(runtime))
    return torch.compile(model, backend=compile_fn), artifacts


def test_device_length_graphs_match_the_model_over_changing_steps():
    cfg = LlamaConfig(num_layers=2, num_blocks=256)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = device_length_model(model, (2, 4, 8), EagerRuntime(torch.device("cpu")))
    batch = PagedBatch(cfg, seed=4)
    rng = random.Random(0)
    with torch.no_grad():
        # (sequences, query tokens per sequence): decode steps, and mixed ones for b4.mixed and b8.decode (FIA)
        for size, qlens in [(3, None), (4, None), (2, [1, 3]), (6, None), (8, None), (3, [2, 2, 3]), (7, None), (1, None)]:
            lens = [rng.randint(3, MAX_LEN) for _ in range(size)]
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    stats = sum((a.stats for a in artifacts), start=collections.Counter())
    assert stats["eager_fallbacks"] == 0 and stats["steps"] == 8
    art = next(a for a in artifacts if a.rewritten.buckets == (2, 4, 8))  # the dynamic-shape graph
    assert {g.name for g in art.graphs.values()} == {"b4.decode", "b4.mixed", "b8.decode"}
    plan = art.describe()
    specialized = {str(k) for k in art.specialized}  # the graph keys the steps used, specialised from their variants
    assert specialized == {"b4.decode", "b4.mixed", "b8.decode"}
    kernels = {(g, k["kernel"], k["num_splits"], k["lengths"])
               for g, d in plan["graphs"].items() if g in specialized for k in d["kernels"]}
    assert ("b4.decode", tiling.PA, 3, "device") in kernels and ("b8.decode", tiling.FIA, 3, "device") in kernels
    assert ("b4.mixed", tiling.FIA, 2, "device") in kernels
    for gm in art.specialized.values():
        assert not any(is_op(n, op) for n in gm.graph.nodes for op in HOST_LENGTH_OPS.values())
        assert host_sources(gm) == []  # no host lists left for the runner to pass
    model_shape = tiling.AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size)
    expected = max(cuda.dev_workspace_nbytes(b, model_shape, splits_rule(k, model_shape, b))
                   for b, k in ((2, tiling.PA), (4, tiling.PA), (2, tiling.FIA), (4, tiling.FIA), (8, tiling.FIA)))
    assert art.rewritten.plan.slots["attn_workspace"].nbytes == expected


def test_device_length_graphs_carry_the_layer_features():
    """A sliding layer beside a full one, both soft-capped and with sinks: every device-length
    FIA node takes its host node's window, soft-cap and sinks (and its `KernelMeta` the features),
    and the graphs equal the model over decode and mixed steps whose contexts pass the window."""
    cfg = LlamaConfig(num_layers=2, num_blocks=256, layer_types=("sliding", "full"), sliding_window=10,
                      soft_cap=2.0, sinks=True)
    model, reference = build(cfg), build(cfg)
    for m in (model, reference):
        for layer in m.layers:
            layer.attn.sinks.data.copy_(torch.tensor([0.3, -0.7, 1.1, 0.0]))
    fn, artifacts = device_length_model(model, (2, 4), EagerRuntime(torch.device("cpu")))
    batch = PagedBatch(cfg, seed=7)
    with torch.no_grad():
        for lens, qlens in (([60, 7, 33], None), ([90, 12], [4, 3]), ([41, 80, 5, 96], None)):
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    calls = [call for a in artifacts for gm in a.specialized.values() for call in kernel_calls(gm)]
    assert calls and all(call.op is ops.fused_infer_attention_dev.default for call in calls)
    windows = sorted({(call.arg("window"), call.meta.features.window) for call in calls}, key=str)
    assert windows == [(10, 10), (None, None)]
    for call in calls:
        assert call.arg("soft_cap") == 2.0 and call.meta.features.sinks
        assert isinstance(call.arg("sinks"), fx.Node)


def test_use_device_lengths_wires_the_graph_inputs():
    cfg = LlamaConfig(num_layers=1)
    graphs = []

    def backend_fn(gm, example_inputs):
        config = CompileConfig(max_model_len=64, capture_sizes=(4,), pa_max_batch=4)
        graphs.append(rewrite_buckets(gm, config, SplitsRuleTarget(EagerRuntime(torch.device("cpu")))))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(build(cfg), backend=backend_fn)(**PagedBatch(cfg).step([3, 9]))
    gm = clone_graph_module(graphs[-1].variants["pa"].gm)
    host = [n.name for n in gm.graph.find_nodes(op="placeholder") if HOST_META_KEY in n.meta]
    assert host  # select_kernels added host lists
    (call,) = use_device_lengths(gm, 4, splits_rule)
    assert call.node.target is ops.paged_attention_dev.default
    seq_lens = call.arg("seq_lens")
    assert isinstance(seq_lens, fx.Node) and seq_lens.meta["ascend_role"] == "seq_lens"
    assert call.arg("num_splits") == 3 and KernelCall.of(call.node).meta.num_splits == 3
    left = {n.name for n in gm.graph.find_nodes(op="placeholder")}
    assert not left & set(host)


def test_host_length_kernels_are_refused_by_a_runtime_without_task_updates():
    class GraphsOnly(GraphRuntime):
        """The simulator's graphs without its task updates."""

        name = "graphs_only"

        def __init__(self):
            self.sim = SimRuntime()

        @property
        def device(self):
            return self.sim.device

        def empty(self, shape, dtype):
            return self.sim.empty(shape, dtype)

        def synchronize(self):
            self.sim.synchronize()

        def graph(self, label=""):
            return self.sim.graph(label)

    cfg = LlamaConfig(num_layers=1, num_blocks=256)
    config = CompileConfig(max_model_len=MAX_LEN, capture_sizes=(4,))
    torch._dynamo.reset()
    fn = torch.compile(build(cfg), backend=backend(config, target=lambda device, c: Target(GraphsOnly())))
    with torch.no_grad(), pytest.raises(CaptureError, match="takes host-side lengths"):
        fn(**PagedBatch(cfg).step([3, 9]))


def test_cuda_runtime_needs_cuda_tensors():
    with pytest.raises(ValueError, match="runtime: the cuda runtime needs the graph's tensors on a CUDA device"):
        create_runtime("cuda", torch.device("cpu"))
    assert CompileConfig(runtime="cuda").runtime == "cuda"


# ---------------------------------------------------------------- inner compiler


def test_inductor_inner_graph_matches_the_model_from_inside_a_compiled_frame():
    """The runner calls the inner graph from the model's compiled frame, where dynamo compiles nothing."""
    cfg = LlamaConfig(num_layers=2, num_blocks=64)
    model, reference = build(cfg), build(cfg)
    graphs = []

    def backend_fn(gm, example_inputs):
        config = CompileConfig(max_model_len=64, capture_sizes=(4,), pa_max_batch=4)
        target = SplitsRuleTarget(EagerRuntime(torch.device("cpu")))
        rewritten = rewrite_buckets(gm, config, target)
        key = next(iter(rewritten.choices))
        gm4 = target.specialize(rewritten.variant_for(key).gm, key, config)
        graphs.append(gm4)
        inner = compile_inner(gm4, "inductor")
        (ws_node,) = inner.workspaces
        workspace = torch.zeros(ws_node.args[0], dtype=torch.uint8)
        return lambda *args: inner(args, lambda node: workspace)

    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend_fn)
    batch = PagedBatch(cfg, seed=2)
    with torch.no_grad():
        # 3 sequences: a static graph (its bucket is 3); then 4: a dynamic one, bucket 4 (no padding either
        # way), replayed with other lengths (block tables 3 wide throughout)
        for lens in ([3, 9, 40], [3, 9, 40, 17], [33, 1, 2, 47]):
            inputs = batch.step(lens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    assert len(graphs) == 2 and all(g.meta["ascend_inner"].compiled is not None for g in graphs)
    gm = graphs[-1]
    assert any(is_op(n, ops.paged_attention_dev) for n in gm.graph.nodes)  # the bucket graph keeps its nodes


def test_inner_compiler_needs_a_runtime_without_task_updates():
    cfg = LlamaConfig(num_layers=1)
    torch._dynamo.reset()
    fn = torch.compile(build(cfg), backend="ascend_graph",
                       options={"max_model_len": 64, "inner_compiler": "inductor", "runtime": "sim"})
    with torch.no_grad(), pytest.raises(Exception, match="inner_compiler: 'inductor' compiles the graphs that runtime 'cuda'"):
        fn(**PagedBatch(cfg).step([3, 4]))


def test_backend_rewrites_to_device_lengths_for_the_cuda_runtime():
    """compile_graph's CUDA path, on the CPU: a stand-in runtime named "cuda" (no graphs)."""

    class CpuStandIn(EagerRuntime):
        name = "cuda"
        num_sms = 64

    cfg = LlamaConfig(num_layers=2, num_blocks=600)
    model, reference = build(cfg), build(cfg)
    config = CompileConfig(max_model_len=1024, capture_sizes=(4, 8), pa_max_batch=4)
    artifacts = []

    def backend_fn(gm, example_inputs):
        artifacts.append(backend_mod.compile_graph(gm, example_inputs, config,
                                                   target=lambda device, c: CudaTarget(CpuStandIn(device))))
        return artifacts[-1]

    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend_fn)
    batch = PagedBatch(cfg, seed=5)
    with torch.no_grad():
        for size in (3, 6, 2, 8):
            inputs = batch.step([1000 - 90 * i for i in range(size)])
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    art = artifacts[-1]
    assert {str(k) for k in art.specialized} == {"b4.decode", "b8.decode"}  # those the steps used
    kernels = {k: g["kernels"][0] for k, g in art.describe()["graphs"].items() if k in {"b4.decode", "b8.decode"}}
    # 4 sequences x 2 KV heads = 8 programs want 16 splits for 64 SMs; 1024 / 256 tokens allow 4
    assert kernels["b4.decode"]["num_splits"] == 4 and kernels["b8.decode"]["num_splits"] == 4
    assert all(k["lengths"] == "device" for k in kernels.values())
    shape = tiling.AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size)
    assert art.rewritten.plan.slots["attn_workspace"].nbytes == cuda.dev_workspace_nbytes(8, shape, 4)


# ---------------------------------------------------------------- no host-device syncs per step on CUDA


class StubGraph:
    """A device graph whose capture runs the work once and whose replays do nothing (device calls stubbed)."""

    warms_up = False  # its warm-up runs nothing (`DeviceGraph.warms_up`)

    def warmup(self, run):
        pass

    def capture(self):
        return contextlib.nullcontext()

    def replay(self):
        pass


class StubGraphRuntime(GraphRuntime):
    """CUDA's runtime with its device calls stubbed: CPU memory, graphs that replay nothing."""

    name = "cuda_stub"
    num_sms = 64
    after_replay = CudaRuntime.after_replay

    def __init__(self):
        self.synchronized = 0

    @property
    def device(self):
        return torch.device("cpu")

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def synchronize(self):
        self.synchronized += 1

    def graph(self, label=""):
        return StubGraph()


@contextlib.contextmanager
def counted_host_reads(monkeypatch):
    """Counts, by name, the calls of the tensor methods that read device data on the host
    (`tolist`, `item`, `cpu`) within the block."""
    calls = collections.Counter()
    with monkeypatch.context() as patch:
        for name in ("tolist", "item", "cpu"):
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _name=name, _original=original, **kwargs):
                calls[_name] += 1
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)
        yield calls


def test_cuda_steps_make_no_device_to_host_syncs(monkeypatch):
    cfg = LlamaConfig(num_layers=2, num_blocks=600)
    runtime = StubGraphRuntime()
    config = CompileConfig(max_model_len=1024, capture_sizes=(4, 8), pa_max_batch=4)
    artifacts = []
    torch._dynamo.reset()
    fn = torch.compile(build(cfg), backend=backend(config, on_compiled=artifacts.append,
                                                   target=lambda device, c: CudaTarget(runtime)))
    batch = PagedBatch(cfg, seed=5)
    steps = [batch.step([900 - 90 * i for i in range(size)]) for size in (3, 6, 2, 8, 3)]
    mixed = batch.step([40, 50], [2, 3])
    with torch.no_grad():
        for inputs in (steps + [mixed]) * 2:  # the compiles and captures (dynamo compiles more than one graph)
            fn(**inputs)
        before = runtime.synchronized
        with counted_host_reads(monkeypatch) as calls:
            for inputs in steps + [mixed]:
                fn(**inputs)
    art = artifacts[-1]
    assert art.stats["replays"] >= 6 and art.stats["eager_fallbacks"] == 0 and art.stats["host_conversions"] == 0
    assert calls == {} and runtime.synchronized == before


def test_cuda_device_checks_refuse_a_too_long_sequence():
    cfg = LlamaConfig(num_layers=1, num_blocks=600)
    config = CompileConfig(max_model_len=512, capture_sizes=(4,), pa_max_batch=4)
    torch._dynamo.reset()
    fn = torch.compile(build(cfg), backend=backend(config, target=lambda device, c: CudaTarget(StubGraphRuntime())))
    batch = PagedBatch(cfg, seed=5)
    with torch.no_grad():
        fn(**batch.step([100, 200, 300]))
        with pytest.raises(RuntimeError, match="seq_lens: a sequence exceeds max_model_len=512"):
            fn(**batch.step([100, 600, 300]))


def test_cuda_device_checks_refuse_a_sequence_with_no_query_tokens():
    """The device path keys decode by equal token and sequence counts (no host copy of the offsets),
    so a sequence of no query tokens beside one of two (3 tokens, 3 sequences) must be refused, not
    served by the decode graph."""
    cfg = LlamaConfig(num_layers=1, num_blocks=600)
    config = CompileConfig(max_model_len=512, capture_sizes=(4,), pa_max_batch=4)
    torch._dynamo.reset()
    fn = torch.compile(build(cfg), backend=backend(config, target=lambda device, c: CudaTarget(StubGraphRuntime())))
    batch = PagedBatch(cfg, seed=5)
    with torch.no_grad():
        fn(**batch.step([100, 200, 300]))
        with pytest.raises(RuntimeError, match="query_start_loc: every sequence needs at least one query token"):
            fn(**batch.step([100, 200, 300], [1, 0, 2]))


# ---------------------------------------------------------------- the GPU check script, on the CPU


def test_run_gpu_dry_run_lists_the_phases_within_budget():
    """`run_gpu.sh --dry-run` needs no CUDA (nor python): it lists the phases, their commands and
    budgets, whose sum fits one 10-minute call with room to spare."""
    result = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "run_gpu.sh"), "--dry-run"],
                            capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHON="false"))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for phase, command in (("phase 1: GPU tests", "tests/test_cuda_gpu.py"),
                           ("phase 1: GPU tests", "tests/test_triton_kernels.py"),
                           ("phase 2: kernel bandwidth", "benchmarks/gpu_kernels.py"),
                           ("phase 3: decode table", "benchmarks/decode.py --preset h200"),
                           ("phase 4: piecewise prefill", "benchmarks/piecewise.py --device cuda"),
                           ("summary", "benchmarks/verdicts.py")):
        assert phase in text and command in text, text
    budgets = [int(b) for b in __import__("re").findall(r"budget (\d+)s", text)]
    assert len(budgets) == 5 and all(b <= 240 for b in budgets[1:]), text  # each phase under 4 minutes
    assert sum(budgets) + 5 <= 9 * 60, text


def test_verdicts_from_partial_results(tmp_path):
    """The summary reads whatever the phases left: verdicts where their rows exist, NOT MEASURED elsewhere."""
    import json

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import verdicts
    finally:
        sys.path.pop(0)
    decode = {"info": {"preset": "h200"}, "rows": [
        {"variant": v, "mode": m, "batch": b, "median_ms": ms, "x_roofline": xr, "max_abs_diff": 0.0,
         "first_call_s": 1.0}
        for v, m, b, ms, xr in (("op", "ascend_graph+inductor", 32, 1.0, 1.2), ("plain", "reduce-overhead", 32, 2.5, 3),
                                ("op", "reduce-overhead", 32, 0.9, 1.1), ("op", "ascend_graph+inductor", 1, 0.5, 2.0))
    ] + [{"variant": "plain", "mode": "compile", "skipped": "time budget of 130 s spent"}]}
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    text = verdicts.summary(str(tmp_path))
    assert "batch 32: 2.50x faster than plain/reduce-overhead (of reduce-overhead), 1.20x roofline: PASS" in text
    assert "batch 32: 1.11x the time of op/reduce-overhead: FAIL" in text
    assert "NOT MEASURED (no kernel table)" in text and "GPU tests: no results" in text
    kernels = {"info": {}, "rows": [{"case": "copy", "gbps": 4300.0},
                                    {"case": "pa", "batch": 64, "context": 4096, "splits": 2, "ms": 0.2,
                                     "gbps": 3100.0, "of_copy": 0.72}]}
    (tmp_path / "kernels.json").write_text(json.dumps(kernels))
    assert "3100 GB/s, 72% of the copy: PASS" in verdicts.summary(str(tmp_path))


def test_cuda_serves_every_decode_bucket_with_the_decode_kernel_by_default():
    config = CompileConfig(max_model_len=256, capture_sizes=(4, 32))
    graphs = []

    def backend_fn(gm, example_inputs):
        graphs.append(rewrite_buckets(gm, config, CudaTarget(StubGraphRuntime())))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(build(LlamaConfig(num_layers=1)), backend=backend_fn, dynamic=True)(**PagedBatch(
            LlamaConfig(num_layers=1)).step([3, 9]))
    choices = graphs[-1].choices
    decode = choices[GraphKey(32, True)][0]
    assert decode.kernel == tiling.PA and "decode-only bucket on CUDA" in decode.reason
    assert choices[GraphKey(32, False)][0].kernel == tiling.FIA  # mixed steps
    explicit = CompileConfig(max_model_len=256, capture_sizes=(4, 32), pa_max_batch=4)
    assert CudaTarget(StubGraphRuntime()).kernel_policy(explicit, torch.float32).kind == "pa_max_batch"
