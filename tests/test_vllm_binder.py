"""`integrations/vllm/binder.py`'s `ForwardContextBinder` outside a compile: what it reads from the forward
context before and between compiled steps (whether a step can be compiled against, the longest sequence
from the metadata's host copies, a step whose metadata asks for other attention), the layer names of the
graph's vLLM op nodes (constant or hoisted `LayerName` inputs), the refusals it gathers, and one step's read
of its provided inputs (one pass, the host copies merged). vLLM's ops are the stand-in's
(`tests/vllm_standin.py`); the rewrite itself, compiled: `tests/test_vllm.py`."""
from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch
from torch import fx

from ascend_compile.integrations.vllm import binder as binder_module
from ascend_compile.integrations.vllm import context
from ascend_compile.integrations.vllm.binder import ForwardContextBinder, _host_all, _read_all, _Reader
from ascend_compile.integrations.vllm.layers import UnsupportedAttention
from tests import vllm_standin as v

FLASH_ATTN = type("FlashAttentionBackend", (), {"__module__": "vllm.v1.attention.backends.flash_attn",
                                                 "__qualname__": "FlashAttentionBackend"})


@pytest.fixture(autouse=True)
def ops():
    v.register()


def _binder(ctx) -> ForwardContextBinder:
    return ForwardContextBinder(lambda: ctx)


def _layer(cache) -> SimpleNamespace:
    return SimpleNamespace(kv_cache=cache, attn_backend=FLASH_ATTN, impl=SimpleNamespace(scale=0.5))


# ---------------------------------------------------------------- the forward context


def test_outside_a_forward_context_there_is_none():
    def vllms():  # vLLM's get_forward_context asserts there is one
        raise AssertionError("Forward context is not set.")

    assert ForwardContextBinder(vllms).current_context() is None
    ctx = object()
    assert _binder(ctx).current_context() is ctx


@pytest.mark.parametrize("ctx, reason", [
    (None, "no forward context"),
    (SimpleNamespace(attn_metadata=None, no_compile_layers={}), "no attention metadata (vLLM's profiling run)"),
    (SimpleNamespace(attn_metadata=[{}, {}], no_compile_layers={}),
     "attn_metadata is a list (DBO / micro-batching), which ascend_graph does not support"),
    (SimpleNamespace(attn_metadata={}, no_compile_layers={"l0": _layer(torch.zeros(2, 2, 4, 1, 8))}),
     "layer 'l1' has no KV cache bound (forward_context.no_compile_layers['l1'].kv_cache)"),
    (SimpleNamespace(attn_metadata={}, no_compile_layers={"l0": _layer(torch.zeros(2, 2, 4, 1, 8)),
                                                          "l1": _layer(torch.zeros(0))}),
     "layer 'l1' has no KV cache bound (forward_context.no_compile_layers['l1'].kv_cache)"),
    (SimpleNamespace(attn_metadata={}, no_compile_layers={"l0": _layer(torch.zeros(2, 2, 4, 1, 8)),
                                                          "l1": SimpleNamespace()}),
     "layer 'l1' has no KV cache bound (forward_context.no_compile_layers['l1'].kv_cache)"),
])
def test_a_step_that_cannot_be_compiled_against_says_why(ctx, reason):
    assert _binder(ctx).not_ready(["l0", "l1"]) == reason


def test_a_step_whose_layers_all_have_caches_can_be_compiled_against():
    ctx = SimpleNamespace(attn_metadata={}, no_compile_layers={
        "l0": _layer(torch.zeros(2, 2, 4, 1, 8)), "l1": _layer((torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8))),
        "mla": _layer(torch.zeros(2, 4, 40))})  # an MLA layer's latent cache
    assert _binder(ctx).not_ready(["l0", "l1", "mla"]) is None


def test_the_longest_sequence_is_read_from_every_bound_groups_host_copy():
    metadata = {"a": SimpleNamespace(max_seq_len=40), "b": SimpleNamespace(seq_lens_list=[3, 90, 7]),
                "c": SimpleNamespace(max_seq_len=None, seq_lens_list=[]), "z": SimpleNamespace(max_seq_len=0),
                "d": SimpleNamespace(max_seq_len=12, seq_lens_list=[500])}
    binder = _binder(SimpleNamespace(attn_metadata=metadata))
    for groups, longest in ((["a", "b"], 90), (["b", "a"], 90), (["a"], 40), (["c"], None), ([], None),
                            (["z"], 0), (["z", "c"], 0), (["d"], 12), (["c", "a"], 40)):
        binder.group_layers = groups
        assert binder.longest_sequence() == longest, groups
    binder.group_layers = ["a"]
    metadata["a"].max_seq_len = torch.tensor(41)
    assert binder.longest_sequence() == 41 and type(binder.longest_sequence()) is int


