"""The vLLM stand-in against the pinned vLLM source (`tests/fixtures/vllm_0_23_0.json`), and the
stand-in model run eagerly under a forward context against a plain attention reference."""
import ast
import dataclasses
import inspect
import textwrap

import pytest
import torch

from tests import vllm_standin as v

FIXTURE = v.load_fixture()


def _ast_of(fn) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(fn)))


def _attrs_read(fn, var: str) -> list[str]:
    return sorted({n.attr for n in ast.walk(_ast_of(fn))
                   if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == var})


# ---------------------------------------------------------------- schemas


def test_fixture_names_its_source():
    src = FIXTURE["source"]
    assert src["vllm"]["version"] == v.VLLM_VERSION
    assert src["vllm"]["wheel"]["file"].startswith("vllm-0.23.0-") and len(src["vllm"]["wheel"]["sha256"]) == 64
    assert "vllm/model_executor/layers/attention/attention.py" in src["vllm"]["files"]
    assert src["vllm_ascend"]["version"] == "0.23.0.post1"
    for entry in FIXTURE["ops"].values():
        assert entry["registered_at"].startswith("vllm/model_executor/layers/attention/attention.py:")


def test_standin_ops_have_the_pinned_vllm_schemas():
    assert set(FIXTURE["ops"]) == {"vllm::unified_attention_with_output", "vllm::unified_kv_cache_update"}
    v.check_against_fixture()
    defined = v.defined_schemas()
    assert defined["vllm::unified_kv_cache_update"] == "(Tensor key, Tensor value, str layer_name) -> Tensor"
    # What torch holds for the registered ops is the defined string.
    assert v.registered_schemas() == {k: v.as_registered(s) for k, s in defined.items()}
    op = torch.ops.vllm.unified_attention_with_output.default._schema
    assert [a.name for a in op.arguments if a.alias_info and a.alias_info.is_write] == \
        FIXTURE["ops"]["vllm::unified_attention_with_output"]["mutates_args"]


@pytest.mark.skipif(not v.HAS_OPAQUE_TYPE, reason="torch without opaque types: vLLM uses str layer names")
def test_standin_ops_with_opaque_layer_names():
    v.register("LayerName")
    try:
        v.check_against_fixture()
        assert "vllm.utils.torch_utils.LayerName layer_name" in v.defined_schemas()["vllm::unified_kv_cache_update"]
        assert v.registered_schemas() == {k: v.as_registered(s) for k, s in v.defined_schemas().items()}
    finally:
        v.register("str")
    v.check_against_fixture()


def test_a_changed_schema_fails_naming_the_op_and_both_schemas():
    expected = FIXTURE["ops"]["vllm::unified_attention_with_output"]["schema_str_layer_name"]
    changed = dict(v.defined_schemas())
    changed["vllm::unified_attention_with_output"] = expected.replace(", Tensor? kv_cache_dummy_dep=None", "")
    with pytest.raises(AssertionError) as err:
        v.check_against_fixture(changed, "str")
    msg = str(err.value)
    assert msg.startswith("vllm::unified_attention_with_output: schema differs from vLLM 0.23.0's")
    assert f"expected: vllm::unified_attention_with_output{expected}" in msg
    assert f"actual:   vllm::unified_attention_with_output{changed['vllm::unified_attention_with_output']}" in msg
    assert "unified_kv_cache_update" not in msg
    # A vLLM whose op changed (here: layer_name dropped) fails the stand-in the same way.
    fixture = v.load_fixture()
    entry = fixture["ops"]["vllm::unified_kv_cache_update"]
    entry["schema_str_layer_name"] = "(Tensor key, Tensor value) -> Tensor"
    with pytest.raises(AssertionError, match=r"(?s)vllm::unified_kv_cache_update: schema differs.*"
                                             r"expected: vllm::unified_kv_cache_update\(Tensor key, Tensor value\) -> Tensor"
                                             r".*actual:   vllm::unified_kv_cache_update\(Tensor key, Tensor value, "
                                             r"str layer_name\) -> Tensor"):
        v.check_against_fixture(None, "str", fixture)
    # An op the stand-in does not define.
    with pytest.raises(AssertionError, match=r"actual:   vllm::unified_kv_cache_update \(not registered\)"):
        v.check_against_fixture({k: s for k, s in v.defined_schemas().items() if "kv_cache" not in k}, "str")


