"""The fast path's two parts that do not need vLLM: the guard policy (`integrations/vllm/fast_path.py`:
which of dynamo's guards may be stood in for on vLLM's frame) and, in the direct dispatcher, what vLLM's
models bring (parameters of a `Parameter` subclass whose `__torch_function__` dynamo inlines, so that
dynamo runs the graph with subclass dispatch off). On vLLM's own model: `tests/test_vllm_real.py`."""
from __future__ import annotations

import inspect

import pytest
import torch

import ascend_compile
from ascend_compile import CompileConfig, backend
from ascend_compile.integrations.vllm import fast_path
from ascend_compile.lowering import served
from examples.llama import LlamaConfig, PagedBatch, build


class Guard:
    def __init__(self, kind: str, code: str = "") -> None:
        self.kind, self.code = kind, code

    def verbose_code_parts(self) -> list[str]:
        return [self.code]


def guard_of(kind: str, code: str = "") -> Guard:
    return type(kind, (Guard,), {})(kind, code)


class Manager:
    """dynamo's guard-manager tree, as `fast_path.guards_of` walks it."""

    def __init__(self, source: str, guards=(), children=()) -> None:
        self.source, self.guards, self.children = source, list(guards), list(children)

    def get_source(self) -> str:
        return self.source

    def get_leaf_guards(self) -> list:
        return self.guards

    def get_child_managers(self) -> list:
        return self.children


def frame_guards(*extra: Manager) -> Manager:
    """The kinds dynamo keeps on vLLM's Llama frame (0.23 and 0.33), and `extra`."""
    return Manager("", [guard_of("GLOBAL_STATE"), guard_of("LAMBDA_GUARD", "L['positions'].size()[0] == L['input_ids'].size()[0]"),
                        guard_of("LAMBDA_GUARD", "G['a'].F is G['b'].torch.nn.functional")], [
        Manager("L['input_ids']", [guard_of("TENSOR_MATCH"), guard_of("NO_TENSOR_ALIASING")]),
        Manager("L['inputs_embeds']", [guard_of("NONE_MATCH")]),
        Manager("L['self']", [guard_of("TYPE_MATCH")], [
            Manager("L['self']._modules['model'].config.eps", [guard_of("EQUALS_MATCH")])]),
        Manager("G['__import_vllm_dot_utils_dot_torch_utils']._USE_LAYERNAME", [guard_of("TRUE_MATCH")]),
        *extra])


def test_the_guards_of_vllms_frame_are_stood_in_for():
    assert fast_path.guard_refusal(frame_guards()) is None


@pytest.mark.parametrize("extra, says", [
    (Manager("G['__import_vllm_dot_forward_context']._forward_context.num_tokens", [guard_of("EQUALS_MATCH")]),
     "state vLLM changes every step"),
    (Manager("", [guard_of("LAMBDA_GUARD", "G['vllm_forward_context']._forward_context is not None")]),
     "state vLLM changes every step"),
    (Manager("L['intermediate_tensors'].tensors['hidden']", [guard_of("TENSOR_MATCH")]), "inside an argument"),
    (Manager("L['input_ids']", [guard_of("DICT_VERSION")]), "DICT_VERSION"),
    (Manager("L['self']._modules['model']", [guard_of("COW_TENSOR_MATCH")]), "COW_TENSOR_MATCH"),
    (Manager("", [guard_of("SOMETHING_NEW")]), "SOMETHING_NEW"),
])
def test_a_guard_nothing_stands_in_for_refuses_the_route(extra, says):
    refusal = fast_path.guard_refusal(frame_guards(extra))
    assert refusal is not None and says in refusal


class LoaderParameter(torch.nn.Parameter):
    """A Parameter subclass with a `__torch_function__`, as vLLM's `BasevLLMParameter` has."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


@torch.no_grad()
def test_parameters_of_a_parameter_subclass_go_direct_with_subclass_dispatch_off_as_dynamo_runs_them(monkeypatch):
    cfg = LlamaConfig(num_layers=1, num_blocks=256)
    model, reference = build(cfg), build(cfg)
    for module in model.modules():
        for name, param in [(n, p) for n, p in module._parameters.items() if p is not None]:
            module._parameters[name] = LoaderParameter(param.data, requires_grad=False)
    torch._dynamo.reset()
    artifacts = []
    fn = ascend_compile.compile(model, backend=backend(CompileConfig(max_model_len=256, capture_sizes=(4, 8)),
                                                       on_compiled=artifacts.append), dispatch="direct")
    batch = PagedBatch(cfg, seed=1)
    went = []
    for lens in ([5, 30, 9], [7, 3], [12, 40, 8, 2], [9]):
        step = batch.step(lens)
        with served.probe() as calls:
            result = fn(**step)
        went.append(bool(calls))
        torch.testing.assert_close(result, reference(**step), atol=2e-5, rtol=1e-4)
    assert went == [True, False, False, False]
    route = next(iter(fn.dispatcher.routes.values()))
    # as dynamo runs the graph: inside its `_tf_disabled_wrapper` where this torch has one (2.13 on); torch
    # 2.10 and 2.11 run it with subclass dispatch on
    wraps = "_tf_disabled_wrapper" in inspect.getsource(torch._dynamo.output_graph)
    assert route.torch_function_disabled == wraps
    enabled, original = [], type(artifacts[0]).call_direct

    def call_direct(self, args, fixed=None):
        enabled.append(torch._C._is_torch_function_enabled())
        return original(self, args, fixed)

    monkeypatch.setattr(type(artifacts[0]), "call_direct", call_direct)
    step = batch.step([6, 6])
    torch.testing.assert_close(fn(**step), reference(**step), atol=2e-5, rtol=1e-4)
    assert enabled == [not wraps]  # subclass dispatch as inside dynamo's call of the graph
