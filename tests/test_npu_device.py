"""What an Ascend device requires of the NPU path (issue 22), against the fake torch_npu: every op of a
captured graph a device kernel (the KV-cache write through `npu_scatter_pa_kv_cache`, no host reads),
the kernels' documented constraints refused at compile time, workspaces asked the way the device
answers them, and capture costs as vLLM-Ascend and npugraph_ex handle them."""
from __future__ import annotations

import random

import pytest
import torch

from ascend_compile.ops.npu import kernels as npu_ops
from ascend_compile.ops import tiling
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu
from tests.helpers import make_problem
from tests.test_backend import compiled_model
from tests.test_npu import DTYPE, MAX_LEN, NPU_BLOCK, TOL, lengths

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
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK)
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
    artifacts = _steps_on_two_buckets(LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=128, block_size=NPU_BLOCK))
    runtimes = {id(a.runtime) for a in artifacts if a.stats["captures"]}
    trace = [what for what, _ in fake_npu.trace]
    assert sum(a.stats["captures"] for a in artifacts) > len(runtimes)
    assert trace.count("empty_cache") == trace.count("host_empty_cache") == len(runtimes)


def test_updates_are_tiled_for_the_cores_the_graph_was_captured_for(fake_npu):
    # A step running on a stream limited to 8 cube / 16 vector cores: the graphs are captured for those
    # cores and every task update is issued on an update stream limited alike (the fake refuses an update
    # tiled for other cores), as npugraph_ex sets the update stream's limit before each update.
    torch.npu.set_stream_limit(torch.npu.current_stream(), 8, 16)
    artifacts = _steps_on_two_buckets(LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK))
    limited = {"cube_core_num": 8, "vector_core_num": 16}
    handles = [e.handle.native for a in artifacts for g in a.graphs.values() for e in g.table.entries.values()]
    assert handles and all(h.core_limit == limited for h in handles)
    assert all(torch.npu.get_stream_limit(a.runtime.update_stream) == limited for a in artifacts)
    sets = [stream for what, stream in fake_npu.trace if what == "set_stream_limit"]
    assert len(sets) <= 3 * len(artifacts)  # set when it differs, not before every update


def test_a_torch_npu_without_core_limits_still_starts_and_serves(fake_npu, monkeypatch, caplog):
    # Issue 33, item 6: get_stream_limit reads `_npu_get_stream_res_limit`, which an older CANN lacks; the
    # runtime called it unguarded at start-up and could not start. npugraph_ex catches it and sets no
    # limit (`_save_stream_core_limits`); so does the runtime now, with one warning.
    def missing(stream):
        raise AttributeError("module 'torch_npu._C' has no attribute '_npu_get_stream_res_limit'")

    monkeypatch.setattr(torch.npu, "get_stream_limit", missing)
    with caplog.at_level("WARNING", logger="ascend_compile"):
        artifacts = _steps_on_two_buckets(LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=128,
                                                      block_size=NPU_BLOCK))
    assert sum(a.stats["replays"] for a in artifacts) >= 3
    assert not [what for what, _ in fake_npu.trace if what == "set_stream_limit"]
    warnings = [r.getMessage() for r in caplog.records if "get_stream_limit failed" in r.getMessage()]
    assert len(warnings) == len({id(a.runtime) for a in artifacts})  # once per runtime


# ----------------------------------------------------------------------------- kernel constraints at compile time

DEVICE_CALLS = ("_npu_paged_attention", "npu_fused_infer_attention_score.out", "_npu_paged_attention_get_workspace",
                "_npu_fused_infer_attention_score_get_max_workspace", "npu_scatter_pa_kv_cache")


def _first_step(cfg, model=None, steps=([10, 20, 30],), **options):
    """Compile on the fake NPU and run `steps`; the first exception, or None."""
    model, reference = model or build(cfg), build(cfg)
    fn, _ = compiled_model(model, runtime="npu", max_model_len=MAX_LEN, capture_sizes=(4,), **options)
    batch = PagedBatch(cfg, seed=7)
    try:
        with torch.no_grad():
            for lens in steps:
                inputs = batch.step(lens)
                torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
    except Exception as err:  # noqa: BLE001 - the tests inspect it
        return err
    return None


