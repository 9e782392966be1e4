"""The direct route's contract, on small modules compiled with a stand-in artifact (`Artifact`: what the
backend's artifact is to the dispatcher, without the passes, the capture or the simulator), so that each
test compiles in well under a second: `dispatch/dispatcher.py` (a layout armed from one call through
dynamo, later calls direct; what keeps a layout on dynamo's path and for how long), `dispatch/route.py`
(arming: what is refused and why; a direct call's fallbacks, named), `dispatch/checks.py` (each check
fails on what it stands for among dynamo's guards, naming it, and on nothing else),
`dispatch/gathering.py` (the graph's arguments gathered per call and once) and `dispatch/graph_inputs.py`
(what the backend keeps of dynamo's placeholders). The compile-level tests with the real artifact are
`tests/test_direct_dispatch.py` and `tests/test_direct_soundness.py`; mutmut's tests for these modules
are this file and `tests/test_direct_units.py`."""
from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch._dynamo.side_effects
import torch.autograd.forward_ad as forward_ad
from torch import nn
from torch.overrides import TorchFunctionMode

import ascend_compile
from ascend_compile.dispatch import dispatcher as dispatcher_mod
from ascend_compile.dispatch import graph_inputs
from ascend_compile.dispatch.route import Fallback
from ascend_compile.lowering import served
from ascend_compile.lowering.graph_entry import MovedInputs


# Tests of constant stores replayed by a direct call: on torch 2.10 dynamo's record of a step's side effects is
# not readable (no AttrMutationKind), so every store is refused and such steps stay on dynamo's path
# (tests/test_direct_dispatch.py's side-effects contract test shows that branch on 2.10)
stores_readable = pytest.mark.skipif(not hasattr(torch._dynamo.side_effects, "AttrMutationKind"),
                                     reason="dynamo's record of side effects is not readable on this torch")


class Artifact:
    """The backend's artifact as the dispatcher sees it: dynamo's calls reported (`served.report`), direct
    calls recorded (`direct`: the arguments and the fixed positions), `moved` raising `MovedInputs`."""

    def __init__(self, gm):
        self.gm, self.graph_inputs, self.direct, self.moved = gm, graph_inputs.record(gm), [], None

    def __call__(self, *args):
        result = self.gm(*args)
        served.report(self, args, result)
        return result

    def call_direct(self, args, fixed=None):
        if self.moved:
            raise MovedInputs(self.moved)
        self.direct.append((tuple(args), fixed))
        return self.gm(*args)


def compiled(model):
    """`model` compiled with dispatch="direct" on the stand-in artifact, and the artifacts made."""
    torch._dynamo.reset()
    artifacts = []

    def backend(gm, example_inputs):
        artifacts.append(Artifact(gm))
        return artifacts[-1]

    return ascend_compile.compile(model, backend=backend, dispatch="direct"), artifacts


def call(fn, *args, **kwargs):
    """(the call's result, whether it went through dynamo)."""
    with served.probe() as calls:
        result = fn(*args, **kwargs)
    return result, bool(calls)


def armed(model, *args, **kwargs):
    """`model` compiled and called twice with these arguments: through dynamo, then directly."""
    fn, artifacts = compiled(model)
    assert call(fn, *args, **kwargs)[1]
    assert not call(fn, *args, **kwargs)[1], fn.dispatcher.routes
    return fn, artifacts


def fallback(fn, *args, **kwargs):
    """The route of this call's layout asked directly: (kind, detail) of the fallback it raises."""
    route = fn.dispatcher.routes[len(args), tuple(kwargs)]
    with pytest.raises(Fallback) as caught:
        route(args, kwargs)
    return caught.value.kind, caught.value.detail


def passes(fn, *args, **kwargs):
    """Whether the route of this call's layout serves it directly."""
    route = fn.dispatcher.routes[len(args), tuple(kwargs)]
    return torch.is_tensor(route(args, kwargs))


