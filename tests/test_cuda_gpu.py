"""The CUDA runtime on a GPU: Triton kernels against the reference kernels, CUDA graphs replayed
with changing lengths, and the compiled model (runtime "cuda", eager and inductor inner) against
eager. Skipped without CUDA or triton; `benchmarks/run_gpu.sh` runs them with the benchmark.
"""
from __future__ import annotations

import collections
import random

import pytest
import torch

from ascend_compile.backend import compile_graph
from ascend_compile.config import CompileConfig
from ascend_compile.ops import cuda, tiling
from examples.llama import LlamaConfig, PagedBatch, build
from tests.helpers import make_problem

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
triton = pytest.importorskip("triton", reason="the CUDA kernels need triton")

ops = torch.ops.ascend
GPU = torch.device("cuda")
MAX_LEN = 1024
#: The Triton kernels multiply probabilities by values in the cache's dtype (as flash attention does).
KERNEL_TOLERANCE = {torch.float32: 5e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def cuda_copy(*tensors):
    return [t.to(GPU) for t in tensors]


def dev_call(p, splits, decode, device):
    """The device-length op for problem `p` on `device` (CPU: reference kernel; CUDA: Triton)."""
    seq_lens, loc = p.tensors()
    shape = tiling.AttentionShape.of(p.query, p.key_cache)
    ws = torch.full((cuda.dev_workspace_nbytes(p.query.shape[0], shape, splits),), 0xFF, dtype=torch.uint8)
    out = torch.full_like(p.query, float("nan"))
    q, kc, vc, bt, seq_lens, loc, ws, out = [t.to(device) for t in (p.query, p.key_cache, p.value_cache,
                                                                     p.block_table, seq_lens, loc, ws, out)]
    if decode:
        ops.paged_attention_dev(q, kc, vc, bt, seq_lens, p.scale, ws, out, splits)
    else:
        ops.fused_infer_attention_dev(q, kc, vc, bt, loc, seq_lens, p.scale, ws, out, splits)
    return out.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, dim, block", [(16, 8, 128, 128), (32, 4, 128, 16), (8, 8, 64, 32)])
def test_triton_kernels_match_the_reference_kernels(dtype, heads, kv_heads, dim, block):
    lens = [0, 1, block - 1, block, block + 1, 700, MAX_LEN]
    p = make_problem(lens, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block, dtype=dtype,
                     max_blocks=MAX_LEN // block)
    tol = dict(atol=KERNEL_TOLERANCE[dtype], rtol=KERNEL_TOLERANCE[dtype])
    for splits in (1, 4, 9):
        torch.testing.assert_close(dev_call(p, splits, True, GPU).float(), dev_call(p, splits, True, "cpu").float(), **tol)
    m = make_problem([5, 300, 0, 64, 1000], [3, 17, 1, 64, 1], heads=heads, kv_heads=kv_heads, dim=dim,
                     block_size=block, dtype=dtype, max_blocks=MAX_LEN // block)
    for splits in (1, 5):
        torch.testing.assert_close(dev_call(m, splits, False, GPU).float(), m.dense(), **tol)


def test_unified_attention_and_cache_write_on_cuda_match_the_cpu():
    p = make_problem([3, 200, 0, 90], [2, 5, 1, 1], heads=8, kv_heads=2, dim=64, block_size=16, max_blocks=16)
    seq_lens, loc = p.tensors()
    args = (p.query, p.key_cache, p.value_cache, p.block_table, seq_lens, loc)
    got = ops.attention(*cuda_copy(*args), p.scale).cpu()
    torch.testing.assert_close(got, ops.attention(*args, p.scale), atol=2e-5, rtol=1e-4)

    key, value = torch.randn(6, 2, 64), torch.randn(6, 2, 64)
    slots = torch.tensor([5, -1, 17, 255, -1, 0])
    kc, vc = torch.randn(16, 16, 2, 64), torch.randn(16, 16, 2, 64)
    kc_gpu, vc_gpu = cuda_copy(kc, vc)
    ops.reshape_and_cache(*cuda_copy(key, value), kc_gpu, vc_gpu, slots.to(GPU))
    ops.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc_gpu.cpu(), kc) and torch.equal(vc_gpu.cpu(), vc)


def test_a_captured_kernel_reads_lengths_on_every_replay():
    p = make_problem([MAX_LEN] * 4, heads=16, kv_heads=8, dim=128, block_size=128, dtype=torch.bfloat16)
    shape = tiling.AttentionShape.of(p.query, p.key_cache)
    q, kc, vc, bt = cuda_copy(p.query, p.key_cache, p.value_cache, p.block_table)
    seq_lens = torch.zeros(4, dtype=torch.int32, device=GPU)
    ws = torch.empty(cuda.dev_workspace_nbytes(4, shape, 6), dtype=torch.uint8, device=GPU)
    out = torch.empty_like(q)
    call = lambda: ops.paged_attention_dev(q, kc, vc, bt, seq_lens, p.scale, ws, out, 6)  # noqa: E731
    call()  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    rng = random.Random(0)
    for _ in range(5):
        lens = [rng.randint(0, MAX_LEN) for _ in range(4)]
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        p.seq_lens = lens
        torch.testing.assert_close(out.cpu().float(), p.dense(), atol=2e-2, rtol=2e-2)


def compiled_model(model, **options):
    config = CompileConfig(runtime="cuda", **options)
    artifacts = []

    def backend_fn(gm, example_inputs):
        artifacts.append(compile_graph(gm, example_inputs, config))
        return artifacts[-1]

    torch._dynamo.reset()
    return torch.compile(model, backend=backend_fn), artifacts


def to_gpu(inputs):
    return {k: v.to(GPU) for k, v in inputs.items()}


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_compiled_on_cuda_matches_eager_over_changing_steps(inner):
    cfg = LlamaConfig(num_layers=2, num_blocks=1024, head_dim=64, num_heads=8, num_kv_heads=2, hidden_size=256)
    model, reference, cpu_reference = build(cfg).to(GPU), build(cfg).to(GPU), build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN // 2, capture_sizes=(1, 2, 4, 8, 16),
                                   pa_max_batch=4, inner_compiler=inner)
    batch = PagedBatch(cfg, seed=1)
    rng = random.Random(inner)
    tol = dict(atol=1e-4, rtol=1e-3) if inner == "inductor" else dict(atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        for i, size in enumerate([3, 4, 5, 7, 8, 9, 16, 2, 13, 21, 6, 1, 12, 16, 3, 30]):
            lens = [rng.randint(4, MAX_LEN // 2) for _ in range(size)]
            qlens = [rng.randint(1, 3) for _ in lens] if i % 4 == 3 else None
            inputs = batch.step(lens, qlens)
            got = fn(**to_gpu(inputs))
            torch.testing.assert_close(got, reference(**to_gpu(inputs)), **tol)
            torch.testing.assert_close(got.cpu(), cpu_reference(**inputs), atol=1e-4, rtol=1e-3)
    stats = sum((a.stats for a in artifacts), start=collections.Counter())
    # 21 and 30 tokens: above the largest bucket, served piecewise
    assert stats["piecewise_steps"] >= 1 and stats["eager_fallbacks"] == 0 and stats["replays"] >= 10
    captured = sum(1 for a in artifacts for g in a.graphs.values() if g.graph is not None)
    assert stats["captures"] == captured  # one capture per graph used, whatever the lengths
    art = max(artifacts, key=lambda a: len(a.rewritten.buckets))
    assert art.runtime.name == "cuda"
    plan = art.describe()
    for graph in plan["graphs"].values():
        assert graph.get("update_table", []) == []
        assert all(k["lengths"] == "device" and k["num_splits"] >= 1 for k in graph["kernels"])


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_prefill_steps_above_the_buckets_run_on_cuda_graph_pieces_and_equal_eager(inner):
    """A 512-token prefill, a chunked-prefill mix and a prefill of four sequences above the largest
    bucket: CUDA-graph pieces (op by op, whatever the inner compiler of the full graphs), the
    device-length kernels run between them on the step's own tensors, equal to eager."""
    cfg = LlamaConfig(num_layers=2, num_blocks=1024, head_dim=64, num_heads=8, num_kv_heads=2, hidden_size=256)
    model, reference = build(cfg).to(GPU), build(cfg).to(GPU)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(4, 8), inner_compiler=inner)
    batch = PagedBatch(cfg, seed=2)
    with torch.no_grad():
        for lens, qlens in [([5, 9], None), ([512], [512]), ([700, 30, 45], [300, 1, 1]), ([90] * 4, [80] * 4)]:
            inputs = to_gpu(batch.step(lens, qlens))
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=1e-4, rtol=1e-3)
    art = max(artifacts, key=lambda a: a.stats["steps"])
    assert art.stats["piecewise_steps"] == 3 and art.stats["eager_fallbacks"] == 0
    assert {str(k) for k, _ in art.piecewise} == {"p512"}  # 512, 302 and 320 tokens
    (graph,) = art.piecewise.values()
    assert len(graph.pieces) == cfg.num_layers + 1 and all(p.graph is not None for p in graph.pieces)


def test_cuda_runtime_is_the_auto_choice():
    cfg = LlamaConfig(num_layers=1, num_blocks=256)
    model, reference = build(cfg).to(GPU), build(cfg).to(GPU)
    config = CompileConfig(max_model_len=256, capture_sizes=(4, 8))
    artifacts = []

    def backend_fn(gm, example_inputs):
        artifacts.append(compile_graph(gm, example_inputs, config))
        return artifacts[-1]

    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend_fn)
    batch = PagedBatch(cfg)
    with torch.no_grad():
        for size in (3, 6, 2, 7, 8):
            inputs = to_gpu(batch.step([50 + size] * size))
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    art = artifacts[-1]
    assert art.runtime.name == "cuda" and art.runtime.describe()["sms"] > 0
    assert art.stats["replays"] >= 3


def test_auto_policy_times_the_cuda_kernels():
    cfg = LlamaConfig(num_layers=1, num_blocks=256)
    model, reference = build(cfg).to(GPU), build(cfg).to(GPU)
    fn, artifacts = compiled_model(model, max_model_len=256, capture_sizes=(4, 32), kernel_policy="auto")
    batch = PagedBatch(cfg)
    with torch.no_grad():
        for size in (3, 6, 20):
            inputs = to_gpu(batch.step([40 + size] * size))
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=2e-5, rtol=1e-4)
    reasons = [k["reason"] for a in artifacts for g in a.describe()["graphs"].values() for k in g["kernels"]]
    assert reasons and all("measured" in r for r in reasons if "decode-only" not in r)