def test_a_pa_block_size_of_256_is_refused_at_compile(fake_npu):
    # ATB's PA: "block_size %16 == 0 ... block_size <= 128"; 256 would fail on the device at the first
    # capture. Refused before torch_npu is called at all, naming the layer, the kernel and the rule.
    error = _first_step(LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=64, block_size=256), kernel_policy="pa")
    assert error is not None and fake_npu.count(*DEVICE_CALLS) == 0
    assert "paged_attention_default (layer L['self'].layers.0.attn): block_size: torch_npu._npu_paged_attention " \
           "(ATB PagedAttention) takes" in str(error)
    assert "block_size %16 == 0" in str(error) and "got 256" in str(error)


def test_the_fake_pa_refuses_block_sizes_atb_does_not_take(fake_npu):
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    query, cache = torch.randn(2, 4, 16, dtype=DTYPE), torch.zeros(4, 256, 2, 16, dtype=DTYPE)
    with pytest.raises(ValueError, match="block_size: expected a multiple of 16 of at most 128"):
        kernels.paged_attention(query, cache, cache, torch.zeros(2, 1, dtype=torch.int32), [3, 4], 0.25,
                                torch.empty(0, dtype=torch.uint8), torch.empty_like(query))


@pytest.mark.parametrize("policy, node, kernel", [
    ("pa", "paged_attention_default", "torch_npu._npu_paged_attention (ATB PagedAttention)"),
    ("fia", "fused_infer_attention_default", "torch_npu.npu_fused_infer_attention_score"),
])
def test_a_float32_model_is_refused_at_compile_naming_the_layer_and_the_dtype(fake_npu, policy, node, kernel):
    # PA and FIA take float16/bfloat16 queries and caches (FIA: L8065, L8224; PA: _atb_api_docs.py L254,
    # L272): a float32 model would pass every other check and fail at its first kernel on the device.
    cfg = LlamaConfig(dtype=torch.float32, num_layers=1, num_blocks=64, block_size=NPU_BLOCK)
    error = _first_step(cfg, kernel_policy=policy)
    assert error is not None and fake_npu.count(*DEVICE_CALLS) == 0
    assert f"{node} (layer L['self'].layers.0.attn): query: {kernel} takes float16 or bfloat16 queries" in str(error)
    assert "got a torch.float32 query and torch.float32 caches" in str(error)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_model_serves_from_replays(fake_npu, dtype):
    cfg = LlamaConfig(dtype=dtype, num_layers=1, num_blocks=64, block_size=NPU_BLOCK)
    assert _first_step(cfg, steps=([10, 20, 30], [40, 50, 60, 70])) is None


def test_the_fake_attention_kernels_refuse_float32_citing_their_docs(fake_npu):
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    table, workspace = torch.zeros(2, 1, dtype=torch.int32), torch.empty(1 << 20, dtype=torch.uint8)
    query, cache = torch.randn(2, 4, 16), torch.zeros(4, NPU_BLOCK, 2, 16)
    with pytest.raises(ValueError, match=r"query: expected a float16 or bfloat16 tensor \(ATB PagedAttention: "
                                         r"'支持float16/bf16/int8', _atb_api_docs.py L254\), got torch.float32"):
        kernels.paged_attention(query, cache, cache, table, [3, 4], 0.25, workspace, torch.empty_like(query))
    with pytest.raises(ValueError, match=r"query: expected a float16 or bfloat16 tensor "
                                         r"\(npu_fused_infer_attention_score: .*L8065\), got torch.float32"):
        kernels.fused_infer_attention(query, cache, cache, table, [1, 2], [3, 4], 0.25, workspace,
                                      torch.empty_like(query))
    # A half-precision query over float32 caches (the binding refuses the mix itself): the fake refuses the cache.
    half, torch_npu = query.to(DTYPE), kernels.torch_npu
    with pytest.raises(ValueError, match=r"key_cache: expected a float16 or bfloat16 tensor .*L255"):
        torch_npu._npu_paged_attention(*npu_ops.paged_attention_args(half, cache, cache, table, [3, 4], 0.25,
                                                                     torch.empty_like(half)), workspace=workspace)
    args, kwargs = npu_ops.fused_infer_attention_args(half, cache, cache, table, [1, 2], [3, 4], 0.25,
                                                      kernels.atten_mask)
    with pytest.raises(ValueError, match=r"key: expected a float16 or bfloat16 tensor .*L8067"):
        torch_npu.npu_fused_infer_attention_score.out(*args, **kwargs, workspace=workspace,
                                                      out=[torch.empty_like(half), kernels.softmax_lse])
    assert fake_npu.count("_npu_paged_attention", "npu_fused_infer_attention_score.out") == 4