class Linear(nn.Module):
    """A linear layer with a buffer and a constant argument by default."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("shift", torch.ones(4))

    def forward(self, x, scale=2.0):
        return self.lin(x) * scale + self.shift


X = torch.randn(3, 4)


@torch.no_grad()
def test_later_calls_of_a_layout_go_straight_to_the_graph_with_the_same_result():
    model = Linear()
    fn, artifacts = compiled(model)
    went = []
    for rows in (3, 5, 2):
        x = torch.randn(rows, 4)
        result, through_dynamo = call(fn, x)
        torch.testing.assert_close(result, model(x))
        went.append(through_dynamo)
    assert went == [True, False, False] and len(artifacts) == 1
    inputs = artifacts[0].graph_inputs
    assert inputs.sources == ("L['self']._modules['lin']._parameters['weight']",
                              "L['self']._modules['lin']._parameters['bias']", "L['x'].size()[0]", "L['x']",
                              "L['self']._buffers['shift']")
    assert inputs.static_sizes == ((4, 4), (4,), None, (None, None), (4,))  # every size of the caller's symbolic
    assert inputs.static_strides == ((4, 1), (1,), None, (None, 1), (1,))
    assert (inputs.unread, inputs.stores, inputs.refusal, inputs.hoisted) == ((), (), None, ())
    # the parameters and the buffer are gathered once (the same objects, the fixed positions); the rest per call
    (args, fixed), (args2, fixed2) = artifacts[0].direct
    assert fixed == fixed2 == frozenset({0, 1, 4})
    assert args2[0] is model.lin.weight and args2[1] is model.lin.bias and args2[4] is model.shift
    assert args2[2] == 2 and args2[3].shape == (2, 4)
    # a keyword call is another layout: armed through dynamo once, then direct
    assert [call(fn, x=X)[1], call(fn, x=X)[1]] == [True, False]
    assert set(fn.dispatcher.routes) == {(1, ()), (0, ("x",))}


class Returns(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.lin(x)
        return out, ((out, None), y + 1)


@torch.no_grad()
def test_the_return_value_is_rebuilt_of_the_graphs_outputs():
    fn, _ = armed(Returns(), X, X.clone())
    result, through_dynamo = call(fn, X, X * 2)
    out, ((again, none), other) = result
    assert not through_dynamo and none is None and again is out
    torch.testing.assert_close(other, X * 2 + 1)


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


class Flagging(Linear):
    def forward(self, x, scale=2.0):
        self.flag = True
        return super().forward(x, scale)


def _direct_messages(caplog):
    return [(r.levelno, r.getMessage().removeprefix("ascend_compile: dispatch='direct': ")) for r in caplog.records
            if r.name == "ascend_compile" and "dispatch='direct'" in r.getMessage()]


@stores_readable
@torch.no_grad()
def test_a_step_changing_an_attribute_every_call_stays_on_dynamos_path_logged_once(caplog):
    fn, artifacts = compiled(Counting())
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        went = [call(fn, X)[1] for _ in range(4)]
    assert went == [True] * 4 and fn.dispatcher.routes[1, ()] == "the step changes L['self'].calls on every call"
    assert _direct_messages(caplog) == [
        (logging.DEBUG, "not armed yet: its constant stores are read before the next call through dynamo"),
        (logging.INFO, "the step changes L['self'].calls on every call: calls of this layout go through dynamo")]


@stores_readable
@torch.no_grad()
def test_a_constant_store_arms_once_the_attribute_holds_it_and_is_checked_at_each_call(caplog):
    model = Flagging()
    fn, _ = compiled(model)
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        went = [call(fn, X)[1] for _ in range(3)]
    assert went == [True, True, False]  # the first call's store is read before the second: then armed
    assert _direct_messages(caplog)[-1] == (logging.INFO, "calls of Flagging.forward go straight to their graph")
    model.flag = False
    assert fallback(fn, X) == ("L['self'].flag is no longer True, which the step stores", "")
    del model.flag
    assert fallback(fn, X) == ("L['self'].flag is no longer True, which the step stores", "")
    model.flag = True
    assert passes(fn, X)


class Varying(nn.Module):
    def forward(self, x, *rest):
        return x + 1


@torch.no_grad()
def test_a_frame_whose_locals_depend_on_the_call_stays_on_dynamos_path(caplog):
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        fn, _ = compiled(Varying())
        went = [call(fn, X)[1] for _ in range(3)]
    assert went == [True] * 3 and fn.dispatcher.routes == {}
    assert _direct_messages(caplog) == [
        (logging.INFO, "Varying.forward takes *rest: its locals depend on the call: calls go through dynamo")]


@torch.no_grad()
def test_grad_mode_keeps_calls_on_dynamo_and_the_route_for_later(caplog):
    fn, _ = armed(Linear(), X)
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"), torch.enable_grad():
        assert call(fn, X)[1] and call(fn, X)[1]
    route = fn.dispatcher.routes[1, ()]
    assert not call(fn, X)[1] and fn.dispatcher.routes[1, ()] is route
    with torch.enable_grad():
        kind, detail = fallback(fn, X)
    assert kind == "torch's global state differs from the traced call's" and "grad" in detail.lower()
    failed = f"torch's global state differs from the traced call's: this call goes through dynamo's guards ({detail})"
    meanwhile = "grad mode is on (direct calls serve inference: no autograd): calls go through dynamo meanwhile"
    assert _direct_messages(caplog) == [(logging.INFO, failed), (logging.INFO, meanwhile), (logging.DEBUG, failed),
                                        (logging.DEBUG, meanwhile)]  # INFO the first time each, then DEBUG
    fresh, _ = compiled(Linear())
    with caplog.at_level(logging.INFO, logger="ascend_compile"), torch.enable_grad():
        assert call(fresh, X)[1]
    assert fresh.dispatcher.routes == {}  # nothing armed from a call made in grad mode
    assert _direct_messages(caplog)[-1] == (logging.INFO, meanwhile)


@torch.no_grad()
def test_recheck_sends_the_next_call_through_dynamo():
    fn, _ = armed(Linear(), X)
    fn.recheck()
    assert fn.dispatcher.routes == {}
    assert [call(fn, X)[1], call(fn, X)[1]] == [True, False]


@torch.no_grad()
def test_routes_failing_at_their_first_call_four_times_keep_the_layout_on_dynamo(caplog):
    model = Linear()
    fn, _ = armed(model, X)
    went = []
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        for _ in range(6):
            model.lin.weight = nn.Parameter(torch.randn(4, 4))  # an assignment: every route fails at its first call
            went.append(call(fn, X)[1])
    assert went == [True] * 6
    kind = "parameters, buffers or submodules of a module were assigned"
    assert fn.dispatcher.routes[1, ()] == f"4 routes in a row failed at their first call ({kind})"
    assert _direct_messages(caplog)[-1] == (
        logging.INFO, f"4 routes in a row failed at their first call ({kind}): calls of this layout go through dynamo")
    # a route that served a call and then fails starts the count again
    fn, _ = armed(model, X)
    for _ in range(3):
        model.lin.weight = nn.Parameter(torch.randn(4, 4))
        assert call(fn, X)[1]
    assert not call(fn, X)[1]  # the third route served
    for _ in range(3):
        model.lin.weight = nn.Parameter(torch.randn(4, 4))
        assert call(fn, X)[1]
    assert type(fn.dispatcher.routes[1, ()]) is not str


class Unrouted(Linear):
    """A step whose return value is not one of its graph's outputs."""

    def forward(self, x, scale=2.0):
        return super().forward(x, scale), 3


