"""The passes on their own: roles, kernel choice per bucket, workspace planning, foreign ops, dumps."""
from __future__ import annotations

import itertools

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch import fx

from ascend_compile import cli
from ascend_compile.config import CompileConfig
from ascend_compile.ops import tiling
from ascend_compile.ops.kernel_policy import KernelPolicy, choose_kernel
from ascend_compile.passes import adapt_attention, pipeline
from ascend_compile.passes.fx_utils import clone_graph_module, is_op
from ascend_compile.passes.kernel_call import HOST_META_KEY, Conversion, HostSource, KernelCall
from ascend_compile.passes.roles import Role, assign_roles
from ascend_compile.passes.select_kernels import select_kernels
from ascend_compile.passes.workspaces import GraphKey, KernelSite, insert_workspaces, kernel_sites, plan_workspaces
from ascend_compile.runtime.sim import SimRuntime
from ascend_compile.targets import Target
from examples.llama import LlamaConfig, PagedBatch, build

SHAPE = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)


def trace(model, inputs, dynamic=True):
    """The dynamo graph of `model` on `inputs` (and the example inputs), via a capturing backend."""
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture, dynamic=dynamic)(**inputs)
    return captured[0]


@pytest.fixture(scope="module")
def llama_graph():
    cfg = LlamaConfig(num_layers=2)
    model = build(cfg)
    batch = PagedBatch(cfg)
    gm, _ = trace(model, batch.step([5, 17, 70]))  # 3 sequences, 5 blocks wide: dynamo gives each its own size
    return gm


def test_roles_of_the_example_model(llama_graph):
    gm = clone_graph_module(llama_graph)
    sig = assign_roles(gm, adapt_attention(gm))
    roles = {spec.name: spec.role for spec in sig.inputs}
    assert roles["l_seq_lens_"] is Role.SEQ_LENS
    assert roles["l_block_table_"] is Role.BLOCK_TABLE
    assert roles["l_query_start_loc_"] is Role.QUERY_START_LOC
    assert roles["l_slot_mapping_"] is Role.SLOT_MAPPING
    assert roles["l_input_ids_"] is Role.BATCH and roles["l_positions_"] is Role.BATCH
    caches = [n for n, r in roles.items() if r is Role.KV_CACHE]
    assert len(caches) == 4 and all("cache" in n for n in caches)
    assert roles["l_self_modules_lm_head_parameters_weight_"] is Role.STATIC
    assert sig.pad_reason is None
    assert sorted(k.value for k in sig.symbol_kinds.values()) == ["blocks", "tokens"]
    assert sorted(sig.padded_symbols(8, 64).values()) == [8, 64]
    placeholders = {n.name: n.meta["ascend_role"] for n in gm.graph.nodes if n.op == "placeholder"}
    assert placeholders["l_seq_lens_"] == "seq_lens"


@pytest.mark.parametrize(
    "policy,bucket,expected",
    [
        (KernelPolicy("pa_max_batch", pa_max_batch=8), 8, tiling.PA),
        (KernelPolicy("pa_max_batch", pa_max_batch=8), 16, tiling.FIA),
        (KernelPolicy("pa_batch_sizes", pa_batch_sizes=(1, 4)), 4, tiling.PA),
        (KernelPolicy("pa_batch_sizes", pa_batch_sizes=(1, 4)), 2, tiling.FIA),
        (KernelPolicy("pa"), 256, tiling.PA),
        (KernelPolicy("fia"), 1, tiling.FIA),
    ],
)
def test_kernel_choice_per_bucket(policy, bucket, expected):
    choice = choose_kernel(policy, bucket, decode=True, shape=SHAPE)
    assert choice.kernel == expected
    assert str(bucket) in choice.reason or policy.kind in choice.reason


def test_mixed_steps_always_get_fia_with_the_reason():
    choice = choose_kernel(KernelPolicy("pa"), 4, decode=False, shape=SHAPE)
    assert choice.kernel == tiling.FIA and "PA is decode-only" in choice.reason


def test_auto_keeps_the_faster_kernel_and_records_times():
    def timer(kernel, shape, bucket):
        fast = tiling.PA if bucket < 32 else tiling.FIA
        return 0.001 if kernel == fast else 0.002

    policy = KernelPolicy("auto", timer=timer)
    small = choose_kernel(policy, 8, True, SHAPE)
    large = choose_kernel(policy, 64, True, SHAPE)
    assert (small.kernel, large.kernel) == (tiling.PA, tiling.FIA)
    assert small.times_ms == {tiling.PA: 1.0, tiling.FIA: 2.0}
    assert "measured PA 1.000 ms vs FIA 2.000 ms" in small.reason


