"""MLA through CUDA's target on the CPU: the DeepSeek-style example's bucket graphs rewritten to the
device-length MLA op (`ops/cuda_mla.py`, its reference kernel on CPU tensors), split for each bucket,
equal to eager over decode and mixed steps, with the exact fixed workspace, and no host conversion
of lengths per step. The Triton kernels themselves: tests/test_triton_mla.py; on a GPU:
tests/test_cuda_gpu.py."""
from __future__ import annotations

import random

import torch

from ascend_compile.ops import cuda, tiling
from ascend_compile.passes.fx_utils import is_op
from ascend_compile.passes.kernel_call import host_sources, kernel_calls
from ascend_compile.runtime.eager import EagerRuntime
from ascend_compile.targets import CudaTarget
from examples.deepseek import DeepSeekConfig, build
from examples.llama import PagedBatch
from tests.test_backend import compiled_model
from tests.test_triton_kernels import StubGraphRuntime, counted_host_reads

CFG = DeepSeekConfig(num_layers=2, num_blocks=600)
MAX_LEN = 1200
BUCKETS = (2, 4, 8)
TOL = dict(atol=2e-5, rtol=1e-4)


class CpuStandIn(EagerRuntime):
    """CUDA's target on the CPU: runs graphs op by op, with a GPU's SM count for the split rule."""

    name = "cuda"
    num_sms = 64


def test_the_deepseek_example_on_cuda_reads_lengths_on_the_device_and_equals_eager():
    model, reference = build(CFG), build(CFG)
    fn, artifacts = compiled_model(model, target=lambda d, c: CudaTarget(CpuStandIn(d)), max_model_len=MAX_LEN,
                                   capture_sizes=BUCKETS)
    batch = PagedBatch(CFG, seed=26)
    rng = random.Random(26)
    steps = [([rng.randint(1, MAX_LEN) for _ in range(n)], None) for n in (3, 2, 7, 8)]
    steps += [([30, 900, 97], [3, 1, 2]), ([60, 1], [5, 1]), ([120, 16, 17, 1100], [1, 2, 1, 4])]
    with torch.no_grad():
        for lens, qlens in steps:
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
    assert sum(a.stats["eager_fallbacks"] for a in artifacts) == 0
    shape = tiling.AttentionShape(CFG.num_heads, 1, CFG.kv_lora_rank, CFG.block_size, CFG.qk_rope_head_dim)
    rule = cuda.gpu_splits(CpuStandIn.num_sms, MAX_LEN)
    specialized = [(key, gm) for a in artifacts for key, gm in a.specialized.items()]
    assert len({key.bucket for key, _ in specialized}) >= 3
    for key, gm in specialized:
        calls = kernel_calls(gm)
        assert [c.op for c in calls] == [torch.ops.ascend.mla_fused_infer_attention_dev.default] * CFG.num_layers
        assert all(c.meta.lengths == "device" and c.meta.num_splits == rule(tiling.MLA, shape, key.bucket) > 1
                   for c in calls), key
        assert host_sources(gm) == [] and not any(is_op(n, torch.ops.ascend.mla_fused_infer_attention)
                                                  for n in gm.graph.nodes)
    art = next(a for a in artifacts if a.rewritten.buckets == BUCKETS)  # the dynamic-shape graph
    expected = max(cuda.dev_workspace_nbytes(b, shape, rule(tiling.MLA, shape, b)) for b in BUCKETS)
    (slot,) = art.rewritten.plan.slots.values()
    assert slot.nbytes == expected


def test_mla_steps_on_cuda_make_no_device_to_host_syncs(monkeypatch):
    """After their captures, MLA steps read no length on the host: the graphs' kernels read them
    from the static buffers (a replay here runs nothing, so any host read would be the runner's)."""
    runtime = StubGraphRuntime()
    fn, artifacts = compiled_model(build(CFG), target=lambda d, c: CudaTarget(runtime), max_model_len=1024,
                                   capture_sizes=(4, 8))
    batch = PagedBatch(CFG, seed=5)
    steps = [batch.step([900 - 90 * i for i in range(size)]) for size in (3, 6, 2, 8)] + [batch.step([40, 50], [2, 3])]
    with torch.no_grad():
        for inputs in steps * 2:  # the compiles and captures
            fn(**inputs)
        before = runtime.synchronized
        with counted_host_reads(monkeypatch) as calls:
            for inputs in steps:
                fn(**inputs)
    art = artifacts[-1]
    assert art.stats["replays"] >= 5 and art.stats["eager_fallbacks"] == 0 and art.stats["host_conversions"] == 0
    assert calls == {} and runtime.synchronized == before
