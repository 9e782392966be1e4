"""`integrations/vllm/fast_path.py` piece by piece: how dynamo's guard tree is read (`guards_of`), which guard
kinds each place of the tree may hold for the direct path to stand in for them (`guard_refusal`, the module
docstring's table), finding the `Module.compile`d model whose compiled code calls a graph
(`compiled_module`), and putting the direct dispatcher in front of it once (`install`, `DirectCall`). The
guard tree is a stand-in with dynamo's manager methods; the models are tiny `Module.compile`d modules.
vLLM's own frame: `tests/test_vllm_fast_path.py`, `tests/test_vllm_real.py`."""
from __future__ import annotations

import logging

import pytest
import torch

from ascend_compile.integrations.vllm import fast_path
from ascend_compile.integrations.vllm.fast_path import ARGUMENT_KINDS, FIXED_KINDS, ROOT_KINDS

# install's answer on a torch where the fast path is proven (elsewhere: the test of the model left to dynamo)
armed = pytest.mark.skipif(fast_path.fast_path_refusal("vllm_fast_path") is not None,
                           reason="vLLM's fast path is not proven on this torch")


def guard(kind: str, *code: str) -> object:
    return type(kind, (), {"verbose_code_parts": lambda self: list(code)})()


class Manager:
    def __init__(self, source: str | None, guards=(), children=()) -> None:
        self.source, self.guards, self.children = source, list(guards), list(children)
        if source is not None:
            self.get_source = lambda: self.source

    def get_leaf_guards(self) -> list:
        return self.guards

    def get_child_managers(self) -> list:
        return self.children


# ---------------------------------------------------------------- guards_of


def test_every_leaf_guard_of_the_tree_is_read_with_its_managers_source_and_code():
    tree = Manager(None, [guard("GLOBAL_STATE")], [
        Manager("L['x']", [guard("TENSOR_MATCH", "check_tensor(L['x'])", "size 4")]),
        Manager("L['self']", [guard("TYPE_MATCH", "type")], [Manager("L['self'].a", [guard("EQUALS_MATCH", "== 1")])]),
    ])
    found = fast_path.guards_of(tree)
    assert sorted(found) == sorted([("GLOBAL_STATE", "", ""), ("TENSOR_MATCH", "L['x']", "check_tensor(L['x']) size 4"),
                                    ("TYPE_MATCH", "L['self']", "type"), ("EQUALS_MATCH", "L['self'].a", "== 1")])
    assert fast_path.guards_of(Manager("", [])) == []


# ---------------------------------------------------------------- guard_refusal


@pytest.mark.parametrize("kind", sorted(ROOT_KINDS))
def test_the_roots_own_guards_are_stood_in_for(kind):
    assert fast_path.guard_refusal(Manager("", [guard(kind, "G['x'] is not None")])) is None


@pytest.mark.parametrize("kind", sorted(ARGUMENT_KINDS))
def test_guards_on_a_step_argument_itself_are_stood_in_for(kind):
    assert fast_path.guard_refusal(Manager("", [], [Manager("L['input_ids']", [guard(kind)])])) is None


@pytest.mark.parametrize("kind", sorted(FIXED_KINDS))
@pytest.mark.parametrize("source", ["L['self']", "L['self']._modules['model'].config", "G['_PP']",
                                    "G['__import_vllm']._USE_LAYERNAME"])
def test_guards_on_the_module_tree_and_globals_are_fixed_once_the_model_is_built(kind, source):
    assert fast_path.guard_refusal(Manager("", [], [Manager(source, [guard(kind)])])) is None


def test_dynamos_guard_manager_is_read_from_its_root():
    class Wrapper:  # dynamo's GuardManagerWrapper keeps the tree under `.root`
        root = Manager("", [guard("SOMETHING_NEW")])

    assert fast_path.guard_refusal(Wrapper()) == (
        "dynamo guards the frame with SOMETHING_NEW, which no check of the direct path stands in for")


@pytest.mark.parametrize("manager, refusal", [
    (Manager("", [guard("TENSOR_MATCH")]),
     "dynamo guards the frame with TENSOR_MATCH, which no check of the direct path stands in for"),
    (Manager(None, [guard("ID_MATCH")]),
     "dynamo guards the frame with ID_MATCH, which no check of the direct path stands in for"),
    (Manager("", [], [Manager("L['input_ids']", [guard("LENGTH_CHECK")])]),
     "dynamo guards L['input_ids'] with LENGTH_CHECK, which no check of the direct path stands in for"),
    (Manager("", [], [Manager("L['positions']", [guard("EQUALS_MATCH")])]),
     "dynamo guards L['positions'] with EQUALS_MATCH, which no check of the direct path stands in for"),
    (Manager("", [], [Manager("L['self']", [guard("GLOBAL_STATE")])]),
     "dynamo guards L['self'] with GLOBAL_STATE, which no check of the direct path stands in for"),
    (Manager("", [], [Manager("G['torch']", [guard("DICT_VERSION")])]),
     "dynamo guards G['torch'] with DICT_VERSION, which no check of the direct path stands in for"),
    (Manager("", [], [Manager("L['intermediate_tensors'].tensors", [guard("TYPE_MATCH")])]),
     "dynamo guards L['intermediate_tensors'].tensors (TYPE_MATCH), inside an argument of the step"),
    (Manager("", [], [Manager("L['self']._forward_context", [guard("TYPE_MATCH")])]),
     "dynamo guards L['self']._forward_context (TYPE_MATCH), state vLLM changes every step"),
    (Manager("", [guard("LAMBDA_GUARD", "G['fc']._forward_context.num_tokens == 4")]),
     "dynamo guards G['fc']._forward_context.num_tokens == 4 (LAMBDA_GUARD), state vLLM changes every step"),
])
def test_any_other_guard_refuses_the_route_naming_it(manager, refusal):
    assert fast_path.guard_refusal(manager) == refusal