def test_auto_times_real_kernels_through_the_backend(tmp_path):
    cfg = CompileConfig(max_model_len=64, capture_sizes=(1, 2), kernel_policy="auto", dump_dir=str(tmp_path))
    model = build(LlamaConfig(num_layers=1))
    inputs = PagedBatch(model.cfg).step([3, 9])
    gm, _ = trace(model, inputs)
    rewritten = pipeline.rewrite_buckets(gm, cfg, Target(SimRuntime()))
    for key, choices in rewritten.choices.items():
        if key.decode:
            assert all(set(c.times_ms) == {tiling.PA, tiling.FIA} for c in choices)


def test_select_kernels_rewrites_every_layer(llama_graph):
    gm = clone_graph_module(llama_graph)
    adapt_attention(gm)
    calls = select_kernels(gm, [tiling.PA, tiling.PA])
    assert [c.meta.kernel for c in calls] == [tiling.PA, tiling.PA]
    assert not [n for n in gm.graph.nodes if is_op(n, torch.ops.ascend.attention)]
    kernels = [n for n in gm.graph.nodes if is_op(n, torch.ops.ascend.paged_attention)]
    assert kernels == [c.node for c in calls]
    host = [n for n in gm.graph.nodes if n.op == "placeholder" and HOST_META_KEY in n.meta]
    assert [n.meta[HOST_META_KEY] for n in host] == [HostSource("l_seq_lens_", Conversion.LIST)]
    assert all(KernelCall.of(k).arg("context_lens") is host[0] for k in kernels)
    with pytest.raises(ValueError, match=r"kernels: expected one per attention node \(0\), got 1"):
        select_kernels(gm, [tiling.PA])


# ---------------------------------------------------------------- workspaces


