"""`integrations/vllm/mla.py`'s `MlaRewrite` on a graph calling vLLM's two MLA ops (defined here with vLLM
0.23's schemas where no vLLM is installed): each cache update becomes `ascend.mla_cache_write` on the
layer's latent and rope halves, each attention the absorbed `ascend.mla_attention` between `W_UK_T` and
`W_UV`, every value read from the forward context as a provided input (one set of metadata inputs per
metadata object, one pair of cache inputs per layer); the rewritten graph, run with what the readers read,
writes the cache and returns the attention a dense reference computes (decodes, and a prefill with cached
context). vLLM's own DeepSeek-V2: `tests/test_vllm_mla_real.py`."""
from __future__ import annotations

from types import SimpleNamespace

import importlib.util

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import ascend_compile  # noqa: F401 - the ascend ops
from ascend_compile.integrations.vllm import mla
from ascend_compile.passes.providers import ProvidedInput, add_provided_input

if importlib.util.find_spec("vllm") is not None:  # its ops are vLLM's own there: tests/test_vllm_mla_real.py
    pytest.skip("vLLM installed: its MLA ops are not redefined here", allow_module_level=True)

H, NOPE, ROPE, L, V = 2, 4, 2, 8, 3  # heads, q/k no-rope and rope dims, kv_lora_rank, v_head_dim
BLOCKS, BLOCK_SIZE = 8, 4
TRITON_MLA = type("TritonMLABackend", (), {"__module__": "vllm.v1.attention.backends.mla.triton_mla",
                                            "__qualname__": "TritonMLABackend"})
_LIB: list[torch.library.Library] = []


def _define_ops() -> None:
    """vLLM's MLA ops (schemas of vLLM 0.23's `mla_attention.py`), no body: the graph is rewritten, never run
    with them."""
    if hasattr(torch.ops.vllm, mla.MLA_ATTENTION_OP) or _LIB:
        return
    lib = torch.library.Library("vllm", "FRAGMENT")
    lib.define(f"{mla.MLA_CACHE_UPDATE_OP}(Tensor kv_c_normed, Tensor k_pe, str layer_name, str kv_cache_dtype, "
               "Tensor k_scale) -> Tensor")
    lib.define(f"{mla.MLA_ATTENTION_OP}(Tensor q, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) output, str layer_name, "
               "Tensor? output_scale=None, Tensor(b!)? output_block_scale=None) -> ()")
    _LIB.append(lib)


def _step() -> SimpleNamespace:
    """Two decodes (KV lengths 5 and 9) then a prefill of 3 tokens after 4 cached (vLLM 0.33's context_lens)."""
    torch.manual_seed(0)
    decode = SimpleNamespace(seq_lens=torch.tensor([5, 9, 0], dtype=torch.int32),
                             block_table=torch.tensor([[0, 1, 5], [2, 3, 5], [5, 5, 5]], dtype=torch.int32))
    prefill = SimpleNamespace(query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                              chunked_context=SimpleNamespace(context_lens=torch.tensor([4], dtype=torch.int32)),
                              block_table=torch.tensor([[4, 6, 7]], dtype=torch.int32))
    metadata = SimpleNamespace(num_reqs=3, num_decodes=2, num_prefills=1, decode=decode, prefill=prefill,
                               query_start_loc=torch.tensor([0, 1, 2, 5, 5], dtype=torch.int32))
    # positions written: request 0's 4 (block 1, offset 0), request 1's 8 (block 5, offset 0), the prefill's
    # 4, 5, 6 (block 6, offsets 0 to 2)
    slots = torch.tensor([1 * 4 + 0, 5 * 4 + 0, 6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2], dtype=torch.int64)
    layers = {}
    for name in ("l0", "l1"):
        layers[name] = SimpleNamespace(
            attn_backend=TRITON_MLA, kv_cache=torch.randn(BLOCKS, BLOCK_SIZE, L + ROPE), kv_lora_rank=L,
            qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, impl=SimpleNamespace(scale=0.7),
            W_UK_T=torch.randn(H, NOPE, L), W_UV=torch.randn(H, L, V))
    return SimpleNamespace(attn_metadata={"l0": metadata, "l1": metadata}, no_compile_layers=layers,
                           slot_mapping={"l0": slots, "l1": slots})