@torch.no_grad()
def test_a_refused_layout_stays_on_dynamo_and_a_state_changing_call_arms_later(caplog, monkeypatch):
    fn, _ = compiled(Unrouted())
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        assert [call(fn, X)[1], call(fn, X)[1]] == [True, True]
    assert fn.dispatcher.routes[1, ()] == "the step returns a int that is not one of its graph's outputs"
    fn, _ = compiled(Linear())
    real = fn.compiled

    def switching(*args, **kwargs):  # the call through dynamo leaves torch in another global state
        torch.use_deterministic_algorithms(True)
        return real(*args, **kwargs)

    fn.compiled = switching
    try:
        for attempt in range(1, 5):
            assert call(fn, X)[1]
            torch.use_deterministic_algorithms(False)
            assert (1, ()) not in fn.dispatcher.routes or attempt == 4
            assert fn.dispatcher._unused[1, ()] == attempt
    finally:
        torch.use_deterministic_algorithms(False)
    assert fn.dispatcher.routes[1, ()].startswith("the call changed torch's global state (")
    fn.compiled = real
    fn.recheck()
    assert [call(fn, X)[1], call(fn, X)[1]] == [True, False]


@torch.no_grad()
def test_the_fallbacks_of_a_direct_call_say_why():
    model = Linear()
    fn, artifacts = armed(model, X)
    assert fallback(fn, "not a tensor")[0] in ("the graph's inputs could not be gathered",
                                              "a tensor argument's type, dtype, device, requires_grad, static size "
                                              "or stride differs")
    kind, detail = fallback(fn, [1, 2])
    assert kind == "the graph's inputs could not be gathered" and detail == "AttributeError: 'list' object has no attribute 'size'"
    artifacts[0].moved = ["L['x']", "L['self']._buffers['shift']"]
    assert fallback(fn, X) == ("in-place inputs moved since their graph was captured",
                               "L['x'], L['self']._buffers['shift']")
    artifacts[0].moved = None
    assert fn.dispatcher.routes[1, ()].used


class Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_each_ambient_check_fails_on_the_state_it_stands_for(monkeypatch):
    """What dynamo's global guards see, each changed alone after arming: the route names the first check
    that fails, and serves the call again once the state is back."""
    model, other = Linear(), nn.Linear(1, 1)
    fn, _ = armed(model, X)
    torch.set_default_dtype(torch.float64)
    try:
        kind, detail = fallback(fn, X)
    finally:
        torch.set_default_dtype(torch.float32)
    assert kind == "torch's global state differs from the traced call's" and "default_dtype" in detail
    with Mode():
        assert fallback(fn, X) == ("torch function modes differ from the traced call's", "")
    monkeypatch.setattr(torch.utils._device, "CURRENT_DEVICE", torch.device("meta"))
    assert fallback(fn, X) == ("the default device differs from the traced call's", "")
    monkeypatch.undo()
    with torch.compiler.set_stance("eager_on_recompile"):
        assert fallback(fn, X) == ("the torch.compiler stance is no longer 'default'", "")
    with forward_ad.dual_level():
        assert fallback(fn, X) == ("a functorch transform or forward-AD level is active", "")
    other.register_forward_hook(lambda *_: None)  # on any module: the count of registrations moves
    assert fallback(fn, X) == ("a hook was registered on a module (or a tensor)", "")
    fn, _ = armed(model, X)
    model.eval()
    assert fallback(fn, X) == ("module 'self' was switched to eval mode", "")
    fn, _ = armed(model, X)
    model.train()
    assert fallback(fn, X) == ("module 'self' was switched to training mode", "")
    fn, _ = armed(model, X)

    class Other(nn.Linear):
        pass

    model.lin.__class__ = Other  # runs no hook: the assignment count does not move
    assert fallback(fn, X) == ("a module's class was changed (module.__class__ = ...)", "")
    model.lin.__class__ = nn.Linear
    assert passes(fn, X)


@torch.no_grad()
def test_the_function_modes_of_the_traced_call_are_checked_by_identity():
    mode = Mode()
    with mode:
        fn, _ = armed(Linear(), X)
        assert passes(fn, X)
    with Mode():
        assert fallback(fn, X) == ("torch function modes differ from the traced call's", "")
    assert fallback(fn, X) == ("torch function modes differ from the traced call's", "")
    with mode, Mode():
        assert fallback(fn, X) == ("torch function modes differ from the traced call's", "")