# ---------------------------------------------------------------- names


def test_forward_context_has_vllms_names():
    fc = FIXTURE["forward_context"]
    assert [f.name for f in dataclasses.fields(v.ForwardContext)] == fc["fields"]
    for name, params in fc["functions"].items():
        assert list(inspect.signature(getattr(v, name)).parameters) == params, name
    ctx = FIXTURE["op_context"]["get_attention_context"]
    assert _attrs_read(v.get_attention_context, "forward_context") == ctx["forward_context_attrs"]
    assert _attrs_read(v.get_attention_context, "attn_layer") == ctx["layer_attrs"]
    assert list(inspect.signature(v.get_attention_context).parameters) == ctx["params"]
    # no_compile_layers is the config's static_forward_context, as in vLLM.
    cfg = v.VllmConfig()
    with v.set_forward_context({}, cfg):
        assert v.get_forward_context().no_compile_layers is cfg.compilation_config.static_forward_context
    assert not v.is_forward_context_available()


def test_ops_reach_the_layer_as_vllm_does():
    ctx = FIXTURE["op_context"]
    calls = [ast.unparse(n) for n in ast.walk(_ast_of(v.unified_attention_with_output)) if isinstance(n, ast.Call)]
    assert ctx["unified_attention_with_output_calls"] in calls
    calls = [ast.unparse(n) for n in ast.walk(_ast_of(v.unified_kv_cache_update)) if isinstance(n, ast.Call)]
    assert ctx["unified_kv_cache_update_calls"] in calls
    assert ctx["unified_kv_cache_update_returns"] in calls