@pytest.mark.parametrize("block", [128, 16])
def test_captured_decode_rebalances_uneven_lengths_on_every_replay(block):
    """One captured PA call (2 splits of capacity, the real key tiles and slots) replayed with
    uniform, uneven and padded lengths: the device schedule follows each replay's lengths."""
    batch, max_len = 16, 4096
    p = make_problem([max_len] * batch, heads=16, kv_heads=8, dim=128, block_size=block, dtype=torch.bfloat16,
                     max_blocks=max_len // block)
    shape = tiling.AttentionShape.of(p.query, p.key_cache)
    q, kc, vc, bt = cuda_copy(p.query, p.key_cache, p.value_cache, p.block_table)
    seq_lens = torch.full((batch,), max_len, dtype=torch.int32, device=GPU)
    ws = torch.empty(cuda.dev_workspace_nbytes(batch, shape, 2), dtype=torch.uint8, device=GPU)
    out = torch.empty_like(q)
    call = lambda: ops.paged_attention_dev(q, kc, vc, bt, seq_lens, p.scale, ws, out, 2)  # noqa: E731
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lens in ([max_len] * batch, [max_len] + [7] * (batch - 1), [0, 1, 4000, 65, 0, 3000] + [129] * (batch - 6)):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        p.seq_lens = lens
        torch.testing.assert_close(out.cpu().float(), p.dense(), atol=2e-2, rtol=2e-2)


def test_fia_prefill_chunks_with_large_query_tiles_on_cuda():
    """A 1000-token chunk over a 3000-token prefix next to decode tokens: 64-row tiles (bf16)."""
    p = make_problem([4000, 300, 1, 77], [1000, 1, 1, 77], heads=16, kv_heads=8, dim=128, block_size=128,
                     dtype=torch.bfloat16)
    for splits in (1, 2):
        torch.testing.assert_close(dev_call(p, splits, False, GPU).float(), p.dense(), atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------- MLA (ops/cuda_triton_mla.py)


def mla_dev_call(p, splits, device):
    """The device-length MLA op for problem `p` on `device` (CPU: reference kernel; CUDA: Triton)."""
    seq_lens, loc = p.tensors()
    shape = tiling.AttentionShape.of_mla(p.q_nope, p.q_pe, p.kv_c_cache)
    ws = torch.full((cuda.dev_workspace_nbytes(p.q_nope.shape[0], shape, splits),), 0xFF, dtype=torch.uint8)
    out = torch.full_like(p.q_nope, float("nan"))
    args = [t.to(device) for t in (p.q_nope, p.q_pe, p.kv_c_cache, p.k_pe_cache, p.block_table, loc, seq_lens)]
    ws, out = ws.to(device), out.to(device)
    ops.mla_fused_infer_attention_dev(*args, p.scale, ws, out, splits)
    return out.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, block", [(16, 64), (128, 16)])
def test_triton_mla_matches_the_reference_kernel_at_deepseek_dims(dtype, heads, block):
    """kv_lora_rank 512 + rope 64, 16 heads (one head group) and 128 (eight), decode and mixed."""
    from tests.mla_helpers import make_mla_problem

    lens = [0, 1, block - 1, block, block + 1, 700, MAX_LEN]
    tol = dict(atol=KERNEL_TOLERANCE[dtype], rtol=KERNEL_TOLERANCE[dtype])
    for qlens in ([1] * len(lens), [1, 1, 3, 16, 2, 100, 37]):
        p = make_mla_problem(lens, qlens, heads=heads, kv_lora_rank=512, rope_dim=64, qk_nope_dim=128, v_dim=128,
                             block_size=block, dtype=dtype)
        for splits in (1, 4):
            torch.testing.assert_close(mla_dev_call(p, splits, GPU).float(), mla_dev_call(p, splits, "cpu").float(),
                                       **tol)


def test_a_captured_mla_kernel_reads_lengths_on_every_replay():
    from tests.mla_helpers import make_mla_problem

    p = make_mla_problem([MAX_LEN] * 4, [2] * 4, heads=16, kv_lora_rank=512, rope_dim=64, block_size=64,
                         dtype=torch.bfloat16)
    shape = tiling.AttentionShape.of_mla(p.q_nope, p.q_pe, p.kv_c_cache)
    args = cuda_copy(p.q_nope, p.q_pe, p.kv_c_cache, p.k_pe_cache, p.block_table)
    seq_lens = torch.full((4,), 2, dtype=torch.int32, device=GPU)
    loc = torch.tensor(p.query_start_loc, dtype=torch.int32, device=GPU)
    ws = torch.empty(cuda.dev_workspace_nbytes(8, shape, 6), dtype=torch.uint8, device=GPU)
    out = torch.empty_like(args[0])
    call = lambda: ops.mla_fused_infer_attention_dev(*args, loc, seq_lens, p.scale, ws, out, 6)  # noqa: E731
    call()  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    rng = random.Random(0)
    for _ in range(4):
        lens = [rng.randint(2, MAX_LEN) for _ in range(4)]
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        p.seq_lens = lens
        torch.testing.assert_close(p.up_project(out.cpu()), p.dense(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_mla_cache_write_on_cuda_matches_the_cpu(slot_dtype):
    kv_c, k_pe = torch.randn(6, 512), torch.randn(6, 64)
    slots = torch.tensor([5, -1, 17, 255, -1, 0], dtype=slot_dtype)
    kv_c_cache, k_pe_cache = torch.randn(16, 16, 512), torch.randn(16, 16, 64)
    on_gpu = cuda_copy(kv_c_cache, k_pe_cache)
    ops.mla_cache_write(*cuda_copy(kv_c, k_pe), *on_gpu, slots.to(GPU))
    ops.mla_cache_write(kv_c, k_pe, kv_c_cache, k_pe_cache, slots)
    assert torch.equal(on_gpu[0].cpu(), kv_c_cache) and torch.equal(on_gpu[1].cpu(), k_pe_cache)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_the_deepseek_example_compiled_on_cuda_equals_eager(inner):
    """DeepSeek's latent dims (512 + 64, 16 heads) over decode and mixed steps across buckets, every
    step replayed from a captured graph, against eager on the GPU and the reference kernels on the CPU."""
    from examples.deepseek import DeepSeekConfig
    from examples.deepseek import build as build_deepseek

    cfg = DeepSeekConfig(num_layers=2, num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
                         v_head_dim=64, hidden_size=256, num_blocks=512, block_size=64)
    model, reference, cpu_reference = build_deepseek(cfg).to(GPU), build_deepseek(cfg).to(GPU), build_deepseek(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(2, 4, 8), inner_compiler=inner)
    batch = PagedBatch(cfg, seed=26)
    rng = random.Random(26)
    tol = dict(atol=1e-4, rtol=1e-3)
    with torch.no_grad():
        for size, qlens in ((3, None), (2, [3, 1]), (7, None), (8, None), (4, [1, 2, 1, 4]), (1, None)):
            lens = [rng.randint(8, MAX_LEN) for _ in range(size)]
            inputs = batch.step(lens, qlens)
            got = fn(**to_gpu(inputs))
            torch.testing.assert_close(got, reference(**to_gpu(inputs)), **tol)
            torch.testing.assert_close(got.cpu(), cpu_reference(**inputs), **tol)
    stats = sum((a.stats for a in artifacts), start=collections.Counter())
    assert stats["replays"] >= 4 and stats["eager_fallbacks"] == 0
    plan = max(artifacts, key=lambda a: len(a.rewritten.buckets)).describe()
    kernels = [k for g in plan["graphs"].values() for k in g["kernels"]]
    assert kernels and all(k["kernel"] == tiling.MLA and k["lengths"] == "device" for k in kernels)


@pytest.mark.parametrize("kv_lora_rank, rope_dim", [(512, 64), (1024, 64)])
def test_mla_attention_on_cuda_matches_the_cpu(kv_lora_rank, rope_dim):
    """The model-facing op on CUDA: the Triton kernel, or past the tiles checked for sm_90 (1024)
    the reference kernel, equal to the CPU's either way."""
    from tests.mla_helpers import make_mla_problem

    p = make_mla_problem([3, 200, 0, 90], [2, 5, 1, 1], heads=16, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
    seq_lens, loc = p.tensors()
    args = (p.q_nope, p.q_pe, p.kv_c_cache, p.k_pe_cache, p.block_table, seq_lens, loc)
    got = ops.mla_attention(*cuda_copy(*args), p.scale).cpu()
    torch.testing.assert_close(got, ops.mla_attention(*args, p.scale), atol=5e-5, rtol=5e-5)
