"""The FIA kernel's own rules (issue 47), against the fake torch_npu: where the kernel source is narrower
than the docs, the rule is the source's, refused at compile time naming the layer; where the device
refuses a call itself (an `OP_CHECK_IF` of its tiling), it raises a RuntimeError, which the compile
reads as the device's answer."""
from __future__ import annotations

import pytest
import torch

import ascend_compile
from ascend_compile.backend import backend
from ascend_compile.config import CompileConfig
from ascend_compile.ops.npu import kernels as npu_ops
from ascend_compile.ops import tiling
from ascend_compile.ops.npu import rules as npu_rules
from ascend_compile.ops.npu.workspace_queries import NpuWorkspaceQuery
from examples.llama import LlamaConfig, PagedBatch, build
from tests import fake_torch_npu, fake_torch_npu_sources
from tests.test_npu import DTYPE, NPU_BLOCK, TOL, TOLERANCES

CPU = torch.device("cpu")
MAX_LEN = 1024
SHAPE = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=NPU_BLOCK)


@pytest.fixture
def fake_npu(monkeypatch):
    return fake_torch_npu.install(monkeypatch)


def _fia_call(entries: int):
    """FIA's arguments for `entries` one-token sequences of KV 1, each its own block."""
    query = torch.randn(entries, SHAPE.num_heads, SHAPE.head_dim, dtype=DTYPE)
    cache = torch.zeros(entries, NPU_BLOCK, SHAPE.num_kv_heads, SHAPE.head_dim, dtype=DTYPE)
    table = torch.arange(entries, dtype=torch.int32).view(entries, 1)
    return query, cache, table, list(range(1, entries + 1)), [1] * entries


# ----------------------------------------------------------------------------- 4096 entries a TND call


def test_a_tnd_call_of_more_than_4096_entries_is_the_devices_runtime_error(fake_npu):
    # The kernel's tiling refuses the lists' sizes (prompt_flash_attention_tiling.cpp L4275-4278): an aclnn
    # error, which torch_npu raises as a RuntimeError, for the kernel and its max-workspace query alike.
    kernels = npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU)
    query, cache, table, ends, kv_lens = _fia_call(4097)
    with pytest.raises(RuntimeError, match="at most 4096 entries"):
        kernels.band_workspace_nbytes(query, cache, cache, table, ends, kv_lens, 0.25, query, None, None)
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="at most 4096 entries"):
        kernels.launch_fia(query, cache, cache, table, ends, kv_lens, 0.25, workspace, torch.empty_like(query), None,
                           None)
    query, cache, table, ends, kv_lens = _fia_call(4096)
    assert kernels.band_workspace_nbytes(query, cache, cache, table, ends, kv_lens, 0.25, query, None, None) >= 0