def peak_splits(kv_lens):
    """A test kernel whose workspace peaks on lengths 601..700 (7 splits) and falls after them."""
    return torch.where(kv_lens <= 700, (kv_lens + 99) // 100, torch.ones_like(kv_lens) * 2).clamp(min=0)


tiling.register_tiling("test_peak", peak_splits)


def small_short(kv_lens):
    """Short tiling of the two-mode test rule: a split per 2 keys, at most 6."""
    return ((kv_lens + 1) // 2).clamp(max=6)


def small_long(kv_lens):
    """Long tiling of the two-mode test rule (above 5 keys): a split per 4 keys, at most 3."""
    return ((kv_lens + 3) // 4).clamp(max=3)


tiling.register_tiling("test_modes", tiling.Tiling(small_short, small_long, 5))


def brute_force_max(kernel, shape, tokens, max_len):
    best, arg = -1, None
    for length in range(1, max_len + 1):
        need = tiling.workspace_nbytes(kernel, shape, [length] * tokens)
        if need > best:
            best, arg = need, length
    return best, arg


@pytest.mark.parametrize("kernel", [tiling.PA, tiling.FIA, "test_peak"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_uniform_workspace_maximum_equals_brute_force(kernel, tokens):
    max_len = 5000
    exact = tiling.max_uniform_workspace(kernel, SHAPE, tokens, max_len)
    assert (exact.nbytes, exact.argmax_len) == brute_force_max(kernel, SHAPE, tokens, max_len)


@pytest.mark.parametrize("kernel", ["test_modes", "test_peak", tiling.FIA])
@pytest.mark.parametrize("max_len", [1, 4, 5, 6, 9, 14])
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_workspace_maximum_over_mixed_batches_equals_brute_force(kernel, max_len, tokens):
    # Every batch of `tokens` sequences with KV lengths in [0, max_len]: the closed form is its maximum,
    # and the batch it names needs exactly that.
    brute = max(tiling.workspace_nbytes(kernel, SHAPE, list(lens))
                for lens in itertools.combinations_with_replacement(range(max_len + 1), tokens))
    exact = tiling.max_workspace(kernel, SHAPE, tokens, max_len)
    assert exact.nbytes == brute
    assert len(exact.argmax_batch) == tokens
    assert tiling.workspace_nbytes(kernel, SHAPE, list(exact.argmax_batch)) == exact.nbytes


def test_a_mixed_pa_batch_needs_more_than_every_uniform_batch():
    uniform = tiling.max_uniform_workspace(tiling.PA, SHAPE, 4, 8192)
    mixed = tiling.max_workspace(tiling.PA, SHAPE, 4, 8192)
    # Alone, lengths above 4096 are tiled long; with one sequence of at most 4096 they are tiled short.
    assert uniform.argmax_len == 3841 and mixed.argmax_batch == (7937, 7937, 7937, 3841)
    assert mixed.nbytes == tiling.workspace_nbytes(tiling.PA, SHAPE, list(mixed.argmax_batch)) > uniform.nbytes
    assert tiling.workspace_nbytes(tiling.PA, SHAPE, [7937] * 4) < uniform.nbytes


def test_interior_peak_is_found_and_recorded():
    plan = plan_workspaces([(GraphKey(4, True), [KernelSite("k", "test_peak", SHAPE)])], max_model_len=2000)
    slot = plan.slots["attn_workspace"]
    assert slot.argmax_len == 601  # the first length with the peak need
    assert slot.nbytes == tiling.workspace_nbytes("test_peak", SHAPE, [700] * 4)
    assert slot.nbytes > tiling.workspace_nbytes("test_peak", SHAPE, [2000] * 4)
    assert not slot.undersized and plan.warnings() == []


def test_pinned_length_reproduces_undersizing():
    plan = plan_workspaces([(GraphKey(2, True), [KernelSite("k", tiling.PA, SHAPE)])], max_model_len=8192,
                           pinned_seq_len=8192)
    slot = plan.slots["attn_workspace"]
    assert slot.undersized
    assert slot.nbytes == tiling.workspace_nbytes(tiling.PA, SHAPE, [8192, 8192])
    assert slot.exact_nbytes == tiling.workspace_nbytes(tiling.PA, SHAPE, list(slot.exact_argmax_batch))
    assert "workspace_seq_len=8192" in plan.warnings()[0] and "overrun" in plan.warnings()[0]


def test_pinned_at_the_uniform_peak_serves_one_sequence_but_not_a_mix():
    peak = tiling.max_workspace(tiling.PA, SHAPE, 1, 8192).argmax_len
    one = plan_workspaces([(GraphKey(1, True), [KernelSite("k", tiling.PA, SHAPE)])], 8192, pinned_seq_len=peak)
    assert not one.slots["attn_workspace"].undersized
    two = plan_workspaces([(GraphKey(2, True), [KernelSite("k", tiling.PA, SHAPE)])], 8192, pinned_seq_len=peak)
    assert two.slots["attn_workspace"].undersized
    assert "a step of KV lengths [7937, 3841] needs" in two.warnings()[0]


def test_shared_slot_and_the_schemes_it_saves():
    graphs = [(GraphKey(b, True), [KernelSite(f"k{i}", tiling.PA, SHAPE) for i in range(3)]) for b in (1, 2, 4)]
    shared = plan_workspaces(graphs, 4096)
    per_bucket = plan_workspaces(graphs, 4096, shared=False)
    unit = tiling.max_workspace(tiling.PA, SHAPE, 1, 4096).nbytes
    assert shared.slots["attn_workspace"].nbytes == 4 * unit
    assert shared.schemes == {"shared": 4 * unit, "per_bucket": 7 * unit, "per_layer": 21 * unit}
    assert sorted(s.nbytes for s in per_bucket.slots.values()) == [unit, 2 * unit, 4 * unit]


def test_insert_workspaces_gives_all_layers_one_slot(llama_graph):
    gm = clone_graph_module(llama_graph)
    adapt_attention(gm)
    select_kernels(gm, [tiling.FIA, tiling.FIA])
    key = GraphKey(4, True)
    plan = plan_workspaces([(key, kernel_sites(gm))], max_model_len=2048)
    ws = insert_workspaces(gm, [key], plan)
    nodes = [n for n in gm.graph.nodes if is_op(n, torch.ops.ascend.workspace)]
    assert nodes == [ws] and ws.args[0] == plan.slots["attn_workspace"].nbytes > 0
    assert len(ws.users) == 2


# ---------------------------------------------------------------- foreign op


@torch.library.custom_op("vllm_test::unified_attention_with_output", mutates_args=("output",))
def unified_attention_with_output(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_name: str,
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    num_heads: int, head_dim: int, scale: float,
) -> None:
    """vLLM's argument order (query, key, value, output, layer_name), metadata passed explicitly."""
    tokens = query.shape[0]
    kv_heads = kv_cache.shape[3]
    k = key.view(tokens, kv_heads, head_dim)
    v = value.view(tokens, kv_heads, head_dim)
    slots = torch.zeros(tokens, dtype=torch.int64)
    loc = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        for i, t in enumerate(range(loc[b], loc[b + 1])):
            pos = length - (loc[b + 1] - loc[b]) + i
            slots[t] = int(block_table[b, pos // kv_cache.shape[2]]) * kv_cache.shape[2] + pos % kv_cache.shape[2]
    torch.ops.ascend.reshape_and_cache(k, v, kv_cache[0], kv_cache[1], slots)
    out = torch.ops.ascend.attention(query.view(tokens, num_heads, head_dim), kv_cache[0], kv_cache[1], block_table,
                                     seq_lens, query_start_loc, scale)
    output.copy_(out.view(tokens, -1))


@unified_attention_with_output.register_fake
def _(query, key, value, output, layer_name, kv_cache, block_table, seq_lens, query_start_loc, num_heads, head_dim, scale):
    return None


def adapt_unified(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """The adapter: the attention part onto `ascend.attention`, its result copied into `output`."""
    (query, key, value, output, _layer, kv_cache, block_table, seq_lens, loc, heads, dim, scale) = node.args
    q = graph.call_method("view", (query, -1, heads, dim))
    k_cache = graph.call_function(torch.select, (kv_cache, 0, 0))
    v_cache = graph.call_function(torch.select, (kv_cache, 0, 1))
    attn = graph.call_function(torch.ops.ascend.attention.default, (q, k_cache, v_cache, block_table, seq_lens, loc, scale))
    flat = graph.call_method("flatten", (attn, 1))
    graph.call_method("copy_", (output, flat))
    return attn


class ForeignModel(torch.nn.Module):
    def __init__(self, heads=4, kv_heads=2, dim=16, blocks=32, block_size=16):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.dim = heads, dim
        self.proj = torch.nn.Linear(32, (heads + 2 * kv_heads) * dim, bias=False)
        self.sizes = (heads * dim, kv_heads * dim, kv_heads * dim)
        self.register_buffer("kv_cache", torch.randn(2, blocks, block_size, kv_heads, dim))

    def forward(self, x, block_table, seq_lens, query_start_loc):
        q, k, v = self.proj(x).split(self.sizes, dim=-1)
        out = torch.empty_like(q)
        torch.ops.vllm_test.unified_attention_with_output(
            q, k, v, out, "layer.0", self.kv_cache, block_table, seq_lens, query_start_loc, self.heads, self.dim, 0.25
        )
        return out * 2


def test_foreign_op_is_rewritten_like_the_builtin_one():
    from ascend_compile import register_attention_op
    from ascend_compile.passes.find_attention import unregister_attention_op

    register_attention_op(torch.ops.vllm_test.unified_attention_with_output, adapt_unified)
    try:
        model = ForeignModel()
        inputs = dict(x=torch.randn(3, 32), block_table=torch.arange(12, dtype=torch.int32).view(3, 4),
                      seq_lens=torch.tensor([5, 17, 33], dtype=torch.int32),
                      query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32))
        gm, _ = trace(model, inputs)
        attn = adapt_attention(gm)
        assert len(attn) == 1
        assert "vllm_test.unified_attention_with_output" in attn[0].meta["ascend_adapted_from"]
        assert not [n for n in gm.graph.nodes if is_op(n, torch.ops.vllm_test.unified_attention_with_output)]
        select_kernels(gm, [tiling.PA])
        assert [n for n in gm.graph.nodes if is_op(n, torch.ops.ascend.paged_attention)]
    finally:
        unregister_attention_op(torch.ops.vllm_test.unified_attention_with_output)


# ---------------------------------------------------------------- config


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"options: unknown option\(s\) \['max_len'\]; valid options are \[.*'max_model_len'"):
        CompileConfig.from_options({"max_len": 10})


@pytest.mark.parametrize(
    "options,message",
    [
        ({"kernel_policy": "fastest"}, "kernel_policy: expected one of"),
        ({"capture_sizes": [0, 4]}, "capture_sizes: expected a non-empty list of positive ints"),
        ({"capture_sizes": 8}, "capture_sizes: expected a list of ints"),
        ({"max_model_len": -1}, "max_model_len: expected a positive int"),
        ({"runtime": "tpu"}, "runtime: expected one of"),
        ({"max_model_len": 100, "workspace_seq_len": 200}, "workspace_seq_len: expected at most max_model_len"),
        ({"clone_outputs": "yes"}, "clone_outputs: expected True or False"),
        ({"frozen_parameters": 1}, "frozen_parameters: expected True or False"),
    ],
)
def test_bad_option_values(options, message):
    with pytest.raises(ValueError, match=message):
        CompileConfig.from_options(options)


def test_missing_max_model_len_fails_clearly(llama_graph):
    with pytest.raises(ValueError, match="max_model_len: required for graphs with paged attention"):
        pipeline.rewrite_buckets(clone_graph_module(llama_graph), CompileConfig(), Target(SimRuntime()))


def test_dump_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ASCEND_COMPILE_DUMP_DIR", str(tmp_path))
    assert CompileConfig().dump_dir == str(tmp_path)


# ---------------------------------------------------------------- dumps and inspect


def test_dumps_are_written_and_inspect_reads_them(llama_graph, tmp_path, capsys):
    cfg = CompileConfig(max_model_len=512, capture_sizes=(1, 4, 16), dump_dir=str(tmp_path), pa_max_batch=4)
    rewritten = pipeline.rewrite_buckets(clone_graph_module(llama_graph), cfg, Target(SimRuntime()))
    from ascend_compile.passes import dump

    dump.dump_plan(rewritten.graph_dir, rewritten.describe)
    graph_dir = tmp_path / os.path.basename(rewritten.graph_dir)
    files = sorted(p.relative_to(graph_dir).as_posix() for p in graph_dir.rglob("*.py"))
    assert "original/dynamo.py" in files
    # Each variant once (PA decode; FIA, serving b16's decode and mixed steps and every mixed step), whatever
    # the buckets.
    for variant in ("pa", "fia"):
        assert f"{variant}/1_select_kernels.py" in files and f"{variant}/2_insert_workspaces.py" in files
    assert "piecewise/2_insert_workspaces.py" in files and len(files) == 6  # and the piecewise variant
    assert "paged_attention" in (graph_dir / "pa" / "1_select_kernels.py").read_text()
    plan = json.loads((graph_dir / "plan.json").read_text())
    assert plan["variants"] == {"pa": {"kernels": [tiling.PA] * 2, "graphs": ["b1.decode", "b4.decode"]},
                                "fia": {"kernels": [tiling.FIA] * 2,
                                        "graphs": ["b1.mixed", "b4.mixed", "b16.decode", "b16.mixed"]}}
    assert plan["graphs"]["b16.decode"]["variant"] == "fia"
    assert plan["graphs"]["b4.decode"]["kernels"][0]["host_args"] == {
        "context_lens": {"input": "l_seq_lens_", "conversion": "list"}}
    assert plan["graphs"]["b16.decode"]["kernels"][0]["kernel"] == tiling.FIA
    assert plan["graphs"]["b4.decode"]["kernels"][0]["reason"] == "PA: bucket 4 <= pa_max_batch 4"

    assert cli.main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "workspace slots" in text and "attn_workspace" in text and "PA: bucket 4 <= pa_max_batch 4" in text
    assert "padding sequences: decode steps: one padding sequence per padded token" in text
    assert "dummy sequences of at most 128 tokens" in plan["padding_sequences"]
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[graph_dir.name]["buckets"] == [1, 4, 16]


def test_inspect_errors_on_a_missing_directory(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(
    kernel=st.sampled_from([tiling.PA, tiling.FIA, "test_peak"]),
    lens=st.lists(st.integers(0, 6000), min_size=1, max_size=16),
)
def test_no_step_needs_more_than_the_planned_maximum(kernel, lens):
    planned = tiling.max_workspace(kernel, SHAPE, len(lens), 6000)
    assert tiling.workspace_nbytes(kernel, SHAPE, lens) <= planned.nbytes


def test_torch_trace_holds_our_graphs_and_plan_for_tlparse(tmp_path):
    """Under TORCH_TRACE, every variant's stages and the plan are structured-trace artifacts beside dynamo's."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from examples.llama import LlamaConfig, PagedBatch, build\n"
        "cfg = LlamaConfig(num_layers=1)\n"
        "fn = torch.compile(build(cfg), backend='ascend_graph',\n"
        "                   options={'max_model_len': 64, 'capture_sizes': [4], 'pa_max_batch': 4})\n"
        "with torch.no_grad():\n"
        "    fn(**PagedBatch(cfg).step([3, 9]))\n"
    )
    env = dict(os.environ, TORCH_TRACE=str(tmp_path / "trace"))
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    text = "".join(p.read_text() for p in (tmp_path / "trace").iterdir())
    # glog-style lines: a prefix, then the record's JSON (payload lines follow, tab-indented)
    records = [json.loads(line[line.index("] {") + 2:]) for line in text.splitlines() if "] {" in line]
    names = {r["artifact"]["name"] for r in records if "artifact" in r}
    assert {"ascend_compile_original_dynamo", "ascend_compile_pa_1_select_kernels",
            "ascend_compile_pa_2_insert_workspaces", "ascend_compile_plan"} <= names
    assert any("dynamo_output_graph" in r for r in records)  # dynamo's own graph, in the same trace
    assert "torch.ops.ascend.paged_attention.default" in text