@torch.no_grad()
def test_hooks_traced_in_are_checked_and_call_hooks_refuse(caplog):
    model = Linear()
    handle = model.lin.register_forward_hook(lambda module, args, out: out * 2)
    fn, _ = armed(model, X)
    torch.testing.assert_close(call(fn, X)[0], model(X))
    handle.remove()
    assert fallback(fn, X) == ("a hook traced into the graph was removed", "")
    model.register_forward_pre_hook(lambda *_: None)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        fn, _ = compiled(model)
        assert call(fn, X)[1] and call(fn, X)[1]
    assert fn.dispatcher.routes[1, ()] == "Linear has call hooks, which run around its forward"


class WithSub(nn.Module):
    """A submodule passed as an argument (its parameters gathered once), and arguments the graph does not
    read: a constant, an object, a tensor, a list and a dict read through."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, sub, flag=True, opts=None, extra=None, xs=(), named=None):
        out = sub(self.lin(x)) + xs[0]
        return out + named["b"] if flag is True else out


class Opts:
    pass


@torch.no_grad()
def test_arguments_are_checked_as_dynamo_guards_them():
    model, sub, opts, another = WithSub(), nn.Linear(4, 4), Opts(), nn.Linear(4, 4)
    xs, named, extra = [torch.ones(4)], {"b": torch.ones(4)}, torch.zeros(2)
    args = dict(sub=sub, flag=True, opts=opts, extra=extra, xs=xs, named=named)
    fn, artifacts = armed(model, X, **args)
    assert artifacts[0].direct[-1][1] == frozenset({0, 1, 4, 5})  # the submodule argument's too

    def fails(**changed):
        return fallback(fn, X, **{**args, **changed})

    assert fails(sub=another) == ("argument 'sub' is another module than in the traced call", "")
    assert fails(flag=1) == ("argument 'flag' differs from the traced call's", "")  # equal, of another type
    assert fails(flag=False) == ("argument 'flag' differs from the traced call's", "")
    assert fails(opts=Opts()) == ("argument 'opts' is another object than in the traced call", "")
    assert fails(extra=nn.Parameter(extra, requires_grad=False)) == ("argument 'extra' is another type of tensor", "")
    assert fails(xs=(xs[0],)) == ("argument 'xs' is of another type or length than in the traced call", "")
    assert fails(xs=[xs[0], xs[0]]) == ("argument 'xs' is of another type or length than in the traced call", "")
    assert fails(named={"b": named["b"], "c": 1}) == (
        "argument 'named' is of another type or length than in the traced call", "")
    assert fails(named={"c": named["b"]})[0] in ("argument 'named' is of another type or length than in the traced call",
                                                 "the graph's inputs could not be gathered")
    assert passes(fn, X, **{**args, "xs": [torch.zeros(4)], "named": {"b": torch.zeros(4)}, "extra": torch.ones(3)})
    sub.train(False)
    assert fails() == ("module 'sub' was switched to eval mode", "")
    sub.train(True)
    assert passes(fn, X, **args)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.lin(x) + y


@torch.no_grad()
def test_tensors_passed_as_one_object_or_distinct_ones_stay_so():
    y = torch.randn(3, 4)
    fn, _ = armed(Pair(), X, y)
    assert fallback(fn, X, X) == ("tensor arguments that were distinct objects are one, or a parameter or buffer", "")
    model = Pair()
    fn, _ = armed(model, X, X)
    assert fallback(fn, X, X.clone()) == ("tensor arguments that were one object are not", "")
    assert passes(fn, y, y)
    fn, _ = compiled(model)
    assert call(fn, X, model.lin.bias)[1] and call(fn, X, model.lin.bias)[1]
    assert fn.dispatcher.routes[2, ()] == "the call passes a parameter or buffer of the model as an argument"


@torch.no_grad()
def test_a_tensors_metadata_and_the_shape_guards_are_checked():
    fn, _ = armed(Pair(), X, X.clone())
    kind, detail = fallback(fn, X.double(), X.clone())
    assert kind == "a tensor argument's type, dtype, device, requires_grad, static size or stride differs"
    assert detail == "tensor 'L['x']' dtype mismatch. expected Float, actual Double"
    kind, _ = fallback(fn, torch.randn(3, 4), torch.randn(5, 4))
    assert kind.startswith("dynamo's shape guard ") and kind.endswith(" fails") and "L['y'].size()[0]" in kind
    assert passes(fn, torch.randn(7, 4), torch.randn(7, 4))



@torch.no_grad()
def test_a_route_is_given_up_after_exactly_four_routes_fail_at_their_first_call():
    model = Linear()
    fn, _ = compiled(model)
    assert call(fn, X)[1]  # armed, not yet used
    given_up = []
    for _ in range(5):
        model.lin.weight = nn.Parameter(torch.randn(4, 4))
        assert call(fn, X)[1]
        given_up.append(type(fn.dispatcher.routes[1, ()]) is str)
    assert given_up == [False, False, False, True, True]


@torch.no_grad()
def test_a_failed_route_is_dropped_when_arming_again_is_refused():
    """A route that served, then fails while every call through dynamo changes torch's state: the failed
    route is not kept, so the refusals count up and the layout is given up at the fourth attempt."""
    model = Linear()
    fn, _ = armed(model, X)
    real = fn.compiled

    def switching(*args, **kwargs):
        torch.use_deterministic_algorithms(True)
        return real(*args, **kwargs)

    fn.compiled, given_up = switching, []
    try:
        for _ in range(4):
            model.lin.weight = nn.Parameter(torch.randn(4, 4))
            assert call(fn, X)[1]
            torch.use_deterministic_algorithms(False)
            given_up.append(fn.dispatcher.routes.get((1, ())))
    finally:
        torch.use_deterministic_algorithms(False)
    assert given_up[:2] == [None, None] and given_up[2].startswith("the call changed torch's global state (")


@torch.no_grad()
def test_the_guard_policy_is_asked_before_a_route_stands_in_for_dynamos_guards():
    asked = []
    model = Linear()
    dispatcher = dispatcher_mod.DirectDispatcher(model, guard_policy=lambda guards: asked.append(guards) or
                                                 "the guards read a global")
    fn, _ = compiled(model)
    through = lambda a, k: fn._through_dynamo(a, k)  # noqa: E731
    assert dispatcher((X,), {}, through) is not None and dispatcher.routes[1, ()] == "the guards read a global"
    assert type(asked[0]).__name__ == "GuardManagerWrapper"


@torch.no_grad()
def test_direct_calls_are_armed_only_on_a_torch_that_proved_them(monkeypatch, caplog):
    monkeypatch.setattr(dispatcher_mod, "fast_path_refusal", lambda name: f"{name} is proven on torch 9.9 only")
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        fn, _ = compiled(Linear())
        assert [call(fn, X)[1], call(fn, X)[1]] == [True, True]
    assert fn.dispatcher.frame.refusal == "direct is proven on torch 9.9 only" and fn.dispatcher.routes == {}
    assert _direct_messages(caplog) == [(logging.INFO, "direct is proven on torch 9.9 only: calls go through dynamo")]
    assert dispatcher_mod.DirectDispatcher(Varying()).frame.refusal == (
        "Varying.forward takes *rest: its locals depend on the call")  # the frame's own refusal kept


# A hoisted value-type opaque object (vLLM's `LayerName`): dynamo's code builds it before each call from a
# module attribute it guards, and passes it to the graph; a direct call passes the object of the armed call.
try:
    from torch._library.opaque_object import OpaqueBase, register_opaque_type
except ImportError:  # torch < 2.11: no opaque types
    OpaqueBase, register_opaque_type = object, None


class Tag(OpaqueBase):
    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Tag) and self.value == other.value

    def __hash__(self):
        return hash(self.value)

    def __fx_repr__(self):
        return f"Tag({self.value!r})", {"Tag": Tag}


def _tagged(x: torch.Tensor, tag: Tag) -> torch.Tensor:
    return x * (2.0 if tag.value == "double" else 1.0)


if register_opaque_type is not None:
    Tag.__module__ = "ascend_compile_test_tags"  # dynamo's code imports the class from its module
    sys.modules[Tag.__module__] = types.SimpleNamespace(Tag=Tag)
    register_opaque_type(Tag, typ="value", hoist=True)
    _LIB = torch.library.Library("ascend_compile_test", "FRAGMENT")
    _LIB.define("tagged" + torch.library.infer_schema(_tagged, mutates_args=()))
    _LIB.impl("tagged", _tagged, "CompositeExplicitAutograd")
    _LIB._register_fake("tagged", lambda x, tag: torch.empty_like(x))


class Tagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.tag_name = nn.Linear(4, 4), "double"

    def forward(self, x):
        return torch.ops.ascend_compile_test.tagged(self.lin(x), Tag(self.tag_name))


class TaggedFromList(Tagged):
    """The tag's value read from a list: not a plain attribute, which a direct call could take as traced."""

    def __init__(self):
        super().__init__()
        self.tag_names = ["double"]

    def forward(self, x):
        return torch.ops.ascend_compile_test.tagged(self.lin(x), Tag(self.tag_names[0]))