def test_attention_layer_has_vllms_names_and_calls():
    layer = FIXTURE["attention_layer"]
    params = [p for p, spec in inspect.signature(v.Attention.__init__).parameters.items()
              if p != "self" and spec.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert params == layer["init_params"]
    assert list(inspect.signature(v.Attention.forward).parameters)[1:] == layer["forward_params"]
    attn = v.Attention(4, 8, 0.25, 2, prefix="model.layers.0.self_attn.attn", vllm_config=v.VllmConfig())
    kept = {a for a in vars(attn) if not a.startswith("_") and a != "training"}
    assert kept <= set(layer["init_self_attrs"]), kept - set(layer["init_self_attrs"])
    assert {"layer_name", "num_heads", "head_size", "num_kv_heads", "kv_cache", "impl", "attn_backend"} <= kept
    fa = FIXTURE["backends"]["FLASH_ATTN"]
    assert set(vars(attn.impl)) <= set(fa["impl_init_self_attrs"])
    ascend = v.Attention(4, 8, 0.25, 2, prefix="x", attn_backend=v.AscendAttentionBackend, vllm_config=v.VllmConfig())
    assert set(vars(ascend.impl)) <= set(FIXTURE["vllm_ascend"]["backend"]["impl_init_self_attrs"])
    # forward calls the ops with the arguments vLLM's forward passes (the cache update, then attention).
    ours = [ast.unparse(n) for n in ast.walk(_ast_of(v.Attention.forward))
            if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("torch.ops.vllm.")]
    theirs = [c for c in layer["forward_op_calls"] if "maybe_calc_kv_scales" not in c]
    assert sorted(ours) == sorted(theirs)
    assert layer["forward_allocates_output"]
    assert layer["registers_in"] in inspect.getsource(v.Attention.__init__)


def test_metadata_and_backends_have_vllms_fields():
    backends = FIXTURE["backends"]
    fa = backends["FLASH_ATTN"]
    assert [f.name for f in dataclasses.fields(v.FlashAttentionMetadata)] == fa["metadata_fields"]
    assert v.AttentionBackend.forward_includes_kv_cache_update is backends["default_forward_includes_kv_cache_update"]
    assert v.FlashAttentionBackend.forward_includes_kv_cache_update is fa["forward_includes_kv_cache_update"]
    asc = FIXTURE["vllm_ascend"]
    assert [f.name for f in dataclasses.fields(v.AscendMetadata)] == asc["AscendMetadata"]["fields"]
    inherited = asc["backend"]["forward_includes_kv_cache_update"]
    assert v.AscendAttentionBackend.forward_includes_kv_cache_update is (
        backends["default_forward_includes_kv_cache_update"] if inherited is None else inherited)
    # The metadata the vLLM-Ascend update functions read before replay are AscendMetadata fields.
    assert set(asc["update_graph_params"]["metadata_attrs_read"]) <= set(asc["AscendMetadata"]["fields"])
    dims = dict(num_blocks=7, block_size=16, num_kv_heads=2, head_size=8)
    for backend, shape in ((v.FlashAttentionBackend, fa["kv_cache_shape"]),
                           (v.AscendAttentionBackend, asc["backend"]["kv_cache_shape"])):
        assert backend.get_kv_cache_shape(**dims) == eval(shape, {}, dims)  # noqa: S307 - fixture text, a tuple
    assert asc["platform"]["opaque_attention_op"] is True  # vLLM-Ascend goes through torch.ops.vllm too


# ---------------------------------------------------------------- the stand-in model, eagerly


class Reference:
    """The stand-in model's network with plain attention over each request's dense K/V history."""

    def __init__(self, model: v.StandInModel):
        self.model = model
        self.history: dict = {}

    @torch.no_grad()
    def step(self, requests, step: v.Step, input_ids, positions):
        m = self.model
        t_real = step.num_tokens
        h = m.embed_tokens(input_ids[:t_real]) + m.embed_positions(positions[:t_real])
        for li, layer in enumerate(m.layers):
            attn = layer.attn
            q, k, val = layer.qkv_proj(h).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            q = q.view(t_real, attn.num_heads, attn.head_size)
            k = k.view(t_real, attn.num_kv_heads, attn.head_size)
            val = val.view(t_real, attn.num_kv_heads, attn.head_size)
            out = torch.zeros_like(q)
            group = attn.num_heads // attn.num_kv_heads
            t = 0
            for req, s, ql in zip(requests, step.seq_lens, step.query_lens):
                keys, values = self.history.get((li, req), (k[:0], val[:0]))
                keys, values = torch.cat([keys, k[t:t + ql]]), torch.cat([values, val[t:t + ql]])
                self.history[(li, req)] = (keys, values)
                assert keys.shape[0] == s
                kk, vv = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
                for i in range(ql):
                    pos = s - ql + i
                    scores = torch.einsum("hd,lhd->hl", q[t + i], kk[: pos + 1]) * attn.impl.scale
                    out[t + i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), vv[: pos + 1])
                t += ql
            h = h + layer.o_proj(out.view(t_real, -1))
        return h


def _run(backend, steps, pad_to=None, num_blocks=24, block_size=16, max_blocks=4):
    cfg = v.VllmConfig()
    model = v.StandInModel(cfg, backend=backend)
    v.bind_kv_cache(model, num_blocks, block_size)
    ref = Reference(model)
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    rows: dict = {}
    lengths: dict = {}
    for requests, query_lens in steps:
        for r in requests:
            rows.setdefault(r, blocks[len(rows) * max_blocks:(len(rows) + 1) * max_blocks])
        seq_lens = [lengths.get(r, 0) + q for r, q in zip(requests, query_lens)]
        lengths.update(zip(requests, seq_lens))
        step = v.Step(seq_lens, list(query_lens), torch.stack([rows[r] for r in requests]), block_size)
        attn_metadata, slot_mapping = v.build_metadata(model, step)
        t = pad_to or step.num_tokens
        input_ids = torch.randint(0, 64, (t,), generator=gen)
        positions = torch.tensor(step.positions() + [0] * (t - step.num_tokens))
        with torch.no_grad(), v.set_forward_context(attn_metadata, cfg, slot_mapping=slot_mapping):
            out = model(input_ids, positions)
        expected = ref.step(requests, step, input_ids, positions)
        torch.testing.assert_close(out[: step.num_tokens], expected, atol=2e-5, rtol=2e-5)
    return model


