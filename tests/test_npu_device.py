"""What an Ascend device requires of the NPU path (issue 22), against the fake torch_npu: every op of a
captured graph a device kernel (the KV-cache write through `npu_scatter_pa_kv_cache`, no host reads),
the kernels' documented constraints refused at compile time, workspaces asked the way the device
answers them, and capture costs as vLLM-Ascend and npugraph_ex handle them."""
from __future__ import annotations

import random

import pytest
import torch

from ascend_compile.ops import npu as npu_ops
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu
from tests.test_backend import compiled_model
from tests.test_npu import MAX_LEN, NPU_BLOCK, TOL, lengths

CPU = torch.device("cpu")


@pytest.fixture
def fake_npu(monkeypatch):
    return fake_torch_npu.install(monkeypatch)


def caches(model):
    return [t for layer in model.layers for t in (layer.attn.key_cache, layer.attn.value_cache)]


# ----------------------------------------------------------------------------- the KV-cache write


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_the_kv_cache_is_written_by_the_device_kernel_at_every_replay(fake_npu, slot_dtype):
    # Batch sizes change from step to step (buckets 4 and 8, and a mixed step); after every step both
    # caches equal eager's, and each replay ran npu_scatter_pa_kv_cache once per layer.
    cfg = LlamaConfig(num_layers=2, num_blocks=128, block_size=NPU_BLOCK)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4, 8), pa_max_batch=4)
    batch, rng = PagedBatch(cfg, seed=5), random.Random(5)
    steps = [lengths(rng, n) for n in (3, 4, 7, 2, 8, 3)] + [([40, 300, 17], [3, 1, 2])]
    writes = []
    with torch.no_grad():
        for lens, qlens in ((s, None) if isinstance(s, list) else s for s in steps):
            inputs = batch.step(lens, qlens)
            inputs["slot_mapping"] = inputs["slot_mapping"].to(slot_dtype)
            before = len(fake_npu.writes)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
            writes.append(fake_npu.writes[before:])
            for got, want in zip(caches(model), caches(reference)):
                torch.testing.assert_close(got, want, **TOL)
    layers = cfg.num_layers
    for step, w in zip(steps, writes):
        real = len(step) if isinstance(step, list) else sum(step[1])
        assert w[-layers:] == [real] * layers, step  # the replay: each layer's kernel wrote the step's tokens
        assert not any(w[:-layers]), step  # warm-up and capture (all padding, slot -1) wrote nothing
    assert sum(a.stats["replays"] for a in artifacts) == len(steps) and fake_npu.count("npu_scatter_pa_kv_cache") > 0


def _cache_write_args(slots, dtype=torch.int64):
    key = torch.randn(len(slots), 2, 16)
    cache = torch.zeros(4, NPU_BLOCK, 2, 16)
    return key, -key, cache, cache.clone(), torch.tensor(slots, dtype=dtype)


def test_the_cache_write_binding_reads_no_device_data_on_the_host(fake_npu):
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    for slots in ([-1, -1, -1], [5, -1, 130]):  # all padding (as captured), and a step
        key, value, key_cache, value_cache, slot_mapping = _cache_write_args(slots)
        with fake_torch_npu.HostReads() as host:
            kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        assert host.reads == []
    assert fake_npu.count("npu_scatter_pa_kv_cache") == 2 and fake_npu.writes == [0, 2]
    assert torch.equal(key_cache.view(-1, 2, 16)[130], key[2]) and torch.equal(value_cache.view(-1, 2, 16)[5], -key[0])
    (call,) = [c for c in fake_npu.calls if c.name == "npu_scatter_pa_kv_cache"][-1:]
    assert call.kwargs == {"cache_mode": "Norm"}