def test_the_fia_probe_sends_only_non_empty_sequences_and_refuses_a_graph_above_4096(fake_npu):
    # The probe packs a graph's tokens into as few sequences as a block-table row holds, none empty: at 4096
    # tokens and rows of 1024 that is 4 entries, not 4096. A graph of 4097 tokens may be called with 4097
    # sequences: refused by the rule before any question.
    queries = NpuWorkspaceQuery(npu_ops.NpuKernels(npu_ops.load_torch_npu(), CPU), DTYPE)
    exact = tiling.max_workspace(tiling.FIA, SHAPE, 4096, MAX_LEN).nbytes
    assert exact <= queries.fused_infer_attention_max(SHAPE, 4096, MAX_LEN // NPU_BLOCK) < exact + 2
    # packed, then in the one-query-token form (a decode step's 4096 sequences, the most the kernel takes)
    call, decode = [c for c in fake_npu.calls if c.name == "_npu_fused_infer_attention_score_get_max_workspace"]
    assert call.kwargs["actual_seq_lengths_kv"] == [1024] * 4 and call.kwargs["block_table"].shape[0] == 4
    assert decode.kwargs["actual_seq_lengths"] == list(range(1, 4097)) and decode.kwargs["block_table"].shape[0] == 4096
    with pytest.raises(ValueError, match=r"capture_sizes: .* at most 4096 sequences per TND call"):
        queries.fused_infer_attention_max(SHAPE, 4097, MAX_LEN // NPU_BLOCK)
    assert fake_npu.count("_npu_fused_infer_attention_score_get_max_workspace") == 2


def _compile_fia(**options):
    cfg = LlamaConfig(dtype=DTYPE, num_layers=1, num_blocks=64, block_size=NPU_BLOCK)
    model, reference = build(cfg), build(cfg)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(**{"runtime": "npu", "max_model_len": MAX_LEN, "kernel_policy": "fia",
                              "capture_sizes": (4, 8), **options})
    fn = ascend_compile.compile(model, backend=backend(config, on_compiled=artifacts.append))
    inputs = PagedBatch(cfg, seed=2, table_width=MAX_LEN // NPU_BLOCK).step([30, 500, 7])
    with torch.no_grad():
        torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
    return artifacts[-1]


def test_piecewise_sizes_above_4096_get_no_graphs_by_the_rule(fake_npu, caplog):
    with caplog.at_level("INFO", logger="ascend_compile"):
        art = _compile_fia(piecewise_sizes=(16, 4096, 8192))
    assert [k.bucket for k in art.rewritten.piecewise.keys] == [16, 4096]
    assert "8192 tokens and above: capture_sizes: " in caplog.text and "at most 4096 sequences" in caplog.text
    asked = [c.args[0].shape[0] for c in fake_npu.calls if c.name == "_npu_fused_infer_attention_score_get_max_workspace"]
    assert max(asked) == 4096, asked  # 8192 refused by the rule, never asked


def test_a_fia_graph_above_4096_tokens_is_refused_at_compile_naming_the_layer(fake_npu):
    with pytest.raises(Exception, match=r"\(layer .*layers.0.attn\): capture_sizes: .* at most 4096 sequences per TND"):
        _compile_fia(capture_sizes=(4, 8192), piecewise_sizes=())


def test_a_piecewise_size_of_8192_compiles_on_the_devices_runtime_error_path(fake_npu, monkeypatch, caplog):
    # A device whose tiling refuses what no rule here knows: the compile takes its RuntimeError as the answer
    # for that size (no piecewise graphs from it up, logged with the device's message) and serves the rest. Here
    # the rule is lifted and the fake device refuses more than its 4096 entries, which the probe's one-query-token
    # question sends from 8192 tokens (8192 sequences) and not at 4096.
    monkeypatch.setattr(npu_rules, "TND_MAX_SEQUENCES", 1 << 20)
    with caplog.at_level("INFO", logger="ascend_compile"):
        art = _compile_fia(piecewise_sizes=(16, 4096, 8192))
    assert [k.bucket for k in art.rewritten.piecewise.keys] == [16, 4096]
    assert "8192 tokens and above: EZ9999: fake aclnn: actual_seq_lengths" in caplog.text


# ----------------------------------------------------------------------------- a task's batch and block table


@pytest.mark.parametrize("sinks", [False, True], ids=["fia", "fia-v2-sinks"])
def test_every_fia_update_keeps_the_captured_batch_and_block_table(fake_npu, sinks):
    # A windowed and a full layer, decode and mixed steps of 1 to 7 sequences in buckets 4 and 8: each update
    # of a captured FIA task (v1, or v2 with sinks) has no more entries than its capture and passes the very
    # block-table tensor its capture did (the fake refuses either otherwise: `tests/fake_torch_npu_batches.py`).
    from tests.test_npu_features import WINDOW, run_replayed

    cfg = LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK, sinks=sinks,
                      layer_types=("sliding", "full"), sliding_window=WINDOW)
    steps = [[30, 7], ([40, 300, 17], [3, 1, 2]), ([5, 9, 11, 12, 13, 14, 15], [2, 1, 1, 1, 1, 1, 1]), [20] * 8,
             ([60], [4]), ([23, 24, 25, 26, 27], [1, 1, 1, 1, 2])]
    fake_npu.band_at_single_query = True
    run_replayed(cfg, steps, eager=0)
    assert fake_npu.batches.updates_checked >= 2 * (len(steps) - 2)  # both layers of every replayed FIA graph


def test_the_fake_refuses_an_update_growing_the_batch_or_rebinding_the_block_table():
    from tests.fake_torch_npu_batches import TaskBatches

    table = torch.zeros(8, 2, dtype=torch.int32)
    name = "npu_fused_infer_attention_score.out"
    batches = TaskBatches()
    batches.group_begin()
    batches.issued(name, {"actual_seq_lengths_kv": [1, 2, 3], "block_table": table[:3]}, capturing=True)
    captured = batches.group_end()
    for kv_lens, rows, why in (([1, 2, 3, 4], 4, "4 batch entries, more than the 3"), ([1, 2], 2, "another block table"),
                               ([1, 2, 3], 3, None)):
        batches.update_begin(captured)
        view = table[:rows] if why else table[:3]
        if why:
            with pytest.raises(RuntimeError, match=why):
                batches.issued(name, {"actual_seq_lengths_kv": kv_lens, "block_table": view}, capturing=False)
        else:
            batches.issued(name, {"actual_seq_lengths_kv": kv_lens, "block_table": view}, capturing=False)
        batches.update_end()
    assert batches.updates_checked == 1


# ----------------------------------------------------------------------------- the device's own answer per layer form


def _serve(cfg, steps=([30, 7], ([40, 300, 17], [3, 1, 2])), kernel_policy="fia", replayed=True, once=False,
           **options):
    """`cfg`'s model on npu (FIA in every bucket, by default) over `steps`, each equal to eager and replayed
    (else served on piecewise graphs, `replayed=False`); compiled by `torch.compile` (by
    `ascend_compile.compile`, one compile, where `once`); its artifacts."""
    model, reference = build(cfg), build(cfg)
    artifacts = []
    torch._dynamo.reset()
    config = CompileConfig(runtime="npu", max_model_len=MAX_LEN, kernel_policy=kernel_policy, capture_sizes=(4, 8),
                           **options)
    fn = (ascend_compile.compile if once else torch.compile)(model, backend=backend(config,
                                                                                   on_compiled=artifacts.append))
    batch = PagedBatch(cfg, seed=4)
    with torch.no_grad():
        for lens, qlens in (s if isinstance(s, tuple) else (s, None) for s in steps):
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOLERANCES[cfg.dtype])
    assert sum(a.stats["replays" if replayed else "piecewise_steps"] for a in artifacts) == len(steps)
    return artifacts


FORMS = {  # name: (LlamaConfig sizes, served on c29bc106, served on the later source)
    "float16-gqa-d64": (dict(dtype=torch.float16, head_dim=64, hidden_size=128), False, True),
    "bfloat16-gqa-d96": (dict(head_dim=96, hidden_size=128), False, True),
    "bfloat16-gqa-d128": (dict(head_dim=128, hidden_size=128), True, True),
    "bfloat16-mha-d96": (dict(head_dim=96, hidden_size=128, num_kv_heads=4), False, False),
    "bfloat16-gqa-d96-windowed": (dict(head_dim=96, hidden_size=128, layer_types=("sliding", "full"),
                                       sliding_window=24), False, False),
}


@pytest.mark.parametrize("source", fake_torch_npu_sources.SOURCES)
@pytest.mark.parametrize("form", list(FORMS))
def test_a_layer_form_the_devices_kernel_refuses_is_refused_at_compile_naming_the_layer(fake_npu, source, form):
    # Where the kernel source's versions differ (float16, a head dim outside 64/128, band mode, MHA against GQA),
    # the device is asked once per layer form at compile time: served where its kernel takes the form, else
    # refused before any capture, naming the layer and the device's own message.
    sizes, older, later = FORMS[form]
    fake_npu.kernel_source = source
    fake_npu.band_at_single_query = True
    cfg = LlamaConfig(**{"dtype": DTYPE, "num_layers": 2, "num_blocks": 128, "block_size": NPU_BLOCK, **sizes})
    if (older, later)[fake_torch_npu_sources.SOURCES.index(source)]:
        _serve(cfg)
        return
    with pytest.raises(Exception, match=r"\(layer .*layers\.0\.attn\): torch_npu\.npu_fused_infer_attention_score "
                                        r"does not take this layer on this device: the device's FIA refused a call "
                                        r"of this layer's form at [12] query token\(s\): EZ9999: fake aclnn: "):
        _serve(cfg)
    assert not [c for c in fake_npu.calls if c.name == "npu_fused_infer_attention_score.out"
                and tuple(c.kwargs["block_table"].shape) != (1, 1)], "a call beyond the form probe's"


def test_the_form_probe_asks_once_per_distinct_form(fake_npu):
    # Two layers of one form, compiled twice (static and dynamic): one decode and one mixed call, ever.
    fake_npu.kernel_source = fake_torch_npu_sources.LATER
    _serve(LlamaConfig(dtype=DTYPE, num_layers=2, num_blocks=128, block_size=NPU_BLOCK, head_dim=96, hidden_size=128),
           steps=([30, 7], [5, 6, 7], ([40, 300, 17], [3, 1, 2])))
    probes = [c.kwargs["actual_seq_lengths"] for c in fake_npu.calls if c.name == "npu_fused_infer_attention_score.out"
              and tuple(c.kwargs["block_table"].shape) == (1, 1)]
    assert probes == [[1], [2]]


@pytest.mark.parametrize("source", fake_torch_npu_sources.SOURCES)
def test_auto_times_a_refused_form_as_never_finishing_and_refuses_the_layer_by_name(fake_npu, source):
    # kernel_policy "auto" times FIA on the device: where its kernel refuses the layer's form (float16 on the
    # older source) the timing call's RuntimeError is no compile failure of its own; the mixed graph's FIA layer
    # is then refused by the form probe, naming it. On the later source the same model is timed and served.
    fake_npu.kernel_source = source
    cfg = LlamaConfig(dtype=torch.float16, num_layers=1, num_blocks=128, block_size=NPU_BLOCK, head_dim=64,
                      hidden_size=128)
    if source == fake_torch_npu_sources.LATER:
        _serve(cfg, kernel_policy="auto")
        return
    with pytest.raises(Exception, match=r"\(layer .*layers\.0\.attn\): torch_npu\.npu_fused_infer_attention_score "
                                        r"does not take this layer on this device: .* expected bf16"):
        _serve(cfg, kernel_policy="auto")


@pytest.mark.parametrize("source", fake_torch_npu_sources.SOURCES)
@pytest.mark.parametrize("form", ["float16-gqa-d64", "bfloat16-gqa-d96", "bfloat16-gqa-d96-windowed"])
def test_with_refused_layers_eager_a_refused_form_is_served_eagerly_between_pieces_with_one_warning(
        fake_npu, source, form, caplog):
    # refused_layers="eager": a layer whose form the device refuses runs as traced, between captured pieces; no
    # full graph holding it is captured (its steps go piecewise), no kernel call of its form is made beyond the
    # probe's, one WARNING names it. A layer the device takes keeps its kernel: the windowed form on the later
    # source refuses the windowed layer 0 (band mode, D 96) and serves the full layer 1 on SplitFuse.
    sizes, older, later = FORMS[form]
    fake_npu.kernel_source = source
    fake_npu.band_at_single_query = True
    cfg = LlamaConfig(**{"dtype": DTYPE, "num_layers": 2, "num_blocks": 128, "block_size": NPU_BLOCK, **sizes})
    served = (older, later)[fake_torch_npu_sources.SOURCES.index(source)]
    refused = {0, 1} if source == fake_torch_npu_sources.OLDER or "windowed" not in form else {0}
    steps = ([30, 7], ([40, 300, 17], [3, 1, 2]), [12, 13, 14, 15, 16], ([60, 5], [6, 1]))
    with caplog.at_level("WARNING", logger="ascend_compile"):
        artifacts = _serve(cfg, steps, replayed=served, once=True, refused_layers="eager")
    warnings = [r.getMessage() for r in caplog.records if "served eagerly" in r.getMessage()]
    if served:
        assert not warnings
        return
    assert len(warnings) == 1, warnings
    for layer in range(2):
        assert (f"layers.{layer}.attn): torch_npu.npu_fused_infer_attention_score does not take this layer on this "
                f"device: the device's FIA refused" in warnings[0]) == (layer in refused), warnings[0]
    (art,) = artifacts
    assert len(art.rewritten.eager_layers) == len(refused)
    assert art.stats["captures"] == 0 and art.stats["piecewise_captures"] >= 1
    for graph in art.pieces.graphs.values():  # each refused layer's attention op between pieces, as such
        assert graph.describe()["eager_why"]["attention op"] == len(refused)
    probed = [c for c in fake_npu.calls if c.name.startswith("npu_fused_infer_attention_score")
              and tuple(c.kwargs["block_table"].shape) != (1, 1)]
    # the layer kept: one call a step, and one more a piecewise capture (its pieces replayed once on the
    # step's values, `lowering/piecewise_live.py`)
    kept_calls = len(steps) + art.stats["piecewise_captures"]
    assert len(probed) == (0 if len(refused) == 2 else kept_calls), "a FIA call of a refused layer"