def _reference(ctx, layer: str, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's cache after the step's write, the attention output [T, H * V]), computed densely."""
    attn = ctx.no_compile_layers[layer]
    cache = attn.kv_cache.clone()
    flat = cache.view(-1, L + ROPE)
    flat[ctx.slot_mapping[layer]] = torch.cat([kv_c, k_pe[:, 0]], dim=-1)
    rows = [([0, 1], 5, [0]), ([2, 3, 5], 9, [1]), ([4, 6], 7, [2, 3, 4])]  # (blocks, KV length, its tokens)
    out = torch.zeros(q.shape[0], H, V)
    for blocks, length, tokens in rows:
        keys = torch.cat([cache[b] for b in blocks])[:length]  # [length, L + R]
        for j, t in enumerate(tokens):
            visible = keys[: length - len(tokens) + j + 1]
            q_latent = torch.einsum("hn,hnl->hl", q[t, :, :NOPE], attn.W_UK_T)
            scores = attn.impl.scale * (q_latent @ visible[:, :L].T + q[t, :, NOPE:] @ visible[:, L:].T)
            out[t] = torch.einsum("hl,hlv->hv", scores.softmax(-1) @ visible[:, :L], attn.W_UV)
    return cache, out.flatten(1)


def _graph(layers: list[str], fake: FakeTensorMode, tokens: int = 5) -> tuple[fx.GraphModule, list, list]:
    graph = fx.Graph()
    shapes = {"q": (tokens, H, NOPE + ROPE), "kv_c": (tokens, L), "k_pe": (tokens, 1, ROPE), "k_scale": (1,)}
    inputs = {}
    for name, shape in shapes.items():
        inputs[name] = graph.placeholder(name)
        with fake:
            inputs[name].meta["example_value"] = torch.empty(shape)
    outputs, updates, attentions = [], [], []
    for layer in layers:
        updates.append(graph.call_function(getattr(torch.ops.vllm, mla.MLA_CACHE_UPDATE_OP).default,
                                           (inputs["kv_c"], inputs["k_pe"], layer, "auto", inputs["k_scale"])))
        output = graph.call_function(torch.ops.aten.empty.memory_format, ([tokens, H * V],))
        attentions.append(graph.call_function(getattr(torch.ops.vllm, mla.MLA_ATTENTION_OP).default,
                                              (inputs["q"], inputs["kv_c"], inputs["k_pe"], output, layer)))
        outputs.append(output)
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph), attentions, updates


def _rewrite(ctx, layers: list[str]):
    _define_ops()
    fake = FakeTensorMode(shape_env=ShapeEnv())
    gm, attentions, updates = _graph(layers, fake)
    provided, slot_layers = [], []

    def provide(name, source, read, fake_value):
        provided.append((name, source, read))
        return add_provided_input(gm, ProvidedInput(name, source), fake_value)

    slots = {}

    def slot_mapping(layer, tokens):  # one input per layer, as the binder's one per slot tensor
        slot_layers.append((layer, tokens))
        if layer not in slots:
            slots[layer] = provide(f"slots_{layer.replace('.', '_')}", "slot_mapping", lambda c: c.slot_mapping[layer],
                                   torch.empty(tokens, dtype=torch.int64))
        return slots[layer]

    rewrite = mla.MlaRewrite(gm, ctx, fake, provide, lambda node: node.args[4 if node in attentions else 2],
                             slot_mapping)
    assert mla.mla_graph_nodes(gm) == (attentions, updates)
    groups = rewrite.rewrite(attentions, updates)
    gm.graph.lint()
    gm.recompile()
    return gm, provided, groups, slot_layers


def test_the_rewritten_graph_writes_the_cache_and_attends_as_the_dense_reference():
    ctx = _step()
    gm, provided, groups, slot_layers = _rewrite(ctx, ["l0", "l1"])
    q, kv_c, k_pe = torch.randn(5, H, NOPE + ROPE), torch.randn(5, L), torch.randn(5, 1, ROPE)
    expected = {layer: _reference(ctx, layer, q, kv_c, k_pe) for layer in ("l0", "l1")}
    outputs = gm(q, kv_c, k_pe, torch.ones(1), *[read(ctx) for _, _, read in provided])
    for layer, output in zip(("l0", "l1"), outputs):
        cache, attention = expected[layer]
        torch.testing.assert_close(ctx.no_compile_layers[layer].kv_cache, cache)
        torch.testing.assert_close(output, attention, atol=1e-5, rtol=1e-5)
    assert groups == ["l0"]  # both layers share one metadata object: one group
    assert slot_layers == [("l0", 5), ("l1", 5)]
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.ascend.mla_cache_write.default) == 2
    assert ops.count(torch.ops.ascend.mla_attention.default) == 2
    assert not any(str(t).startswith("vllm.") for t in ops)
    latent = [n for n in gm.graph.nodes if n.target is torch.ops.ascend.mla_attention.default]
    assert latent[1].meta["ascend_adapted_from"] == (
        f"vllm.{mla.MLA_ATTENTION_OP} ({latent[1].meta['ascend_adapted_from'].split('(')[1].split(',')[0]}, layer 'l1')")


def test_every_value_is_a_provided_input_read_from_the_forward_context_once():
    ctx = _step()
    gm, provided, groups, slot_layers = _rewrite(ctx, ["l0", "l1"])
    where = "forward_context.attn_metadata['l0']"
    layer = "forward_context.no_compile_layers['{}']"
    assert [(name, source) for name, source, _ in provided] == [
        ("vllm_kv_c_cache_l0", f"{layer.format('l0')}.kv_cache[..., :8] (latent)"),
        ("vllm_k_pe_cache_l0", f"{layer.format('l0')}.kv_cache[..., 8:] (rope key)"),
        ("slots_l0", "slot_mapping"),
        ("vllm_kv_c_cache_l1", f"{layer.format('l1')}.kv_cache[..., :8] (latent)"),
        ("vllm_k_pe_cache_l1", f"{layer.format('l1')}.kv_cache[..., 8:] (rope key)"),
        ("slots_l1", "slot_mapping"),
        ("vllm_mla_seq_lens_0", f"{where}: decode.seq_lens, then each prefill's query and context lengths"),
        ("vllm_mla_query_start_loc_0", f"{where}.query_start_loc[:num_reqs + 1]"),
        ("vllm_mla_block_table_0", f"{where}: decode.block_table, then prefill.block_table"),
        ("vllm_w_uk_t_l0", f"{layer.format('l0')}.W_UK_T"),
        ("vllm_w_uv_l0", f"{layer.format('l0')}.W_UV"),
        ("vllm_w_uk_t_l1", f"{layer.format('l1')}.W_UK_T"),
        ("vllm_w_uv_l1", f"{layer.format('l1')}.W_UV"),
    ]
    reads = {name: read(ctx) for name, _, read in provided}
    attn = ctx.no_compile_layers["l1"]
    assert reads["vllm_kv_c_cache_l1"].data_ptr() == attn.kv_cache.data_ptr()  # views of the layer's own cache
    assert torch.equal(reads["vllm_k_pe_cache_l1"], attn.kv_cache[..., L:])
    assert reads["vllm_w_uk_t_l1"] is attn.W_UK_T and reads["vllm_w_uv_l1"] is attn.W_UV
    assert reads["vllm_mla_seq_lens_0"].tolist() == [5, 9, 7]
    assert reads["vllm_mla_query_start_loc_0"].tolist() == [0, 1, 2, 5]
    assert reads["vllm_mla_block_table_0"].tolist() == [[0, 1, 5], [2, 3, 5], [4, 6, 7]]
    # the next step's values: read from the context then, not kept from this one
    attn.kv_cache = torch.zeros(BLOCKS, BLOCK_SIZE, L + ROPE)
    ctx.attn_metadata["l0"].decode.seq_lens[0] = 6
    assert provided[3][2](ctx).data_ptr() == attn.kv_cache.data_ptr()
    assert provided[6][2](ctx).tolist() == [6, 9, 7]


def test_the_inputs_example_values_have_the_steps_sizes_symbolic_in_its_requests():
    ctx = _step()
    gm, provided, *_ = _rewrite(ctx, ["l0"])
    values = {n.name: n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder")}
    seqs = values["vllm_mla_seq_lens_0"].shape[0]
    assert isinstance(seqs, torch.SymInt) and seqs.node.hint == 3
    assert values["vllm_mla_query_start_loc_0"].shape[0] == seqs + 1
    table = values["vllm_mla_block_table_0"].shape
    assert isinstance(table[0], torch.SymInt) and str(table[0].node.expr) == str(seqs.node.expr) and table[1] == 3
    assert values["vllm_mla_seq_lens_0"].dtype == torch.int32
    assert tuple(values["vllm_kv_c_cache_l0"].shape) == (BLOCKS, BLOCK_SIZE, L)
    assert values["vllm_kv_c_cache_l0"].stride() == (BLOCK_SIZE * (L + ROPE), L + ROPE, 1)  # the view's strides
    assert tuple(values["vllm_w_uv_l0"].shape) == (H, L, V)
    assert tuple(values["vllm_k_pe_cache_l0"].shape) == (BLOCKS, BLOCK_SIZE, ROPE)
    assert tuple(values["vllm_w_uk_t_l0"].shape) == (H, NOPE, L)


def test_an_mla_group_per_metadata_object():
    ctx = _step()
    first = ctx.attn_metadata["l0"]
    ctx.attn_metadata["l1"] = SimpleNamespace(**vars(first))  # another object, equal fields
    gm, provided, groups, _ = _rewrite(ctx, ["l0", "l1"])
    assert groups == ["l0", "l1"]
    names = [name for name, _, _ in provided]
    assert "vllm_mla_seq_lens_1" in names and names.count("vllm_mla_seq_lens_0") == 1
    values = {n.name: n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder")}
    first, second = (values[f"vllm_mla_seq_lens_{i}"].shape[0] for i in (0, 1))
    assert str(first.node.expr) != str(second.node.expr)  # each group its own request count
    assert dict((n, s) for n, s, _ in provided)["vllm_mla_block_table_1"] == (
        "forward_context.attn_metadata['l1']: decode.block_table, then prefill.block_table")


def test_metadata_the_rewrite_cannot_read_is_refused_at_the_rewrite():
    ctx = _step()
    ctx.attn_metadata["l0"].causal = False
    with pytest.raises(mla.UnsupportedAttention) as err:
        _rewrite(ctx, ["l0"])
    assert (err.value.layer, err.value.feature) == ("l0", "non-causal attention (attn_metadata.causal=False)")


def test_a_quantized_latent_cache_is_refused_at_the_rewrite():
    ctx = _step()
    ctx.no_compile_layers["l0"].kv_cache = torch.zeros(BLOCKS, BLOCK_SIZE, L + ROPE, dtype=torch.uint8)
    with pytest.raises(mla.UnsupportedAttention) as err:
        _rewrite(ctx, ["l0"])
    assert err.value.layer == "l0" and err.value.feature == "quantized KV cache (cache dtype torch.uint8)"


@pytest.mark.parametrize("keyword", [False, True])
@pytest.mark.parametrize("position, name", [(5, "output_scale"), (6, "output_block_scale")])
def test_fused_output_quantization_is_refused(position, name, keyword):
    _define_ops()
    ctx = _step()
    fake = FakeTensorMode(shape_env=ShapeEnv())
    gm, attentions, updates = _graph(["l0"], fake)
    node = attentions[0]
    with gm.graph.inserting_before(node):
        scale = gm.graph.call_function(torch.ops.aten.ones.default, ([1],))
    if keyword:
        node.kwargs = {name: scale}
    else:
        node.args = (*node.args[:5], *([None] * (position - 5)), scale)
    rewrite = mla.MlaRewrite(gm, ctx, fake, None, lambda n: "l0", None)
    with pytest.raises(ValueError) as err:
        rewrite._rewrite_attention(node)
    assert str(err.value) == f"{node.name}.{name}: fused output quantization is not supported by ascend_graph"


def test_the_cache_updates_result_stays_an_empty_tensor_of_the_latents_dtype():
    """vLLM's update op returns `torch.empty(0)` as a dependency the graph may thread on: its users get the same."""
    _define_ops()
    ctx = _step()
    for layer in ctx.no_compile_layers.values():
        layer.kv_cache = layer.kv_cache.to(torch.bfloat16)
    fake = FakeTensorMode(shape_env=ShapeEnv())
    graph = fx.Graph()
    kv_c, k_pe, k_scale = (graph.placeholder(n) for n in ("kv_c", "k_pe", "k_scale"))
    with fake:
        kv_c.meta["example_value"] = torch.empty(5, L, dtype=torch.bfloat16)
        k_pe.meta["example_value"] = torch.empty(5, 1, ROPE, dtype=torch.bfloat16)
    update = graph.call_function(getattr(torch.ops.vllm, mla.MLA_CACHE_UPDATE_OP).default,
                                 (kv_c, k_pe, "l0", "auto", k_scale))
    graph.output((update,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    provided = []

    def provide(name, source, read, fake_value):
        provided.append(read)
        return add_provided_input(gm, ProvidedInput(name, source), fake_value)

    slots = lambda layer, tokens: provide("slots", "slot_mapping", lambda c: c.slot_mapping[layer],  # noqa: E731
                                          torch.empty(tokens, dtype=torch.int64))
    assert mla.MlaRewrite(gm, ctx, fake, provide, lambda node: "l0", slots).rewrite([], [update]) == []
    gm.recompile()
    values = torch.randn(5, L, dtype=torch.bfloat16), torch.randn(5, 1, ROPE, dtype=torch.bfloat16)
    expected = ctx.no_compile_layers["l0"].kv_cache.clone()
    expected.view(-1, L + ROPE)[ctx.slot_mapping["l0"]] = torch.cat([values[0], values[1][:, 0]], dim=-1)
    (result,) = gm(*values, torch.ones(1), *[read(ctx) for read in provided])
    assert result.shape == (0,) and result.dtype == torch.bfloat16
    assert torch.equal(ctx.no_compile_layers["l0"].kv_cache, expected)


def test_a_dotted_layer_names_inputs_are_named_without_dots_and_bad_caches_are_refused_naming_where():
    ctx = _step()
    name = "model.layers.0.self_attn.attn"
    for field in ("attn_metadata", "no_compile_layers", "slot_mapping"):
        getattr(ctx, field)[name] = getattr(ctx, field).pop("l0")
    gm, provided, *_ = _rewrite(ctx, [name])
    names = [n for n, _, _ in provided]
    assert "vllm_kv_c_cache_model_layers_0_self_attn_attn" in names and "vllm_w_uv_model_layers_0_self_attn_attn" in names
    reader = dict((n, r) for n, _, r in provided)["vllm_kv_c_cache_model_layers_0_self_attn_attn"]
    ctx.no_compile_layers[name].kv_cache = torch.zeros(BLOCKS, L + ROPE)  # a later step's cache of another layout
    where = f"forward_context.no_compile_layers[{name!r}].kv_cache"
    with pytest.raises(ValueError) as err:
        reader(ctx)
    assert str(err.value).startswith(f"{where}: expected a [num_blocks, block_size, kv_lora_rank + rope] tensor")
    with pytest.raises(ValueError) as err:
        _rewrite(ctx, [name])
    assert str(err.value).startswith(f"{where}: expected")