def test_a_step_whose_metadata_asks_for_other_attention_is_named_by_its_first_layer():
    metadata = {"a": SimpleNamespace(), "b": SimpleNamespace(causal=False), "c": SimpleNamespace(rswa_prefix_lens=1)}
    binder = _binder(SimpleNamespace(attn_metadata=metadata))
    binder.group_layers = ["a"]
    assert binder.unserved_step() is None
    binder.group_layers = ["a", "b", "c"]
    assert binder.unserved_step() == "layer 'b''s metadata asks for non-causal attention (attn_metadata.causal=False)"


# ---------------------------------------------------------------- layer names


def _graph(layer_args: tuple) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """A graph calling the cache update, then the attention op, for each of `layer_args` (a name or a
    placeholder name: a hoisted input)."""
    graph = fx.Graph()
    q, k, val, out = (graph.placeholder(n) for n in ("q", "k", "v", "out"))
    inputs = {name: graph.placeholder(name) for name in layer_args if name.startswith("L_")}
    updates, attentions = [], []
    for name in layer_args:
        arg = inputs.get(name, name)
        updates.append(graph.call_function(torch.ops.vllm.unified_kv_cache_update.default, (k, val, arg)))
        attentions.append(graph.call_function(torch.ops.vllm.unified_attention_with_output.default,
                                              (q, k, val, out, arg)))
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph), updates, attentions


def test_the_graphs_vllm_nodes_are_found_in_order():
    gm, updates, attentions = _graph(("l0", "l1"))
    assert binder_module.vllm_graph_nodes(gm) == (attentions, updates)
    assert binder_module.vllm_graph_nodes(fx.symbolic_trace(lambda x: x + 1)) == ([], [])


def test_a_vllm_op_missing_from_torch_ops_vllm_is_none():
    assert binder_module._vllm_op("no_such_op") is None
    assert binder_module._vllm_op(binder_module.ATTENTION_OP) is torch.ops.vllm.unified_attention_with_output


def test_layer_names_are_read_from_each_ops_own_argument():
    gm, updates, attentions = _graph(("model.layers.0.attn", "model.layers.1.attn"))
    binder = _binder(None)
    assert [binder.layer_name(gm, n) for n in updates] == ["model.layers.0.attn", "model.layers.1.attn"]
    assert binder.layer_names(gm) == ["model.layers.0.attn", "model.layers.1.attn"]


def test_a_layer_name_hoisted_to_a_graph_input_is_read_from_its_example_input():
    gm, updates, attentions = _graph(("L_a", "L_b"))
    examples = [None] * 4 + [v.LayerName("model.layers.0.attn"), "model.layers.1.attn"]
    binder = ForwardContextBinder(lambda: None, examples)
    assert binder.layer_names(gm) == ["model.layers.0.attn", "model.layers.1.attn"]
    assert binder.layer_name(gm, updates[1]) == "model.layers.1.attn"
    placeholder = gm.graph.find_nodes(op="placeholder")[5]  # past the example inputs: its example value
    placeholder.meta["example_value"] = "model.layers.9.attn"
    assert ForwardContextBinder(lambda: None, examples[:5]).layer_name(gm, attentions[1]) == "model.layers.9.attn"


def test_a_layer_name_of_another_type_is_refused():
    gm, updates, attentions = _graph(("L_a",))
    binder = ForwardContextBinder(lambda: None, [None] * 4 + [7])
    with pytest.raises(TypeError) as err:
        binder.layer_name(gm, attentions[0])
    assert str(err.value) == f"{attentions[0].name}.layer_name: expected a str or vLLM LayerName, got int"


# ---------------------------------------------------------------- refusals


