"""`integrations/vllm/dynamo_backend.py` outside a compile: the backend's arguments, a graph without vLLM's
attention ops compiled as any graph, the model's own tensors marked static as `mark_static` marks them,
`configured_backend` built from vLLM's config with the KV-cache budget installed, and `vllm_backend` made
at lookup from the config current then. vLLM graphs through the backend: `tests/test_vllm.py`."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import fx

from ascend_compile.config import CompileConfig
from ascend_compile.integrations.vllm import dynamo_backend
from ascend_compile.lowering.runner import CompiledArtifact


class Artifact(CompiledArtifact):
    def __init__(self) -> None:  # noqa: D107 - no state of the real artifact is read
        pass


def test_a_dispatch_other_than_direct_or_dynamo_is_refused():
    with pytest.raises(ValueError) as err:
        dynamo_backend.backend(CompileConfig(), get_forward_context=lambda: None, dispatch="fast")
    assert str(err.value) == "dispatch: expected one of ['dynamo', 'direct'], got 'fast'"


def test_options_make_the_config(monkeypatch):
    made = []
    original = CompileConfig.from_options
    monkeypatch.setattr(CompileConfig, "from_options", lambda options: made.append(options) or original(options))
    dynamo_backend.backend(get_forward_context=lambda: None, max_model_len=64)
    assert made == [{"max_model_len": 64}]


def test_a_config_and_options_together_are_refused():
    with pytest.raises(ValueError, match="backend: pass either a CompileConfig or options, not both"):
        dynamo_backend.backend(CompileConfig(), get_forward_context=lambda: None, max_model_len=64)


def test_vllms_own_forward_context_checks_the_installed_release(monkeypatch):
    checked = []
    monkeypatch.setattr(dynamo_backend, "check_version", lambda: checked.append(True))
    dynamo_backend.backend(CompileConfig(), get_forward_context=lambda: None)
    assert checked == []
    dynamo_backend.backend(CompileConfig())
    assert checked == [True]


@pytest.mark.parametrize("compiled_type", [Artifact, object])
def test_a_graph_without_vllm_attention_compiles_as_any_graph(monkeypatch, compiled_type):
    compiled, calls, reported = compiled_type(), [], []
    monkeypatch.setattr(dynamo_backend, "compile_graph", lambda *args: calls.append(args) or compiled)
    given = CompileConfig(max_model_len=96, retrace_static=True)
    compile_fn = dynamo_backend.backend(given, get_forward_context=lambda: None, on_compiled=reported.append,
                                        target="target")
    gm = fx.symbolic_trace(lambda x: x + 1)
    assert compile_fn(gm, [torch.ones(1)]) is compiled
    (got_gm, examples, config, target), = calls
    assert got_gm is gm and target == "target" and config is given  # as given: retraced static as any graph
    assert reported == ([compiled] if compiled_type is Artifact else [])


def _marked_graph(marked: list[bool]) -> fx.GraphModule:
    graph = fx.Graph()
    for i, static in enumerate(marked):
        node = graph.placeholder(f"x{i}")
        node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"} if static else {}
    graph.output(None)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_the_models_own_tensors_and_the_tensors_they_view_are_marked_static():
    base = torch.zeros(4, 1, 3, 5)
    stacked = base[:, 0]  # a view, as the embedding's LoRA stacks are of theirs
    parameter, caller = torch.zeros(2, 3), torch.zeros(7)
    parameter._dynamo_static_indices = {9}
    dynamo_backend.model_state_static(_marked_graph([True, True, False, True]), [stacked, parameter, caller, 3])
    assert stacked._dynamo_static_indices == {0, 1, 2} and base._dynamo_static_indices == {0, 1, 2, 3}
    assert stacked._has_dynamo_dim_marking and base._has_dynamo_dim_marking
    assert parameter._dynamo_static_indices == {0, 1, 9}
    assert not hasattr(caller, "_dynamo_static_indices")  # the caller's own tensors stay symbolic
    assert not hasattr(caller, "_has_dynamo_dim_marking")


def test_a_placeholder_without_tensor_metadata_is_left_alone():
    graph = fx.Graph()
    graph.placeholder("x")
    graph.output(None)
    value = torch.zeros(2)
    dynamo_backend.model_state_static(fx.GraphModule(torch.nn.Module(), graph), [value])
    assert not hasattr(value, "_dynamo_static_indices")


def test_the_configured_backend_takes_vllms_options_and_reserves_the_graphs_memory(monkeypatch):
    asked, installed = [], []
    monkeypatch.setattr(dynamo_backend, "options_for",
                        lambda config, tag: asked.append((config, tag)) or {"get_forward_context": lambda: None,
                                                                           "max_model_len": 80})
    monkeypatch.setattr(dynamo_backend.kv_budget, "install", installed.append)
    made = []
    original = dynamo_backend.backend
    monkeypatch.setattr(dynamo_backend, "backend", lambda **options: made.append(options) or original(**options))
    compile_fn = dynamo_backend.configured_backend("vllm config", "drafter")
    assert callable(compile_fn)
    assert asked == [("vllm config", "drafter")] and installed == ["vllm config"]
    assert made[0]["max_model_len"] == 80
    dynamo_backend.configured_backend("other config")
    assert asked[1] == ("other config", None)


def test_vllm_backend_is_made_at_lookup_from_the_current_config(monkeypatch):
    monkeypatch.setattr(dynamo_backend, "current_vllm_config", lambda: "current")
    monkeypatch.setattr(dynamo_backend, "configured_backend", lambda config: ("backend for", config))
    assert dynamo_backend.vllm_backend == ("backend for", "current")
    with pytest.raises(AttributeError) as err:
        dynamo_backend.other_backend  # noqa: B018
    assert str(err.value) == ("module 'ascend_compile.integrations.vllm.dynamo_backend' has no attribute "
                              "'other_backend'")


def test_a_static_placeholder_after_a_callers_tensor_is_marked_too():
    """The caller's own tensors (vLLM's input ids first) may come before the model's: every static
    placeholder is marked, wherever it stands."""
    caller, weight = torch.zeros(7), torch.zeros(2, 3)
    dynamo_backend.model_state_static(_marked_graph([False, True]), [caller, weight])
    assert weight._dynamo_static_indices == {0, 1} and not hasattr(caller, "_dynamo_static_indices")


def test_the_refusal_of_a_config_with_options_is_exactly_this():
    with pytest.raises(ValueError) as err:
        dynamo_backend.backend(CompileConfig(), get_forward_context=lambda: None, max_model_len=64)
    assert str(err.value) == "backend: pass either a CompileConfig or options, not both"


class _Recorded:
    def __init__(self) -> None:
        self.asked = 0

    @property
    def shape_guards(self) -> str:
        self.asked += 1
        return "guards"


@pytest.fixture()
def vllm_path(monkeypatch):
    """The backend's vLLM branch with its collaborators recorded: which graphs take it (`attention`,
    `mla`: what `vllm_graph_nodes` and `mla_graph_nodes` find), what it refuses and what it hands on."""
    seen = {"refused": [], "calls": [], "deferred": [], "attention": [], "mla": ([], [])}
    recorded = _Recorded()

    class Binder:
        context = None

        def __init__(self, get_forward_context, example_inputs):
            seen["calls"].append(("binder", get_forward_context, example_inputs))

        def current_context(self):
            return Binder.context

        def refuse_unsupported(self, gm, ctx):
            seen["refused"].append((gm, ctx))

    monkeypatch.setattr(dynamo_backend, "ForwardContextBinder", Binder)
    monkeypatch.setattr(dynamo_backend, "vllm_graph_nodes", lambda gm: (seen["attention"], []))
    monkeypatch.setattr(dynamo_backend, "mla_graph_nodes", lambda gm: seen["mla"])
    monkeypatch.setattr(dynamo_backend, "compile_graph", lambda *args: seen["calls"].append(("compile_graph",)))
    monkeypatch.setattr(dynamo_backend, "model_state_static", lambda gm, ex: seen["calls"].append(("static",)))
    monkeypatch.setattr(dynamo_backend, "retrace_general",
                        lambda gm, settings: seen["calls"].append(("retrace", settings)))
    monkeypatch.setattr(dynamo_backend.graph_inputs, "record", lambda gm: recorded)
    monkeypatch.setattr(dynamo_backend, "DeferredCompile",
                        lambda *args, **kwargs: seen["deferred"].append((args, kwargs)) or "deferred")
    seen["binder"], seen["recorded"] = Binder, recorded
    return seen


def test_a_vllm_graph_is_deferred_with_its_binder_and_never_retraced_static(vllm_path):
    seen = vllm_path
    seen["attention"].append("attention node")
    given = CompileConfig(max_model_len=96, retrace_static=True)
    get = object()
    gm, examples = fx.symbolic_trace(lambda x: x + 1), [torch.ones(1)]
    assert dynamo_backend.backend(given, get_forward_context=get, target="target")(gm, examples) == "deferred"
    assert [c[0] for c in seen["calls"]] == ["binder", "static", "retrace"]
    assert seen["calls"][0][1:] == (get, examples) and seen["calls"][2][1] is dynamo_backend.SHARED_TOKEN_SETTINGS
    (args, kwargs), = seen["deferred"]
    assert args[0] is gm and args[1] is examples and args[4] == "target" and args[6] is seen["recorded"]
    assert args[2] == dataclasses.replace(given, retrace_static=False)  # retraced at dynamo's call, if at all
    assert kwargs == {"direct": True} and seen["recorded"].asked == 1  # guards made under dynamo's settings
    assert seen["refused"] == []  # no forward context yet: nothing to refuse by


def test_an_mla_graph_takes_the_vllm_path_too(vllm_path):
    """MLA attention alone (no MLA cache update: a model whose cache is written elsewhere) is vLLM's too."""
    vllm_path["mla"] = (["mla attention"], [])
    dynamo_backend.backend(CompileConfig(), get_forward_context=lambda: None)(fx.symbolic_trace(lambda x: x), [])
    assert len(vllm_path["deferred"]) == 1 and ("compile_graph",) not in vllm_path["calls"]


def test_with_a_forward_context_the_graphs_layers_are_refused_now(vllm_path):
    vllm_path["attention"].append("attention node")
    vllm_path["binder"].context = ctx = object()
    gm = fx.symbolic_trace(lambda x: x)
    dynamo_backend.backend(CompileConfig(), get_forward_context=lambda: ctx)(gm, [])
    assert vllm_path["refused"] == [(gm, ctx)]


def test_dynamo_dispatch_makes_no_shape_guards_and_no_direct_path(vllm_path):
    vllm_path["attention"].append("attention node")
    dynamo_backend.backend(CompileConfig(), get_forward_context=lambda: None, dispatch="dynamo")(
        fx.symbolic_trace(lambda x: x), [])
    (_, kwargs), = vllm_path["deferred"]
    assert kwargs == {"direct": False} and vllm_path["recorded"].asked == 0