# Requests 0-2 prefill (one in two chunks), then decode, then a mixed batch with a new request.
STEPS = [
    ([0, 1, 2], [5, 3, 7]),
    ([0, 1, 2], [1, 1, 4]),
    ([0, 1, 2], [1, 1, 1]),
    ([2, 0, 3, 1], [1, 1, 9, 1]),
    ([3, 0, 1, 2], [1, 1, 1, 1]),
]


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "ASCEND"])
def test_standin_model_matches_plain_attention(backend):
    model = _run(backend, STEPS)
    layer = next(iter(model.attention_layers().values()))
    if backend == "FLASH_ATTN":
        assert layer.kv_cache.shape == (24, 2, 16, 2, 8) and layer.kv_cache.abs().sum() > 0
    else:
        assert isinstance(layer.kv_cache, tuple) and layer.kv_cache[0].shape == (24, 16, 2, 8)
        assert layer.kv_cache[0].abs().sum() > 0 and layer.impl.key_cache is layer.kv_cache[0]


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "ASCEND"])
def test_standin_model_with_padded_tokens(backend):
    # The runner pads the batch to a capture size: metadata covers the real tokens only.
    _run(backend, STEPS[:3], pad_to=16)


def test_ops_need_the_forward_context():
    cfg = v.VllmConfig()
    model = v.StandInModel(cfg, num_layers=1)
    v.bind_kv_cache(model, 4, 16)
    with pytest.raises(AssertionError, match="Forward context is not set"):
        model(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


def test_profiling_run_without_metadata_zero_fills():
    cfg = v.VllmConfig()
    model = v.StandInModel(cfg, num_layers=1)
    v.bind_kv_cache(model, 4, 16)
    attn = model.layers[0].attn
    q = torch.randn(3, 32)
    with torch.no_grad(), v.set_forward_context({attn.layer_name: None}, cfg):
        out = attn(q, torch.randn(3, 16), torch.randn(3, 16))
    assert out.shape == (3, 32) and not out.any()


# ---------------------------------------------------------------- what dynamo hands a backend


def _trace(layer_name_type):
    """The dynamo graph of a one-layer stand-in model and its example inputs (a recording backend)."""
    v.register(layer_name_type)
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm

    cfg = v.VllmConfig()
    model = v.StandInModel(cfg, num_layers=1)
    v.bind_kv_cache(model, 8, 16)
    step = v.Step([3, 1], [3, 1], torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), 16)
    attn_metadata, slot_mapping = v.build_metadata(model, step)
    ids, pos = torch.tensor([1, 2, 3, 4]), torch.tensor(step.positions())
    torch._dynamo.reset()
    try:
        with torch.no_grad(), v.set_forward_context(attn_metadata, cfg, slot_mapping=slot_mapping):
            expected = model(ids, pos)
            got = torch.compile(model, backend=backend, fullgraph=True)(ids, pos)
    finally:
        torch._dynamo.reset()
        v.register("str")
    torch.testing.assert_close(got, expected)
    return seen[0]


def _op_nodes(gm, name):
    # By name: the LayerName case re-registers the ops after tracing, so the op objects are new ones.
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target) in (f"vllm.{name}", f"vllm.{name}.default")]


def test_dynamo_graph_has_no_cache_or_metadata_tensors():
    gm, example_inputs = _trace("str")
    (update,) = _op_nodes(gm, "unified_kv_cache_update")
    (attn,) = _op_nodes(gm, "unified_attention_with_output")
    assert update.args[2] == attn.args[4] == "model.layers.0.self_attn.attn"  # a constant in the graph
    assert attn.kwargs["kv_cache_dummy_dep"] is update
    # Inputs: parameters, input_ids and positions only; the caches and metadata live in the forward context.
    assert all(isinstance(x, torch.Tensor) for x in example_inputs)
    assert {tuple(x.shape) for x in example_inputs if not isinstance(x, torch.nn.Parameter)} == {(4,)}


@pytest.mark.skipif(not v.HAS_OPAQUE_TYPE, reason="torch without opaque types: vLLM uses str layer names")
def test_dynamo_hoists_opaque_layer_names_to_graph_inputs():
    gm, example_inputs = _trace("LayerName")
    (attn,) = _op_nodes(gm, "unified_attention_with_output")
    name_arg = attn.args[4]
    assert name_arg.op == "placeholder"  # not a constant: one graph serves every layer
    names = [x for x in example_inputs if isinstance(x, v.LayerName)]
    assert names == [v.LayerName("model.layers.0.self_attn.attn")]