@pytest.mark.parametrize("policy, sizes, message", [
    ("fia", dict(num_heads=132, num_kv_heads=2, hidden_size=64), r"num_key_value_heads: torch_npu\.npu_fused_infer_"
     r"attention_score takes at most 64 query heads per KV head \('比值不能大于64', L8116\), got 132 query heads over 2"),
    ("fia", dict(head_dim=24), r"query: torch_npu\.npu_fused_infer_attention_score takes a head dim that is a multiple "
     r"of 16 .*L8210.*got 24"),
    # issue 47: the kernel source's TND bound, on every version read (the docs' 512 is not TND's)
    ("fia", dict(head_dim=320), r"fused_infer_attention_default .*query: torch_npu\.npu_fused_infer_attention_score "
     r"takes a head dim .* at most 256 in TND \(kernel source: .*L3800-3803 .*L1035-1038\), got 320"),
    ("pa", dict(head_dim=272), r"paged_attention_default .*query: torch_npu\._npu_paged_attention \(ATB "
     r"PagedAttention\) takes head sizes in \(0, 256\] .*L278\), got 272"),
])
def test_head_limits_are_refused_at_compile_naming_the_layer(fake_npu, policy, sizes, message):
    # Issue 33, item 6: FIA's heads per KV head (L8116) and head dim (L8204, L8210, L8271), PA's head size
    # (_atb_api_docs.py L278); each would fail at the device's first kernel.
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=64, block_size=NPU_BLOCK, **sizes)
    error = _first_step(cfg, kernel_policy=policy)
    assert error is not None and fake_npu.count(*DEVICE_CALLS) == 0
    assert __import__("re").search(message, str(error)), str(error)


def test_the_fake_pa_copies_strided_inputs_and_refuses_a_strided_out(fake_npu):
    # torch_npu's ATB binding makes inputs contiguous (op-plugin AtbCommon.cpp, ParamSetter::Input) and
    # passes outputs as they are to AtTensor2AtbTensor, which refuses a strided one.
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    torch_npu = kernels.torch_npu
    prob = make_problem([40, 130], block_size=NPU_BLOCK, dtype=DTYPE)
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    kv = torch.stack([prob.key_cache, prob.value_cache], dim=1)  # vLLM's [num_blocks, 2, ...] layout
    key_cache, value_cache = kv[:, 0], kv[:, 1]
    assert not key_cache.is_contiguous()
    out = torch.empty_like(prob.query)
    torch_npu._npu_paged_attention(*npu_ops.paged_attention_args(prob.query, key_cache, value_cache, prob.block_table,
                                                                 prob.seq_lens, prob.scale, out), workspace=workspace)
    torch.testing.assert_close(out.float(), prob.dense(), **TOL)
    wide = torch.empty(prob.query.shape[0], prob.query.shape[1], 2 * prob.query.shape[2], dtype=DTYPE)[..., ::2]
    with pytest.raises(ValueError, match=r"out: expected a contiguous tensor \(ATB's AtTensor2AtbTensor"):
        torch_npu._npu_paged_attention(*npu_ops.paged_attention_args(prob.query, prob.key_cache, prob.value_cache,
                                                                     prob.block_table, prob.seq_lens, prob.scale, wide),
                                       workspace=workspace)