def test_the_fake_cache_write_refuses_what_its_documentation_forbids(fake_npu):
    scatter = npu_ops.load_torch_npu().npu_scatter_pa_kv_cache
    key, value, key_cache, value_cache, slots = _cache_write_args([1, 2])
    with pytest.raises(ValueError, match="cache_mode: expected None or 'Norm'"):
        scatter(key, value, key_cache, value_cache, slots)  # the default, PA_NZ, takes NZ caches
    with pytest.raises(ValueError, match="key: expected a contiguous tensor"):
        scatter(key.transpose(0, 1).contiguous().transpose(0, 1), value, key_cache, value_cache, slots,
                cache_mode="Norm")
    with pytest.raises(ValueError, match="key_cache: expected a contiguous tensor"):
        kv = torch.zeros(4, 2, NPU_BLOCK, 2, 16)  # vLLM's [num_blocks, 2, ...] cache, unbound
        scatter(key, value, kv[:, 0], kv[:, 1], slots, cache_mode="Norm")
    with pytest.raises(ValueError, match="slot_mapping: expected a \\[2\\] int32 or int64 tensor"):
        scatter(key, value, key_cache, value_cache, slots.short(), cache_mode="Norm")
    with pytest.raises(ValueError, match="slot_mapping: expected distinct slots"):
        scatter(key, value, key_cache, value_cache, torch.tensor([3, 3]), cache_mode="Norm")
    with pytest.raises(ValueError, match="slot_mapping: expected slots in \\[0, 511\\]"):
        scatter(key, value, key_cache, value_cache, torch.tensor([3, 512]), cache_mode="Norm")
    scatter(key, value, key_cache, value_cache, torch.tensor([-1, 511], dtype=torch.int32), cache_mode="Norm")
    assert torch.equal(key_cache.view(-1, 2, 16)[511], key[1]) and key_cache.count_nonzero() == key[1].numel()


def test_eager_cache_write_takes_int32_and_int64_slots():
    for dtype in (torch.int32, torch.int64):
        key, value, key_cache, value_cache, slots = _cache_write_args([5, -1, 0], dtype)
        torch.ops.ascend.reshape_and_cache(key, value, key_cache, value_cache, slots)
        assert torch.equal(key_cache.view(-1, 2, 16)[5], key[0]) and torch.equal(value_cache.view(-1, 2, 16)[0], -key[2])
    with pytest.raises(ValueError, match="slot_mapping: expected a \\[3\\] torch.int32 or torch.int64 tensor"):
        torch.ops.ascend.reshape_and_cache(key, value, key_cache, value_cache, slots.short())


# ----------------------------------------------------------------------------- capture costs


def _steps_on_two_buckets(cfg, **options):
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4, 8),
                                   kernel_policy="pa", **options)
    batch, rng = PagedBatch(cfg, seed=6), random.Random(6)
    with torch.no_grad():
        for n in (3, 4, 7, 2, 8):
            inputs = batch.step(lengths(rng, n))
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
    return artifacts


def test_only_a_runtimes_first_capture_releases_the_allocators_caches(fake_npu):
    # torch.npu.graph empties both caching allocators on every entry (torch_npu/npu/graphs.py); a lazy
    # capture while serving would pay it each time. vLLM-Ascend skips it after the first capture.
    artifacts = _steps_on_two_buckets(LlamaConfig(num_layers=1, num_blocks=128, block_size=NPU_BLOCK))
    runtimes = {id(a.runtime) for a in artifacts if a.stats["captures"]}
    trace = [what for what, _ in fake_npu.trace]
    assert sum(a.stats["captures"] for a in artifacts) > len(runtimes)
    assert trace.count("empty_cache") == trace.count("host_empty_cache") == len(runtimes)


def test_updates_are_tiled_for_the_cores_the_graph_was_captured_for(fake_npu):
    # A step running on a stream limited to 8 cube / 16 vector cores: the graphs are captured for those
    # cores and every task update is issued on an update stream limited alike (the fake refuses an update
    # tiled for other cores), as npugraph_ex sets the update stream's limit before each update.
    torch.npu.set_stream_limit(torch.npu.current_stream(), 8, 16)
    artifacts = _steps_on_two_buckets(LlamaConfig(num_layers=2, num_blocks=128, block_size=NPU_BLOCK))
    limited = {"cube_core_num": 8, "vector_core_num": 16}
    handles = [e.handle.native for a in artifacts for g in a.graphs.values() for e in g.table.entries.values()]
    assert handles and all(h.core_limit == limited for h in handles)
    assert all(torch.npu.get_stream_limit(a.runtime.update_stream) == limited for a in artifacts)
    sets = [stream for what, stream in fake_npu.trace if what == "set_stream_limit"]
    assert len(sets) <= 3 * len(artifacts)  # set when it differs, not before every update