def test_the_first_guard_that_no_check_stands_in_for_is_the_one_named():
    tree = Manager("", [guard("GLOBAL_STATE")], [Manager("L['self']", [guard("TYPE_MATCH"), guard("LENGTH_CHECK"),
                                                                        guard("DICT_VERSION")])])
    assert fast_path.guard_refusal(tree) == (
        "dynamo guards L['self'] with DICT_VERSION, which no check of the direct path stands in for")


# ---------------------------------------------------------------- compiled_module, install, DirectCall


class Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Deferred:
    """What dynamo calls as the graph (as `DeferredCompile` is): asks `fast_path` about the model calling it."""

    def __init__(self, gm: torch.fx.GraphModule, ask) -> None:
        self.gm, self.ask, self.answers = gm, ask, []

    def __call__(self, *args):
        self.answers.append(self.ask(self))
        return self.gm(*args)


def _compiled(ask) -> tuple[torch.nn.Module, list[Deferred]]:
    torch._dynamo.reset()
    made: list[Deferred] = []

    def backend(gm, example_inputs):
        made.append(Deferred(gm, ask))
        return made[-1]

    model = Doubler()
    model.compile(backend=backend, fullgraph=True)
    return model, made


def test_the_model_whose_compiled_code_calls_the_graph_is_found_on_the_stack():
    model, made = _compiled(fast_path.compiled_module)
    assert torch.equal(model(torch.ones(3)), torch.full((3,), 2.0))
    assert made[0].answers == [model]


def test_a_compiled_model_whose_code_calls_another_graph_is_no_answer():
    model, made = _compiled(lambda deferred: fast_path.compiled_module(object()))
    model(torch.ones(3))
    assert made[0].answers == ["Doubler.forward's compiled code does not call this graph"]


def test_a_model_not_compiled_with_module_compile_is_no_answer():
    answers = []

    class Asking(torch.nn.Module):
        def forward(self, x):
            answers.append(fast_path.compiled_module(object()))
            return x

    Asking()(torch.ones(1))
    assert answers == ["the model was not compiled with Module.compile (vLLM's mode-1 call)"]
    assert fast_path.compiled_module(object()) == (
        "no Module.compile'd model on the stack (the model was compiled with torch.compile(model) or a function)")


@armed
def test_install_puts_one_direct_call_in_front_of_the_compiled_model(caplog):
    model, made = _compiled(fast_path.install)
    compiled_call = model._compiled_call_impl
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        model(torch.ones(3))
    assert [r.getMessage() for r in caplog.records if r.name == "ascend_compile"] == [
        "ascend_compile: Doubler: steps after this one go straight to the compiled graph (dispatch='direct'; "
        "ASCEND_COMPILE_OPTIONS {\"dispatch\": \"dynamo\"} turns it off)"]
    direct = made[0].answers[0]
    assert isinstance(direct, fast_path.DirectCall) and model._compiled_call_impl is direct
    assert direct.compiled_call is compiled_call
    assert direct.dispatcher.guard_policy is fast_path.guard_refusal
    assert direct.dynamo_calls == 0  # the call that installed it came through dynamo before it was there
    result = model(torch.ones(3))  # through the direct call: its dispatcher, which sends it to dynamo to arm
    assert torch.equal(result, torch.full((3,), 2.0))
    assert direct.dynamo_calls == 1
    assert made[0].answers[1] is direct  # installed again: the one already there


def test_install_leaves_the_model_to_dynamo_where_the_fast_path_is_not_armed(monkeypatch, caplog):
    monkeypatch.setattr(fast_path, "fast_path_refusal", lambda name: f"{name} is proven on torch 9.9 only")
    model, made = _compiled(fast_path.install)
    compiled_call = model._compiled_call_impl
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        model(torch.ones(3))
    assert made[0].answers == [None] and model._compiled_call_impl is compiled_call
    assert [r.getMessage() for r in caplog.records] == [
        "ascend_compile: vLLM model calls go through dynamo's guards: vllm_fast_path is proven on torch 9.9 only"]


@armed
def test_install_outside_a_compiled_model_is_none_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        assert fast_path.install(object()) is None
    assert "no Module.compile'd model on the stack" in caplog.text


def test_a_direct_call_counts_the_calls_dynamo_takes_and_rechecks_through_its_dispatcher():
    calls = []
    direct = fast_path.DirectCall(Doubler(), lambda *args, **kwargs: calls.append((args, kwargs)) or "dynamo's")
    assert direct._through_dynamo((1, 2), {"x": 3}) == "dynamo's"
    assert calls == [((1, 2), {"x": 3})] and direct.dynamo_calls == 1
    direct._through_dynamo((4,), {})
    assert direct.dynamo_calls == 2
    direct.dispatcher.routes["layout"] = "a reason"
    direct.recheck()
    assert direct.dispatcher.routes == {}


class Breaking(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2
        torch._dynamo.graph_break()
        return x + 1


@armed
def test_a_graph_after_a_graph_break_is_not_the_models_graph_and_installs_nothing():
    torch._dynamo.reset()
    made: list[Deferred] = []

    def backend(gm, example_inputs):
        made.append(Deferred(gm, fast_path.install))
        return made[-1]

    model = Breaking()
    model.compile(backend=backend)
    assert torch.equal(model(torch.ones(3)), torch.full((3,), 3.0))
    assert len(made) == 2
    direct = made[0].answers[0]
    assert isinstance(direct, fast_path.DirectCall)  # the first graph is forward's own
    assert made[1].answers == [None]  # the second is the resumed function's, not forward's