@pytest.mark.skipif(register_opaque_type is None, reason="torch without opaque types")
@torch.no_grad()
def test_a_hoisted_opaque_input_is_passed_as_dynamo_passed_it_when_armed():
    model = Tagged()
    fn, artifacts = armed(model, X)
    inputs = artifacts[0].graph_inputs
    assert inputs.hoisted == (4,) and inputs.sources[4] == "H[4]" and inputs.refusal is None
    assert inputs.static_sizes[4] is None and inputs.static_strides[4] is None
    assert not any("A[4]" in guard for guard in inputs.shape_guards)
    result, through_dynamo = call(fn, X)
    assert not through_dynamo and artifacts[0].direct[-1][0][4] == Tag("double")
    torch.testing.assert_close(result, model.lin(X) * 2)
    fn, _ = compiled(TaggedFromList())
    assert call(fn, X)[1] and call(fn, X)[1]
    assert fn.dispatcher.routes[1, ()] == (
        "dynamo's code for TaggedFromList.forward does more than call the graph: LOAD_ATTR 'tag_names'")


class Cast(Linear):
    """A tensor read for its dtype only: dynamo wraps it without passing it to the graph."""

    def forward(self, x, like):
        return super().forward(x).to(like.dtype)


@torch.no_grad()
def test_a_tensor_read_for_its_metadata_alone_is_checked_as_dynamo_wrapped_it():
    like = torch.zeros(2, dtype=torch.float64)
    fn, artifacts = armed(Cast(), X, like)
    assert artifacts[0].graph_inputs.unread == (("L['like']", (None,), (1,)),)
    assert passes(fn, X, torch.ones(5, dtype=torch.float64))
    kind, detail = fallback(fn, X, like.float())
    assert kind == "a tensor argument's type, dtype, device, requires_grad, static size or stride differs"
    assert detail == "tensor 'L['like']' dtype mismatch. expected Double, actual Float"
    assert fallback(fn, X, X)[0] == "tensor arguments that were distinct objects are one, or a parameter or buffer"