def test_a_configured_kv_transfer_connector_is_refused_naming_the_first_layer(monkeypatch):
    gm, *_ = _graph(("l0", "l1"))
    ctx = SimpleNamespace(no_compile_layers={"l0": _layer(None), "l1": _layer(None)})
    binder = _binder(ctx)
    monkeypatch.setattr(binder_module, "kv_transfer_configured", lambda: False)
    binder.refuse_unsupported(gm, ctx)
    monkeypatch.setattr(binder_module, "kv_transfer_configured", lambda: True)
    with pytest.raises(UnsupportedAttention) as err:
        binder.refuse_unsupported(gm, ctx)
    assert err.value.layer == "l0" and err.value.feature.startswith("a KV-transfer connector (kv_transfer_config")
    assert err.value.feature == ("a KV-transfer connector (kv_transfer_config: its per-layer wait_for_layer_load / "
                                 "save_kv_layer hooks run in Python around vLLM's attention op, which a captured "
                                 "graph replaces)")


def test_each_layer_of_the_graph_is_checked():
    gm, *_ = _graph(("l0", "l1"))
    ctx = SimpleNamespace(no_compile_layers={"l0": _layer(None), "l1": SimpleNamespace(
        attn_backend=FLASH_ATTN, impl=SimpleNamespace(alibi_slopes=torch.ones(1)))})
    with pytest.raises(UnsupportedAttention) as err:
        _binder(ctx).refuse_unsupported(gm, ctx)
    assert (err.value.layer, err.value.feature) == ("l1", "ALiBi (impl.alibi_slopes)")


def test_a_graph_without_vllm_attention_is_not_bound():
    assert _binder(None)(fx.symbolic_trace(lambda x: x + 1)) is None


@pytest.mark.parametrize("metadata, says", [(None, "got None"), ([{}], "got a list (DBO / ubatching: not supported)")])
def test_compiling_without_per_layer_metadata_is_refused(metadata, says):
    gm, *_ = _graph(("l0",))
    ctx = SimpleNamespace(attn_metadata=metadata, no_compile_layers={"l0": _layer(None)})
    with pytest.raises(ValueError) as err:
        _binder(ctx)(gm)
    assert str(err.value) == ("forward_context.attn_metadata: expected a dict of per-layer metadata at compile time "
                              f"(a step with metadata), {says}")


# ---------------------------------------------------------------- one step's read


def test_one_steps_read_is_one_pass_ended_after_it_even_when_a_reader_fails():
    seen = []

    def read(ctx):
        seen.append(context.PASS.current)
        return torch.tensor(ctx)

    readers = [_Reader(None, read), _Reader(None, read)]
    values = _read_all(3, readers)
    assert [t.item() for t in values] == [3, 3]
    assert seen[0] is not None and seen[0] == seen[1] and context.PASS.current is None
    second = []
    _read_all(4, [_Reader(None, lambda c: second.append(context.PASS.current))])
    assert second[0] not in (None, seen[0])  # a new number each read

    def failing(ctx):
        raise KeyError("layer")

    with pytest.raises(KeyError):
        _read_all(5, [_Reader(None, read), _Reader(None, failing)])
    assert context.PASS.current is None


def test_the_host_copies_of_every_group_are_merged():
    hosts = [lambda c: {"seq_lens_0": [c, 1]}, lambda c: {"seq_lens_1": [2]}, lambda c: {}]
    assert _host_all(9, hosts) == {"seq_lens_0": [9, 1], "seq_lens_1": [2]}
    assert _host_all(9, []) == {}