def test_the_fakes_take_softmax_lse_as_vllm_ascend_passes_it(fake_npu):
    # The .out overloads' softmax_lse is reserved ("当前预留，暂不支持", L8534, L9059): vLLM-Ascend passes a [1]
    # one to FIA (attention_v1.py) and a [num_tokens] one to FIA v2's MLA form (mla_v1.py); neither is written.
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    torch_npu = kernels.torch_npu
    prob = make_problem([40, 130], query_lens=[3, 2], block_size=NPU_BLOCK, dtype=DTYPE)
    ends = prob.query_start_loc[1:]
    args, kwargs = npu_ops.fused_infer_attention_args(prob.query, prob.key_cache, prob.value_cache, prob.block_table,
                                                      ends, prob.seq_lens, prob.scale, kernels.atten_mask)
    out, lse = torch.empty_like(prob.query), torch.full((prob.query.shape[0],), 7.0)
    torch_npu.npu_fused_infer_attention_score.out(*args, **kwargs, workspace=torch.empty(1 << 20, dtype=torch.uint8),
                                                  out=[out, lse])
    torch.testing.assert_close(out.float(), prob.dense(), **TOL)
    assert lse.eq(7.0).all()


def _unbound_cache_model(cfg):
    """The example model with vLLM's `[num_blocks, 2, block_size, KVH, D]` cache, each layer's key and
    value caches its two non-contiguous halves."""
    model = build(cfg)
    for layer in model.layers:
        kv = torch.zeros(cfg.num_blocks, 2, cfg.block_size, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype)
        layer.attn._buffers["key_cache"], layer.attn._buffers["value_cache"] = kv[:, 0], kv[:, 1]
    return model


@pytest.mark.parametrize("policy", ["pa", "fia"])
def test_a_non_contiguous_kv_cache_is_refused_at_compile(fake_npu, policy):
    # A contiguous copy of each half would copy the whole cache at every call inside the graph.
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=64, block_size=NPU_BLOCK)
    error = _first_step(cfg, _unbound_cache_model(cfg), kernel_policy=policy)
    assert error is not None and fake_npu.count(*DEVICE_CALLS) == 0
    assert "reshape_and_cache (layer L['self'].layers.0.attn): key_cache: torch_npu.npu_scatter_pa_kv_cache" \
           in str(error)
    assert "takes contiguous tensors" in str(error) and "输入参数不支持非连续" in str(error)


def test_the_fake_fia_refuses_non_contiguous_caches(fake_npu):
    # FIA: "不支持非连续的Tensor" (L8065-8069). PA's binding copies its inputs instead (the test above).
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    kv = torch.zeros(4, 2, NPU_BLOCK, 2, 16, dtype=DTYPE)
    query, table = torch.randn(2, 4, 16, dtype=DTYPE), torch.zeros(2, 1, dtype=torch.int32)
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="key: expected a contiguous tensor"):
        kernels.fused_infer_attention(query, kv[:, 0], kv[:, 1], table, [1, 2], [3, 4], 0.25, workspace,
                                      torch.empty_like(query))


def test_a_cache_smaller_than_a_bucket_of_padding_sequences_is_refused_at_compile(fake_npu):
    # FIA counts a block for each padding sequence against num_blocks ("blocknum不能小于..."): the
    # decode graph of bucket 512 is captured with 512 sequences of one token, one block each (its mixed
    # graph packs them into 4 dummies of 128), and the cache has 3.
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=3, block_size=NPU_BLOCK)
    model, reference = build(cfg), build(cfg)
    fn, _ = compiled_model(model, runtime="npu", max_model_len=MAX_LEN, capture_sizes=(512,), kernel_policy="fia")
    batch = PagedBatch(cfg)
    with torch.no_grad():
        fn(**batch.step([10, 20]))  # two tokens: dynamo traces them static, bucket 2 is captured
        calls = fake_npu.count(*DEVICE_CALLS)
        with pytest.raises(Exception, match="fused_infer_attention_default .*: key_cache: .* 512 blocks .* bucket 512 "
                                            "is captured with 512 padding sequences"):
            fn(**batch.step([10, 20, 30]))  # every size dynamic: bucket 512
    assert fake_npu.count(*DEVICE_CALLS) == calls