class Applies(nn.Module):
    """A module reading none of its own parameters: it is not a root of the gathering, its tree is checked all the
    same (its hooks and its submodules' classes run around and inside its forward)."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU()

    def forward(self, x, sub):
        return self.act(sub(x))


class _Host:
    def __init__(self):
        self.lin = nn.Linear(4, 4)

    def step(self, x):
        return self.lin(x) + 1


def _step(x, sub):
    return sub(x) * 2


@torch.no_grad()
def test_the_steps_own_module_tree_is_checked_and_steps_of_no_module_are_routed():
    model, sub = Applies(), nn.Linear(4, 4)
    fn, _ = armed(model, X, sub)

    class Other(nn.ReLU):
        pass

    model.act.__class__ = Other
    assert fallback(fn, X, sub) == ("a module's class was changed (module.__class__ = ...)", "")
    model.act.__class__ = nn.ReLU
    assert passes(fn, X, sub)
    for step, args in ((_step, (X, sub)), (_Host().step, (X,))):
        fn, artifacts = armed(step, *args)
        result, through_dynamo = call(fn, *args)
        torch.testing.assert_close(result, step(*args))


@torch.no_grad()
def test_a_call_failing_a_check_made_before_gathering_gathers_nothing():
    """The checks of torch's state and of the modules run before the graph's arguments are gathered: a call
    they refuse leaves the route's list as the last direct call left it."""
    model, other = Linear(), nn.Linear(1, 1)
    fn, _ = armed(model, X)
    route, y = fn.dispatcher.routes[1, ()], torch.randn(3, 4)

    class Other(nn.Linear):
        pass

    def kept(kind):
        assert fallback(fn, y)[0] == kind
        return route._args[3] is X

    with torch.enable_grad():
        assert kept("torch's global state differs from the traced call's")
    with Mode():
        assert kept("torch function modes differ from the traced call's")
    with torch.compiler.set_stance("eager_on_recompile"):
        assert kept("the torch.compiler stance is no longer 'default'")
    with forward_ad.dual_level():
        assert kept("a functorch transform or forward-AD level is active")
    original = torch.utils._device.CURRENT_DEVICE
    torch.utils._device.CURRENT_DEVICE = torch.device("meta")
    try:
        assert kept("the default device differs from the traced call's")
    finally:
        torch.utils._device.CURRENT_DEVICE = original
    model.train(False)
    assert kept("module 'self' was switched to eval mode")
    model.train(True)
    model.lin.__class__ = Other
    assert kept("a module's class was changed (module.__class__ = ...)")
    model.lin.__class__ = nn.Linear
    other.register_forward_hook(lambda *_: None)
    assert kept("a hook was registered on a module (or a tensor)")
    model.lin.weight = nn.Parameter(torch.randn(4, 4))
    assert kept("parameters, buffers or submodules of a module were assigned")
    model, sub = WithSub(), nn.Linear(4, 4)
    handle = model.lin.register_forward_hook(lambda module, args, out: out)
    args = dict(sub=sub, flag=True, opts=None, extra=None, xs=[torch.ones(4)], named={"b": torch.ones(4)})
    fn, _ = armed(model, X, **args)
    route = fn.dispatcher.routes[1, tuple(args)]
    position = next(i for i, value in enumerate(route._args) if value is X)
    handle.remove()
    assert fallback(fn, y, **args)[0] == "a hook traced into the graph was removed" and route._args[position] is X


AMBIENT = [("parameters, buffers or submodules of a module were assigned", True),
           ("torch's global state differs from the traced call's", True),
           ("torch function modes differ from the traced call's", True),
           ("the default device differs from the traced call's", True),
           ("the torch.compiler stance is no longer 'default'", True),
           ("a functorch transform or forward-AD level is active", True),
           ("a hook was registered on a module (or a tensor)", True)]


@torch.no_grad()
def test_a_route_makes_the_checks_its_step_needs_and_no_other():
    """Each check once, in the order `Route.explain` names them, those over torch's state and the modules before
    gathering: the bound module is no argument, the arguments the graph reads are checked by what it reads."""
    fn, _ = armed(Linear(), X)
    tensors = [("tensor arguments that were distinct objects are one, or a parameter or buffer", False),
               ("a tensor argument's type, dtype, device, requires_grad, static size or stride differs", False)]
    assert [(c.description, c.before_gather) for c in fn.dispatcher.routes[1, ()]._checks] == [
        *AMBIENT, ("module 'self' was switched to eval mode", True),
        ("a module's class was changed (module.__class__ = ...)", True),
        ("argument 'scale' differs from the traced call's", False), *tensors]
    args = dict(sub=nn.Linear(4, 4), flag=True, opts=Opts(), extra=torch.zeros(2), xs=[torch.ones(4)],
                named={"b": torch.ones(4)})
    fn, _ = armed(WithSub(), X, **args)
    assert [(c.description, c.before_gather) for c in fn.dispatcher.routes[1, tuple(args)]._checks] == [
        *AMBIENT, ("module 'self' was switched to eval mode", True),
        ("argument 'sub' is another module than in the traced call", False),
        ("module 'sub' was switched to eval mode", True),
        ("a module's class was changed (module.__class__ = ...)", True),
        ("argument 'flag' differs from the traced call's", False),
        ("argument 'opts' is another object than in the traced call", False),
        ("argument 'extra' is another type of tensor", False),
        ("argument 'named' is of another type or length than in the traced call", False),
        ("argument 'xs' is of another type or length than in the traced call", False), *tensors]