def test_by_default_the_forward_context_is_vllms(monkeypatch):
    import sys
    import types

    ctx = object()
    module = types.ModuleType("vllm.forward_context")
    module.get_forward_context = lambda: ctx
    monkeypatch.setitem(sys.modules, "vllm", sys.modules.get("vllm") or types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.forward_context", module)
    monkeypatch.setattr(sys.modules["vllm"], "forward_context", module, raising=False)
    binder = ForwardContextBinder()
    assert binder.get_forward_context is binder_module._default_forward_context
    assert binder.current_context() is ctx and binder.example_inputs == [] and binder.group_layers == []


def test_metadata_without_any_host_copy_has_no_longest_sequence():
    """Metadata with neither `max_seq_len` nor `seq_lens_list` (FLASH_ATTN's without the host field): no
    host copy, None (the runner then checks the device lengths), never an AttributeError."""
    binder = _binder(SimpleNamespace(attn_metadata={"a": SimpleNamespace(), "b": SimpleNamespace(max_seq_len=9)}))
    binder.group_layers = ["a"]
    assert binder.longest_sequence() is None
    binder.group_layers = ["a", "b"]
    assert binder.longest_sequence() == 9


@pytest.mark.parametrize("keyword", [False, True])
@pytest.mark.parametrize("position, name", [(5, "output_scale"), (6, "output_block_scale")])
def test_fused_output_quantization_is_refused_naming_the_argument(position, name, keyword):
    """vLLM's `unified_attention_with_output(query, key, value, output, layer_name, output_scale,
    output_block_scale)`: a fused quantization scale, by position or keyword, is refused naming the node
    and the argument, before anything of the step is read."""
    gm, _, (node,) = _graph(("l0",))
    with gm.graph.inserting_before(node):
        scale = gm.graph.call_function(torch.ops.aten.ones.default, ([1],))
    if keyword:
        node.kwargs = {name: scale}
    else:
        node.args = (*node.args[:5], *([None] * (position - 5)), scale)
    with pytest.raises(ValueError) as err:
        _binder(None)._rewrite_attention(gm, node, None, None, None, None)
    assert str(err.value) == f"{node.name}.{name}: fused output quantization is not supported by ascend_graph"


# ---------------------------------------------------------------- the rewrite of a traced stand-in model


def _rewritten(backend: str = "FLASH_ATTN", before_binding=lambda model, ctx: None, attention_options=None,
               edit=lambda gm, ctx: None):
    """The stand-in model traced by dynamo at a two-request decode step, then rewritten by the binder in
    that step's forward context (`before_binding(model, ctx)` and `edit(gm, ctx)` run between the two):
    the model, the graph,
    the provider, the step's metadata and config; the binder is `_rewritten.binder`."""
    config = v.VllmConfig()
    model = v.StandInModel(config, backend=backend, seed=3, head_size=8, attention_options=attention_options)
    v.bind_kv_cache(model, 16, 16)
    step = v.Step([9, 20], [1, 1], torch.arange(8, dtype=torch.int32).view(2, 4), 16)
    metadata, slots = v.build_metadata(model, step)
    graphs = []

    def grab(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    ids, positions = torch.tensor([3, 5]), torch.tensor(step.positions())
    with torch.no_grad(), v.set_forward_context(metadata, config, slot_mapping=slots):
        torch.compile(model, backend=grab, dynamic=True)(ids, positions)
        ((gm, example_inputs),) = graphs
        before_binding(model, v.get_forward_context())
        edit(gm, v.get_forward_context())
        _rewritten.binder = ForwardContextBinder(v.get_forward_context, example_inputs)
        provider = _rewritten.binder(gm)
    return model, gm, provider, (metadata, config, slots)


def _calls(gm, op):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def test_each_rewritten_attention_says_what_it_was_adapted_from():
    """The `ascend.attention` node made for each vLLM attention op names that op's node and layer, for the
    npu checks' refusals (`passes/npu_checks.py`) and the dump."""
    model, gm, _, _ = _rewritten()
    attentions = _calls(gm, torch.ops.ascend.attention.default)
    assert len(attentions) == len(model.attention_layers()) == 2
    adapted = [n.meta["ascend_adapted_from"] for n in attentions]
    for text, layer in zip(adapted, model.attention_layers()):
        assert re.fullmatch(rf"vllm\.unified_attention_with_output \(\w+, layer {layer!r}\)", text), text


def test_a_backend_that_does_not_say_writes_the_cache_in_its_forward(monkeypatch):
    """`forward_includes_kv_cache_update` absent (vLLM's backends before it existed): the backend's forward
    writes the cache (vLLM-Ascend's), so the rewrite writes it right before each attention."""
    _, gm, _, _ = _rewritten("ASCEND", lambda model, ctx: monkeypatch.delattr(v.AttentionBackend,
                                                                               "forward_includes_kv_cache_update"))
    writes, attentions = (_calls(gm, op) for op in (torch.ops.ascend.reshape_and_cache.default,
                                                    torch.ops.ascend.attention.default))
    assert len(writes) == len(attentions) == 2
    assert all(a.prev.target is torch.ops.ascend.reshape_and_cache.default for a in attentions)


def test_vllm_033s_page_layout_is_split_by_the_layers_head_size_and_named_in_refusals():
    """vLLM 0.33's `[num_blocks, kv_heads, block_size, 2 * head_size]` page: the key and value caches
    bound are its halves by the layer's head size, each provided input saying where it is read from; a
    layout none of the three is refused naming where the cache was read, at compile and at a step."""
    def pages(model, ctx):
        for layer in model.attention_layers().values():
            layer.kv_cache = torch.zeros(16, layer.num_kv_heads, 16, 2 * layer.head_size)

    model, gm, provider, (metadata, config, slots) = _rewritten(before_binding=pages)
    name, layer = next(iter(model.attention_layers().items()))
    where = f"forward_context.no_compile_layers[{name!r}].kv_cache"
    sources = {p.name: p.source for p in provider.inputs}
    key_input, value_input = (f"vllm_{half}_cache_{name.replace('.', '_')}" for half in ("key", "value"))
    assert sources[key_input] == f"{where} (key)" and sources[value_input] == f"{where} (value)"
    names = [p.name for p in provider.inputs]
    with torch.no_grad(), v.set_forward_context(metadata, config, slot_mapping=slots):
        values = dict(zip(names, provider.read([])))
        assert values[key_input].shape == (16, 16, layer.num_kv_heads, layer.head_size)
        assert values[key_input].data_ptr() == layer.kv_cache.data_ptr()
        assert values[value_input].data_ptr() == layer.kv_cache.data_ptr() + layer.head_size * 4
        layer.kv_cache = torch.zeros(3, 4)
        with pytest.raises(ValueError, match=re.escape(f"{where}: expected a (key, value) pair")):
            provider.read([])

    def unknown(model, ctx):
        for layer in model.attention_layers().values():
            layer.kv_cache = torch.zeros(16, 16, 3)

    with pytest.raises(ValueError, match=re.escape(f"{where}: expected a (key, value) pair")):
        _rewritten(before_binding=unknown)


def _provided(provider, prefix: str) -> list[str]:
    return [p.name for p in provider.inputs if p.name.startswith(prefix)]


def test_layers_sharing_one_metadata_object_are_one_group_and_each_other_object_its_own():
    """vLLM hands every layer of a KV-cache group the same metadata object: one group, its inputs bound
    once; a layer with another object (another group: a sliding-window layer's) has its own inputs, read
    from its own metadata, never the first group's."""
    model, gm, provider, _ = _rewritten()
    layers = list(model.attention_layers())
    assert _rewritten.binder.group_layers == layers[:1] and _provided(provider, "vllm_seq_lens") == ["vllm_seq_lens_0"]

    def two_groups(model, ctx):
        ctx.attn_metadata[layers[1]] = copy.copy(ctx.attn_metadata[layers[1]])

    model, gm, provider, _ = _rewritten(before_binding=two_groups)
    assert _rewritten.binder.group_layers == layers
    assert _provided(provider, "vllm_seq_lens") == ["vllm_seq_lens_0", "vllm_seq_lens_1"]
    second = [a for a in _calls(gm, torch.ops.ascend.attention.default)][1]
    assert second.args[4].name == "vllm_seq_lens_1"


def test_a_slot_mapping_shared_by_layers_is_one_input_and_each_other_tensor_its_own():
    """FLASH_ATTN's `forward_context.slot_mapping[layer]`: one input per distinct tensor."""
    model, _, provider, _ = _rewritten()
    assert _provided(provider, "vllm_slot_mapping") == ["vllm_slot_mapping_0"]
    layers = list(model.attention_layers())

    def own_slots(model, ctx):
        ctx.slot_mapping[layers[1]] = ctx.slot_mapping[layers[1]].clone()

    _, _, provider, _ = _rewritten(before_binding=own_slots)
    assert _provided(provider, "vllm_slot_mapping") == ["vllm_slot_mapping_0", "vllm_slot_mapping_1"]


def test_a_layers_sinks_are_an_input_named_for_the_layer_and_where_they_are_read():
    model, _, provider, _ = _rewritten(attention_options={1: {"sinks": torch.tensor([3.0, 6.0, 4.0, 5.0])}})
    layer = list(model.attention_layers())[1]
    sources = {p.name: p.source for p in provider.inputs if p.name.startswith("vllm_sinks")}
    assert sources == {f"vllm_sinks_{layer.replace('.', '_')}": f"forward_context.no_compile_layers[{layer!r}].impl.sinks"}


@pytest.mark.parametrize("hoisted", [False, True])
def test_mla_layers_are_rewritten_through_the_binder_as_the_dense_reference(hoisted):
    """A graph of vLLM's MLA ops (`tests/test_vllm_mla_rewrite.py`'s, two layers sharing one metadata
    object; their layer names constants or hoisted graph inputs): the binder hands them to `MlaRewrite`
    with the step's context, fake mode, its providers, layer names and slot inputs; the rewritten graph,
    fed what the provider reads, writes each cache and attends as the dense reference does, and the one
    metadata group is the binder's."""
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM's own MLA ops: tests/test_vllm_mla_real.py")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from tests import test_vllm_mla_rewrite as m
    m._define_ops()
    ctx = m._step()
    gm, attentions, updates = m._graph(["l0", "l1"], FakeTensorMode(shape_env=ShapeEnv()))
    names = []
    if hoisted:  # vLLM's LayerName on torch >= 2.11: a graph input, its example input holding the name
        with gm.graph.inserting_before(next(n for n in gm.graph.nodes if n.op != "placeholder")):
            inputs = {layer: gm.graph.placeholder(f"L_{layer}") for layer in ("l0", "l1")}
        for node in updates:
            node.args = (*node.args[:2], inputs[node.args[2]], *node.args[3:])
        for node in attentions:
            node.args = (*node.args[:4], inputs[node.args[4]], *node.args[5:])
        names = ["l0", "l1"]
    binder = ForwardContextBinder(lambda: ctx, [None] * 4 + names)
    provider = binder(gm)
    assert binder.group_layers == ["l0"]
    torch.manual_seed(1)
    q, kv_c, k_pe = torch.randn(5, m.H, m.NOPE + m.ROPE), torch.randn(5, m.L), torch.randn(5, 1, m.ROPE)
    expected = {layer: m._reference(ctx, layer, q, kv_c, k_pe) for layer in ("l0", "l1")}
    outputs = gm(q, kv_c, k_pe, torch.ones(1), *names, *provider.read([]))
    for layer, output in zip(("l0", "l1"), outputs):
        cache, attention = expected[layer]
        torch.testing.assert_close(ctx.no_compile_layers[layer].kv_cache, cache)
        torch.testing.assert_close(output, attention, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "ASCEND"])
def test_the_rewrite_leaves_no_placeholder_result_and_a_host_reader_only_where_there_are_host_copies(backend):
    """The cache-update op's result (vLLM's ordering token for its attention op) is stood in for while
    the attention ops are rewritten, then erased: no allocation is left in the graph. vLLM-Ascend's
    metadata keeps host copies of its lengths (the provider's `host`); FLASH_ATTN's does not (None)."""
    _, gm, provider, _ = _rewritten(backend)
    assert not _calls(gm, torch.ops.aten.empty.memory_format)
    assert (provider.host is None) == (backend == "FLASH_ATTN")


def test_a_graph_of_mla_and_other_attention_layers_binds_each_kinds_groups():
    """A graph with both kinds of layer (the stand-in's two, then one MLA layer of
    `tests/test_vllm_mla_rewrite.py`, its own metadata object): the binder's groups are the other
    layers' group and then MLA's, both rewritten."""
    from tests import test_vllm_mla_rewrite as m
    from ascend_compile.passes.providers import fake_mode_of

    def add_mla_layer(gm, ctx):
        m._define_ops()
        mla_step = m._step()
        for where in ("no_compile_layers", "attn_metadata", "slot_mapping"):
            getattr(ctx, where)["l0"] = getattr(mla_step, where)["l0"]
        graph, fake = gm.graph, fake_mode_of(gm)
        shapes = {"q": (5, m.H, m.NOPE + m.ROPE), "kv_c": (5, m.L), "k_pe": (5, 1, m.ROPE), "k_scale": (1,)}
        with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
            inputs = {name: graph.placeholder(f"mla_{name}") for name in shapes}
        for name, shape in shapes.items():
            with fake:
                inputs[name].meta["example_value"] = torch.empty(shape)
        with graph.inserting_before(graph.find_nodes(op="output")[0]):
            graph.call_function(getattr(torch.ops.vllm, m.mla.MLA_CACHE_UPDATE_OP).default,
                                (inputs["kv_c"], inputs["k_pe"], "l0", "auto", inputs["k_scale"]))
            output = graph.call_function(torch.ops.aten.empty.memory_format, ([5, m.H * m.V],))
            output.meta["example_value"] = fake.from_tensor(torch.empty(5, m.H * m.V))
            graph.call_function(getattr(torch.ops.vllm, m.mla.MLA_ATTENTION_OP).default,
                                (inputs["q"], inputs["kv_c"], inputs["k_pe"], output, "l0"))

    model, gm, _, _ = _rewritten(edit=add_mla_layer)
    assert _rewritten.binder.group_layers == [next(iter(model.attention_layers())), "l0"]
    assert len(_calls(gm, torch.ops.ascend.attention.default)) == 2
    assert len(_calls(gm, torch.ops.ascend.mla_attention.default)) == 1
    assert not [n for n in _calls(gm, torch.ops.aten.empty.memory_format) if not n.users]  # MLA's token erased


def test_a_layer_without_a_head_size_binds_its_key_value_pair():
    """vLLM-Ascend's layers hand a `(key, value)` pair, which needs no head size to split: a layer object
    without `head_size` binds as one with it."""
    def pairs_without_head_size(model, ctx):
        for layer in model.attention_layers().values():
            layer.kv_cache = (torch.zeros(16, 16, layer.num_kv_heads, 8), torch.ones(16, 16, layer.num_kv_heads, 8))
            del layer.head_size

    model, gm, provider, (metadata, config, slots) = _rewritten("ASCEND", before_binding=pairs_without_head_size)
    name, layer = next(iter(model.attention_layers().items()))
    names = [p.name for p in provider.inputs]
    with torch.no_grad(), v.set_forward_context(metadata, config, slot_mapping=slots):
        values = dict(zip(names, provider.read([])))
    assert values[f"vllm_value_cache_{name.replace('.', '_')}"] is layer.kv_cache[1]


def test_a_cache_updates_result_still_read_is_an_empty_tensor_of_the_keys_dtype():
    """vLLM's cache update returns `torch.empty(0)` (the key's dtype) as the attention op's ordering token;
    where the graph reads it past the attention (here: returns it), the rewrite keeps such a tensor there."""
    def return_the_first_update(gm, ctx):
        update = binder_module.vllm_graph_nodes(gm)[1][0]
        output = gm.graph.find_nodes(op="output")[0]
        output.args = ((*output.args[0], update),)
        return_the_first_update.key = update.args[0]

    _, gm, _, _ = _rewritten(edit=return_the_first_update)
    assert binder_module.vllm_graph_nodes(gm) == ([], [])
    token = gm.graph.find_nodes(op="output")[0].args[0][-1]
    assert token.target is torch.ops.aten.new_empty.default and token.args == (return_the_first_update.key, [0])
    assert token.meta["example_value"].shape == (0,)
    assert token.meta["example_value"].dtype == return_the_first_update.key.meta["example_value"].dtype


def test_layer_names_given_by_keyword_are_read():
    """vLLM's ops called with `layer_name=` by keyword (the cache update's third argument, the attention's
    fifth): each rewritten attention names its own layer."""
    def by_keyword(gm, ctx):
        attention, updates = binder_module.vllm_graph_nodes(gm)
        assert len(attention) == len(updates) == 2
        for position, nodes in ((4, attention), (2, updates)):
            for node in nodes:
                node.kwargs = {**node.kwargs, "layer_name": node.args[position]}
                node.args = node.args[:position]

    model, gm, _, _ = _rewritten(edit=by_keyword)
    adapted = [n.meta["ascend_adapted_from"] for n in _calls(gm, torch.ops.ascend.attention.default)]
    assert [text.split("layer ")[1] for text in adapted] == [f"{layer!r})" for layer in model.attention_layers()]
    assert len(_calls(gm, torch.ops.ascend.reshape_and_cache.default)) == 2


def test_the_layer_names_are_the_mla_attention_nodes_not_their_cache_updates():
    """An MLA graph whose attention ops come without their cache updates (the cache written elsewhere):
    its layers are still the graph's, checked and refused as MLA layers."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from tests import test_vllm_mla_rewrite as m
    m._define_ops()
    ctx = m._step()
    gm, _, updates = m._graph(["l0", "l1"], FakeTensorMode(shape_env=ShapeEnv()))
    for node in updates:
        gm.graph.erase_node(node)
    binder = ForwardContextBinder(lambda: ctx, [None] * 4)
    assert binder.layer_names(gm) == ["l0", "l1"]
    binder.refuse_unsupported(gm, ctx)  # MLA layers, checked by MLA's rules: nothing refused