def test_a_step_whose_padding_would_overflow_fias_block_count_runs_eagerly(fake_npu):
    # Four sequences hold 15 of the cache's 16 blocks; padded to bucket 8, FIA would be sent 4 more
    # sequences of one block each: 19 > 16. The step runs eagerly (and right) instead.
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=16, block_size=NPU_BLOCK)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, runtime="npu", max_model_len=2048, capture_sizes=(8,), kernel_policy="fia")
    batch = PagedBatch(cfg, seed=8)
    with torch.no_grad():
        for lens in ([10, 20, 30], [10, 20, 30, 40], [600, 640, 500, 10], [5, 6, 7, 8, 9]):
            inputs = batch.step(lens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
    fallbacks, pieces, replays = (sum(a.stats[k] for a in artifacts) for k in ("eager_fallbacks", "piecewise_steps",
                                                                               "replays"))
    # the third step's 15 blocks of real sequences and 4 of padding: served piecewise, FIA taking its own 15
    assert (fallbacks, pieces, replays) == (0, 1, 3)


def test_a_mixed_step_sends_fia_its_sequences_and_a_dummy_per_128_padded_tokens(fake_npu):
    # vLLM-Ascend's full-graph path: FIA's batch is the step's requests plus one dummy holding the
    # padded tokens. Here: 3 sequences of 6 tokens in bucket 8 get one dummy of 2 tokens; 3 of 100 tokens
    # in bucket 256, two dummies of 78 (at most 128 each), each its query length as KV length; then empty
    # entries (0 query tokens, KV 0) up to the rows of the graph's block table, which torch_npu is given
    # whole at every call (a row per entry, L8223; the captured tensor kept: `npu_ops.table_batch`). The
    # cache holds a block for each of the 256 one-token sequences b256's decode graph is captured with.
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=300, block_size=NPU_BLOCK)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, runtime="npu", max_model_len=MAX_LEN, capture_sizes=(8, 256),
                                   kernel_policy="fia")
    batch = PagedBatch(cfg, seed=9)
    sent = {}
    with torch.no_grad():
        for lens, qlens in (([10, 20, 30], None), ([10, 20, 30, 40], None), ([40, 300, 17], [3, 1, 2]),
                            ([140, 300, 60], [40, 50, 10])):
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
            (call,) = [c for c in fake_npu.calls if c.name == "npu_fused_infer_attention_score.out"][-1:]
            sent[sum(qlens or [0])] = (call.kwargs["actual_seq_lengths"], call.kwargs["actual_seq_lengths_kv"],
                                       call.kwargs["block_table"].shape[0])
    assert sent[6] == ([3, 4, 6, 8] + [8] * 4, [40, 300, 17, 2] + [0] * 4, 8)
    assert sent[100] == ([40, 90, 100, 178] + [256] * 252, [140, 300, 60, 78, 78] + [0] * 251, 256)
    assert sum(a.stats["replays"] for a in artifacts) == 4


def test_the_fake_fia_takes_a_block_table_row_per_batch_entry(fake_npu):
    # "block_table必须为二维, 第一维长度需等于B" (L8223): the kernel refuses a table of more rows than entries,
    # so the binding pads a step's lists with empty entries to the rows of the table it is given.
    torch_npu = npu_ops.load_torch_npu()
    kernels = npu_ops.NpuKernels(torch_npu, CPU)
    query, cache = torch.randn(6, 4, 16, dtype=DTYPE), torch.zeros(8, NPU_BLOCK, 2, 16, dtype=DTYPE)
    table = torch.zeros(8, 2, dtype=torch.int32)
    lists = ([3, 4, 6], [10, 20, 3])
    workspace, out = torch.empty(1 << 16, dtype=torch.uint8), torch.empty_like(query)
    args, kwargs = npu_ops.fused_infer_attention_args(query, cache, cache, table, *lists, 0.25, kernels.atten_mask)
    with pytest.raises(ValueError, match=r"block_table: expected a row per batch entry, 3 .*L8223.*got \(8, 2\)"):
        torch_npu.npu_fused_infer_attention_score.out(*args, **kwargs, workspace=workspace,
                                                      out=[out, kernels.softmax_lse])
    kernels.fused_infer_attention(query, cache, cache, table, *lists, 0.25, workspace, out)  # padded to 8 entries
    assert fake_npu.calls[-1].kwargs["block_table"].shape[0] == 8
    assert fake_npu.calls[-1].kwargs["actual_seq_lengths"] == [3, 4, 6] + [6] * 5
    assert fake_npu.calls[-1].kwargs["actual_seq_lengths_kv"] == [10, 20, 3] + [0] * 5