@torch.no_grad()
def test_several_function_modes_are_checked_each_in_its_place():
    first, second = Mode(), Mode()
    with first, second:
        fn, _ = armed(Linear(), X)
        assert passes(fn, X)
    with second, first:
        assert fallback(fn, X) == ("torch function modes differ from the traced call's", "")
    with first:
        assert fallback(fn, X) == ("torch function modes differ from the traced call's", "")


class Powered(nn.Module):
    """A step whose arguments hold no tensor: nothing for the tensor checks to check."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, n):
        return self.lin.weight * n


@torch.no_grad()
def test_a_step_taking_no_tensor_makes_no_tensor_check():
    model = Powered()
    fn, artifacts = armed(model, 3)
    route = fn.dispatcher.routes[1, ()]
    assert [(c.description, c.before_gather) for c in route._checks] == [
        *AMBIENT, ("module 'self' was switched to eval mode", True),
        ("a module's class was changed (module.__class__ = ...)", True),
        ("argument 'n' is of another type or length than in the traced call", False)]  # an int, read as a size
    result, through_dynamo = call(fn, 5)
    assert not through_dynamo and artifacts[0].graph_inputs.sources[-1] == "L['n']"
    torch.testing.assert_close(result, model.lin.weight * 5)


class _Box:
    """A plain object a step writes a constant into."""


class FlagsItsArgument(Linear):
    def forward(self, x, box):
        box.flag = True
        return super().forward(x)


@stores_readable
@torch.no_grad()
def test_a_constant_store_into_an_argument_is_read_from_the_call_positional_or_keyword():
    box = _Box()
    fn, _ = compiled(FlagsItsArgument())
    assert [call(fn, X, box)[1] for _ in range(3)] == [True, True, False]
    assert [call(fn, X, box=box)[1] for _ in range(3)] == [True, True, False]
    box.flag = False
    assert fallback(fn, X, box) == ("L['box'].flag is no longer True, which the step stores", "")
    assert fallback(fn, X, box=box) == ("L['box'].flag is no longer True, which the step stores", "")


class StoresNone(nn.Module):
    """A step storing None into an attribute (a cache it clears)."""

    def forward(self, x):
        self.cached = None
        return x + 1


@stores_readable
@torch.no_grad()
def test_a_stored_none_is_told_from_the_attribute_deleted():
    """The store's check reads a deleted attribute as missing, not as None (which the step stores)."""
    model = StoresNone()
    fn, _ = compiled(model)
    assert [call(fn, X)[1] for _ in range(3)] == [True, True, False]
    del model.cached
    assert fallback(fn, X) == ("L['self'].cached is no longer None, which the step stores", "")
    model.cached = None
    assert passes(fn, X)


@torch.no_grad()
def test_a_layout_armed_under_a_default_device_is_served_directly_under_it():
    """`torch.set_default_device`: the default device at arming is the one each call is checked against."""
    model = Linear()
    torch.set_default_device("cpu")
    try:
        fn, _ = armed(model, X)
        assert passes(fn, X)
    finally:
        torch.set_default_device(None)
    assert fallback(fn, X)[0] in ("torch function modes differ from the traced call's",
                                  "the default device differs from the traced call's")


class Summing(nn.Module):
    def forward(self, x, y, z):
        return x + y * 2 + z * 3


@torch.no_grad()
def test_one_tensor_passed_under_three_names_is_checked_one_object_under_each():
    fn, _ = armed(Summing(), X, X, X)
    assert passes(fn, X, X, X)
    assert fallback(fn, X, X, X.clone())[0] == "tensor arguments that were one object are not"


class Wide(nn.Module):
    def forward(self, x):
        return x * 2


@torch.no_grad()
def test_a_tensor_whose_stride_follows_a_dynamic_size_is_served_at_every_size():
    """(2, T) tensors, T dynamic: the outer stride is T, dynamic as the size is, and not checked as static."""
    fn, artifacts = compiled(Wide())
    went = [call(fn, torch.randn(2, t))[1] for t in (3, 5, 6, 7, 9)]
    assert went == [True, False, False, False, False] and len(artifacts) == 1  # traced dynamic: one graph


class ReadsDtypes(nn.Module):
    """Three tensors read for their dtype alone (dynamo wraps them without passing them to the graph): an
    attribute that is not a buffer, a positional argument and a keyword argument, each of its own dtype."""

    def __init__(self):
        super().__init__()
        self.like = torch.empty(2, dtype=torch.float64)

    def forward(self, x, first, second=None):
        return x.to(self.like.dtype) + x.to(first.dtype).double() + x.to(second.dtype).double()


@torch.no_grad()
def test_tensors_read_for_their_dtype_are_checked_each_as_itself_wherever_the_call_holds_it():
    half, ints = torch.empty(1, dtype=torch.float16), torch.empty(1, dtype=torch.int32)
    fn, _ = armed(ReadsDtypes(), X, half, second=ints)
    assert passes(fn, X, half.clone(), second=ints.clone())
    kind, detail = fallback(fn, X, half, second=ints.long())
    assert kind == "a tensor argument's type, dtype, device, requires_grad, static size or stride differs"
    assert "second" in detail and "dtype mismatch" in detail, detail


class SquareRows(nn.Module):
    def forward(self, x):
        return x.view(int(x.shape[0] ** 0.5), -1) * 2


@torch.no_grad()
def test_shape_guards_written_with_math_and_torch_are_checked_on_each_direct_call():
    """Dynamo's guards for `int(size ** 0.5)` rows read `math.trunc` and `torch.sym_float` (sympy's printer):
    each direct call checks them, and a size failing one (10 is no multiple of 3) falls back naming it."""
    fn, _ = compiled(SquareRows())
    assert [call(fn, torch.randn(t))[1] for t in (16, 36, 64)] == [True, False, False]
    kind, _ = fallback(fn, torch.randn(10))
    assert kind.startswith("dynamo's shape guard (L['x'].size()[0] % (math.trunc(torch.sym_float("), kind


class Loaded(nn.Module):
    """A weight of a Parameter class with methods only (vLLM's parameter classes)."""

    def __init__(self):
        super().__init__()
        from tests.test_direct_units import _Loader

        self.weight = _Loader(torch.randn(4, 4), requires_grad=False)

    def forward(self, x):
        return x @ self.weight


class Wrapped(nn.Module):
    """A buffer of a tensor subclass, gathered once with the module's state."""

    def __init__(self):
        super().__init__()
        from tests.test_direct_units import _Wrapper

        self.register_buffer("w", torch.ones(4).as_subclass(_Wrapper))

    def forward(self, x):
        return x + self.w


@torch.no_grad()
def test_a_parameter_class_gathered_once_is_served_directly_and_a_subclass_buffer_is_not():
    """A Parameter class gathered once is served directly; a buffer of another tensor subclass reaches the
    graph through dynamo's own wrapping, which keeps the layout on dynamo's path before `_plain` is asked."""
    armed(Loaded(), X)
    fn, _ = compiled(Wrapped())
    assert [call(fn, X)[1] for _ in range(3)] == [True] * 3
    assert fn.dispatcher.routes[1, ()].startswith("dynamo's code for Wrapped.forward does more than call the graph")


_GLOBAL_SCALE = torch.full((4,), 3.0)


class GlobalScaled(nn.Module):
    """A step reading a module-level tensor (dynamo's source `G['_GLOBAL_SCALE']`)."""

    def forward(self, x):
        return x * _GLOBAL_SCALE


@torch.no_grad()
def test_a_tensor_read_from_the_modules_globals_is_gathered_from_them_on_each_direct_call(caplog):
    global _GLOBAL_SCALE
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        fn, artifacts = armed(GlobalScaled(), X)
    assert (logging.DEBUG, "GlobalScaled.forward: 0 inputs gathered once, 4 per call, 12 checks") in _direct_messages(caplog)
    saved, _GLOBAL_SCALE = _GLOBAL_SCALE, torch.full((4,), 5.0)
    try:
        result, went = call(fn, X)  # the global rebound: another object, checked and gathered as it is now
        assert torch.equal(result, X * 5) and not went
    finally:
        _GLOBAL_SCALE = saved


@torch.no_grad()
def test_a_direct_call_made_inside_another_is_gathered_afresh_and_served_directly():
    """The route's list is held by the outer call while its graph runs: a call made then (another
    thread, or a hook inside the step) gathers its own arguments and is served directly too."""
    model = Linear()
    fn, artifacts = armed(model, X)
    art, inner = artifacts[-1], []
    outer_call = art.call_direct

    def call_direct(args, fixed=None):
        if not inner:
            inner.append(None)
            inner[0] = fn(X + 1)
        return outer_call(args, fixed)

    art.call_direct = call_direct
    outer, went = call(fn, X)
    assert not went and len(art.direct) == 3  # the arming call's, then the inner call's, then the outer's
    assert torch.equal(outer, model(X)) and torch.equal(inner[0], model(X + 1))


_MATMULS = (torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul)


class _Dispatching(nn.Parameter):
    """A Parameter class with a `__torch_function__` of its own (vLLM's parameter classes): dynamo inlines it
    and runs the graph with subclass dispatch disabled."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return out * 2 if func in _MATMULS else out  # seen: the product doubled


class DispatchingWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = _Dispatching(torch.randn(4, 4), requires_grad=False)

    def forward(self, x):
        return x @ self.weight


# torch 2.10's dynamo runs such a graph with the class's dispatch on (no `_tf_disabled_wrapper`): the stand-in
# artifact's graph then dispatches through the class again, through dynamo and directly alike
@pytest.mark.skipif(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 13), reason="dynamo runs it with dispatch on")
@torch.no_grad()
def test_a_graph_dynamo_runs_with_subclass_dispatch_off_runs_so_when_called_directly():
    model = DispatchingWeight()
    fn, _ = armed(model, X)
    result, went = call(fn, X)
    assert not went and torch.equal(result, model(X))  # traced through the class's dispatch, run without it