def _strided_query(attend):
    """A layer's `attend` whose query reaches attention as a non-contiguous (dense) tensor, as vLLM's
    query, a view of the fused QKV projection, does."""
    return lambda q, *args: attend(q.transpose(0, 1).contiguous().transpose(0, 1), *args)


@pytest.mark.parametrize("policy", ["pa", "fia"])
def test_a_non_contiguous_query_is_staged_contiguous_before_the_kernel(fake_npu, policy):
    # The kernels take contiguous queries ('不支持非连续的Tensor'): a step's query, a few KB per layer, is
    # copied into a contiguous tensor by a node of the graph, outside the kernel's task group.
    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=64, block_size=NPU_BLOCK)
    model = build(cfg)
    for layer in model.layers:
        layer.attn.attend = _strided_query(layer.attn.attend)
    assert _first_step(cfg, model, steps=([10, 20, 30], [5, 6, 7, 8]), kernel_policy=policy) is None
    assert fake_npu.count("_npu_paged_attention" if policy == "pa" else "npu_fused_infer_attention_score.out") > 0


# ----------------------------------------------------------------------------- workspaces asked as the device answers


def test_workspaces_are_asked_once_per_graph_on_probe_tensors_that_do_not_grow_with_max_model_len(fake_npu):
    # The default buckets, KVH 8, D 128, bf16: the old probe kept a cache of bucket x max_model_len / 128
    # blocks (4 GiB at 8k) and asked PA and FIA at every probe length. FIA's max-workspace query answers
    # for any lengths up to the shapes it is given; PA is asked at its capture length, each step's own
    # lengths being asked before its replay (`npu_checks.pa_workspace_guard`): once per graph each.
    from tests.npu_probe_cost import SHAPE, probe_cost

    for max_model_len in (8192, 32768):
        cost = probe_cost(fake_npu, max_model_len)
        assert cost.peak_bytes <= 64 << 20, (max_model_len, cost)
        # one shape, all layers: one question per graph in each form (packed, one query token per sequence), one
        # for the graph of a single token (its packed form is that one)
        assert cost.fia_graphs == 35 and cost.fia_queries == 2 * cost.fia_graphs - 1
        assert cost.pa_queries == cost.pa_graphs == 5
        # The slot covers FIA's every length up to max_model_len for the largest bucket.
        assert cost.slot_bytes >= tiling.max_workspace(tiling.FIA, SHAPE, 256, max_model_len).nbytes


def test_each_steps_pa_query_is_asked_with_the_kernels_own_caches_and_block_table(fake_npu):
    # Issue 33, item 5: as vLLM-Ascend asks at every update (`update_paged_attention_graph_param`), the
    # per-step question is asked with the layer's KV caches and the graph's block table (their real
    # shapes), not a one-block stand-in cache and a table max_model_len wide.
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=64, block_size=NPU_BLOCK)
    model = build(cfg)
    assert _first_step(cfg, model, steps=([10, 20, 30], [40, 50, 60, 70], [5, 6, 7]), kernel_policy="pa") is None
    asked = [c for c in fake_npu.calls if c.name == "_npu_paged_attention_get_workspace"]
    run = [c for c in fake_npu.calls if c.name == "_npu_paged_attention"][-1]
    per_step = asked[-1]  # the last step's question, before its replay
    assert per_step.args[1].shape == model.layers[0].attn.key_cache.shape == run.args[1].shape
    assert per_step.args[6].shape == run.args[6].shape  # the graph's block table: its rows and width
    assert asked[0].args[1].shape[0] == 1  # the compile-time question keeps its probe cache
