"""The direct route's parts, each called on its own: `dispatch/dynamo_code.py` (which instructions of dynamo's
code a direct call may skip, and where it finds the artifact), `dispatch/gathering.py` (the generated
gathering: what it writes, in what form, and where the checks go), `dispatch/route.py`'s helpers (the served
call, the return value's recipe, the constant stores, arming's refusals, a direct call's fallbacks),
`dispatch/checks.py`'s refusals and shape guards, `dispatch/graph_inputs.py`'s record of dynamo's
placeholders and `dispatch/side_effects.py`'s refusals. With `tests/test_direct_route.py`, mutmut's tests of
these modules."""
from __future__ import annotations

import dataclasses
import sys
import types

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from torch import nn

from ascend_compile.dispatch import checks, dynamo_code, graph_inputs, route, side_effects
from ascend_compile.dispatch.codegen import MISSING, Check
from ascend_compile.dispatch.frame import frame_of
from ascend_compile.dispatch.gathering import Gathering
from ascend_compile.dispatch.side_effects import ConstantStore
from ascend_compile.lowering.served import Served
from tests.test_direct_route import Flagging, Linear, X, armed, call, compiled, stores_readable


#: How Python calls a method of a loaded object: LOAD_METHOD until 3.11, LOAD_ATTR from 3.12.
METHOD = "LOAD_METHOD" if sys.version_info < (3, 12) else "LOAD_ATTR"


def _code(source: str) -> types.CodeType:
    """The code of the one function `source` defines (never run: dynamo's code is read, not called)."""
    module = compile(source, "<dynamo-like>", "exec")
    return next(c for c in module.co_consts if isinstance(c, types.CodeType))


# ---------------------------------------------------------------- dynamo_code


def test_dynamo_code_that_only_gathers_calls_and_returns_is_safe_and_anything_else_is_named():
    graph_call = _code("def f(x):\n"
                       "    n = __import_torch_dot__dynamo_dot_utils.call_size(x, 0)\n"
                       "    out = __compiled_fn_7(x.weight, n, G_obj)\n"
                       "    return [out[0]]\n")
    assert dynamo_code.unsafe_instruction(graph_call, ["L['x'].weight", "G['G_obj']"], []) is None
    assert dynamo_code.unsafe_instruction(graph_call, ["L['x'].weight"], []) == "LOAD_GLOBAL 'G_obj'"
    assert dynamo_code.unsafe_instruction(graph_call, ["G['G_obj']"], []) == "LOAD_ATTR 'weight'"
    reads = _code("def f(x):\n    return __import_torch_dot__dynamo_dot_utils.call_storage_offset(x)\n")
    assert dynamo_code.unsafe_instruction(reads, [], []) is None
    other_util = _code("def f(x):\n    return __import_torch_dot__dynamo_dot_utils.other(x)\n")
    assert dynamo_code.unsafe_instruction(other_util, [], []) == f"{METHOD} 'other'"
    gated = _code("def f(x):\n"
                  "    if __import_torch_dot_autograd_dot_profiler._is_profiler_enabled is None:\n"
                  "        __import_torch_dot__dynamo_dot_utils.record_pregraph_bytecode_enter()\n"
                  "    return x\n")
    assert dynamo_code.unsafe_instruction(gated, [], []) is None
    loop = _code("def f(x):\n    for y in x:\n        pass\n    return x\n")
    assert dynamo_code.unsafe_instruction(loop, [], []) == "GET_ITER None"
    writes = _code("def f(x):\n    x.flag = 1\n    return x\n")
    assert dynamo_code.unsafe_instruction(writes, ["L['x'].flag"], []) == "STORE_ATTR 'flag'"
    calls_print = _code("def f(x):\n    return print(x)\n")
    assert dynamo_code.unsafe_instruction(calls_print, [], []) == "LOAD_GLOBAL 'print'"


def test_constant_stores_are_replayed_exactly_where_dynamo_recorded_them():
    replays = _code("def f(box):\n"
                    "    s = __import_torch_dot__dynamo_dot_utils.object_setattr_ignore_descriptor\n"
                    "    s(box, 'flag', True)\n"
                    "    s(box, 'name', 'on')\n"
                    "    return None\n")
    stores = [ConstantStore("L['box']", "flag", True), ConstantStore("L['box']", "name", "on")]
    assert dynamo_code.unsafe_instruction(replays, [], stores) is None  # loaded once for every store
    assert dynamo_code.unsafe_instruction(replays, [], []) == "LOAD_ATTR 'object_setattr_ignore_descriptor'"
    called = _code("def f(box):\n"
                   "    __import_torch_dot__dynamo_dot_utils.object_setattr_ignore_descriptor(box, 'flag', True)\n"
                   "    return None\n")
    assert dynamo_code.unsafe_instruction(called, [], stores[:1]) is None
    # the store utility read (as an attribute some source names) where dynamo recorded no store
    assert dynamo_code.unsafe_instruction(called, ["G['u'].object_setattr_ignore_descriptor"], []) == (
        "object_setattr_ignore_descriptor loaded where dynamo recorded 0 stores")
    plain = _code("def f(box):\n    return __import_torch_dot__dynamo_dot_utils.call_size(box, 0)\n")
    assert dynamo_code.unsafe_instruction(plain, [], stores) == (
        "object_setattr_ignore_descriptor not loaded where dynamo recorded 2 stores")


class _Hoisted:
    """A class whose instances dynamo's code would build from module attributes."""


class _Layer(nn.Module):
    kind = "attention"  # a class attribute: reading the instance's may run a descriptor's code

    def __init__(self):
        super().__init__()
        self.layer_name, self.index, self.scale, self.on, self.nothing = "model.layers.0", 0, 0.5, True, None
        self.kind, self.table = "mla", [1]


def test_hoisted_builds_read_each_class_by_its_import_and_the_modules_plain_attributes():
    layer = _Layer()
    globals_, attributes = dynamo_code.hoisted_builds([_Hoisted], [layer])
    assert globals_ == {"__import_tests_dot_test_direct_units"}
    assert {"_Hoisted", "layer_name", "index", "scale", "on", "nothing"} <= attributes
    assert not {"kind", "table", "lin", "_modules"} & attributes
    assert dynamo_code.hoisted_builds([], [layer]) == (set(), set())


def test_the_graph_dynamo_calls_is_found_through_its_subclass_wrapper():
    artifact = object()

    def wrap(real_compiled_fn):
        def _tf_disabled_wrapper(*args):
            return real_compiled_fn(*args)
        return _tf_disabled_wrapper

    def other(real_compiled_fn):
        def wrapper(*args):
            return real_compiled_fn(*args)
        return wrapper

    def compiled_fn(called):
        return types.SimpleNamespace(_torchdynamo_orig_callable=called)

    assert dynamo_code._called(compiled_fn(artifact)) == (artifact, False)
    assert dynamo_code._called(compiled_fn(wrap(artifact))) == (artifact, True)
    wrapper = other(artifact)
    assert dynamo_code._called(compiled_fn(wrapper)) == (wrapper, False)
    assert dynamo_code._called(None) == (None, False)


@torch.no_grad()
def test_the_cache_entry_is_the_one_calling_the_artifact():
    fn, artifacts = armed(Linear(), X)
    code, globals_ = Linear.forward.__code__, Linear.forward.__globals__
    entry = dynamo_code.cache_entry(code, globals_, artifacts[0])
    assert entry.torch_function_disabled is False and type(entry.guard_manager).__name__ == "GuardManagerWrapper"
    assert dynamo_code.unsafe_instruction(entry.code, artifacts[0].graph_inputs.sources, []) is None
    assert dynamo_code.cache_entry(code, globals_, object()) is None
    assert dynamo_code.cache_entry(code, globals_, None) is None  # no artifact: no entry, not the first one
    names = [n for n in dynamo_code._global_names(entry.code) if n.startswith("__compiled_fn")]
    assert dynamo_code.cache_entry(code, {k: v for k, v in globals_.items() if k not in names}, artifacts[0]) is None


# ---------------------------------------------------------------- gathering


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.register_buffer("b", torch.ones(2))


def _gathering(sources, module=None, a=(), k=None):
    namespace = {"S": module or _Two()}
    exprs = {"x": "a[0]", "y": "k['y']", "self": "S", "cfg": "a[1]"}
    return Gathering.of(sources, exprs, namespace, a, k or {}), namespace


W, B, BUF = ("L['self']._modules['a']._parameters['weight']", "L['self']._modules['a']._parameters['bias']",
             "L['self']._buffers['b']")


def test_module_state_is_gathered_once_in_runs_and_the_rest_per_call():
    module, x, y = _Two(), torch.ones(1), torch.zeros(1)
    cfg = types.SimpleNamespace(_parameters={"w": torch.ones(1)})  # walks `_parameters`, but of no module
    sources = ["L['x']", W, B, "L['x'].size()[0]", BUF, "L['y']", "L['cfg']._parameters['w']"]
    gathering, namespace = _gathering(sources, module, (x, cfg), {"y": y})
    assert gathering.state == (1, 2, 4) and gathering.per_call == (0, 3, 5, 6) and gathering.roots == ("self",)
    assert gathering.expressions[:2] == ("a[0]", "S._modules['a']._parameters['weight']")
    assert namespace["T0"] == (module.a.weight, module.a.bias) and namespace["T1"] == (module.b,)
    assert "T2" not in namespace
    built = gathering.build(namespace)((x, cfg), {"y": y})
    assert built == (x, module.a.weight, module.a.bias, 1, module.b, y, cfg._parameters["w"])


def test_the_gathering_concatenates_where_that_copies_less_and_unpacks_elsewhere():
    late = _gathering(["L['x']", W, B, BUF, W, B, BUF, W, B, BUF])[0]  # one loose input, then a run of 9
    assert late._lines() == ["    A = (a[0],) + T0"]
    # alternating: 1 + 1 + ... copies 2+3+4+5+6 = 20 references, unpacking about 3 per input (18)
    alternating = _gathering([W, "L['x']", B, "L['y']", BUF, "L['x']"])[0]
    assert alternating._lines() == ["    A = (*T0, a[0], *T1, k['y'], *T2, a[0],)"]
    # at the bound (copied == 3 * inputs): unpacking
    bound = _gathering(["L['x']", W, "L['y']", B, "L['x']", BUF])[0]
    assert bound._lines() == ["    A = (a[0], *T0, k['y'], *T1, a[0], *T2,)"]
    # 1+1+1+1+1 (n = 5): the later prefixes copy 2+3+4+5 = 14 < 15 (the first prefix copies nothing)
    assert _gathering(["L['x']", W, "L['y']", B, "L['x']"])[0]._lines() == ["    A = (a[0],) + T0 + (k['y'],) + T1 + (a[0],)"]
    # 2+1+1+1+1 (n = 6): 3+4+5+6 = 18, exactly 3 * 6: unpacking
    assert _gathering(["L['x']", "L['y']", W, "L['x']", B, "L['y']"])[0]._lines() == [
        "    A = (a[0], k['y'], *T0, a[0], *T1, k['y'],)"]
    assert _gathering(["L['x']", "L['y']"])[0]._lines() == ["    A = (a[0], k['y'],)"]
    assert _gathering([W, B])[0]._lines() == ["    A = T0"]
    for gathering, namespace in (_gathering(["L['x']", W, B, BUF] * 3), _gathering([W, "L['x']", B, "L['y']"])):
        gathering.build(namespace)((1,), {"y": 2})


def test_fill_writes_the_per_call_inputs_only_and_checks_before_and_after_gathering():
    module = _Two()
    gathering, namespace = _gathering(["L['x']", W, "L['y']"], module)
    namespace["LIMIT"] = 5
    before = Check("x is small", "a[0] < LIMIT", True)
    after = Check("y is gathered odd", "A[2] % 2 == 1")
    fill = gathering.fill([before, after], namespace)
    kept = ["old", "state", "old"]
    assert fill((1,), {"y": 3}, kept) is kept and kept == [1, "state", 3]  # the state position is not written
    assert fill((1,), {"y": 4}, kept) is None and kept == [1, "state", 4]
    assert fill((9,), {}, kept) is None  # the check before gathering fails first: `k['y']` is never read
    gather = gathering.gather([before, after], namespace)
    # named as what they do: a profile or a traceback of a direct call shows these names
    assert (fill.__name__, gather.__name__, gathering.build(namespace).__name__) == ("fill", "gather", "build")
    assert gather((1,), {"y": 3}) == (1, module.a.weight, 3)
    assert gather((1,), {"y": 4}) is None and gather((9,), {}) is None
    assert gathering.gather([], namespace)((1,), {"y": 4}) == (1, module.a.weight, 4)
    with pytest.raises(KeyError):
        gathering.gather([after], namespace)((9,), {})


# ---------------------------------------------------------------- route


class _Artifact:
    graph_inputs = object()


def test_one_served_graph_with_recorded_inputs_is_required():
    art = _Artifact()
    assert route._served([Served(art, (), None)]).artifact is art
    for calls, why in (([], "no ascend_graph graph ran"), ([Served(art, (), None)] * 2, "2 ascend_graph graphs ran"),
                       ([Served(object(), (), None)], "1 ascend_graph graphs ran")):
        with pytest.raises(route.Refused) as refused:
            route._served(calls)
        assert str(refused.value) == f"{why} in the call (a graph break, or a graph without attention)"
        assert refused.value.permanent and refused.value.stores == ()


def test_the_return_value_is_made_of_the_graphs_outputs():
    a, b, c = torch.ones(1), torch.zeros(1), torch.ones(2)
    outs = (a, b, a)
    assert route._output_recipe(b, outs)(["A", "B", "C"]) == "B"
    assert route._output_recipe(a, outs)(["A", "B", "C"]) == "A"  # the first output it is
    assert route._output_recipe((b, [None, a]), outs)(["A", "B", "C"]) == ("B", [None, "A"])
    assert route._output_recipe(None, outs)(["A", "B", "C"]) is None
    for result, what in ((c, "Tensor"), ((a, 3), "int"), ([a, "s"], "str")):
        with pytest.raises(route.Refused, match=f"^the step returns a {what} that is not one of its graph's outputs$"):
            route._output_recipe(result, outs)
    assert route._same(a, a) and not route._same(a, a.clone()) and route._same(3, 3)
    assert not route._same(1, True) and not route._same(1, 1.0) and not route._same(1, 2)


_GLOBAL_BOX = types.SimpleNamespace(n="global")


class _StoreHost:
    flag = "host"

    def step(this, x, other=types.SimpleNamespace(n="default")):
        return x


def test_constant_stores_are_read_before_the_call_and_must_hold_their_value():
    box = types.SimpleNamespace(flag=True)

    def step(x, box, other=None):
        return x

    frame, stores = frame_of(step), [ConstantStore("L['box']", "flag", True), ConstantStore("L['other']", "n", 1)]
    assert route.read_stores(frame, (2, ()), stores, (1, box), {}) == {("L['box']", "flag"): True,
                                                                       ("L['other']", "n"): MISSING}
    assert route.read_stores(frame, (1, ("box",)), stores[:1], (1,), {"box": 5}) == {("L['box']", "flag"): MISSING}
    assert route.read_stores(frame, (4, ()), stores, (1, box, 2, 3), {}) == {}  # the layout does not bind
    host = _StoreHost()
    reached = [ConstantStore("L['this']", "flag", 1), ConstantStore("L['other']", "n", 2),
               ConstantStore("G['_GLOBAL_BOX']", "n", 3), ConstantStore("L['x'].inner", "n", 4)]
    assert route.read_stores(frame_of(host.step), (1, ()), reached, (box,), {}) == {
        ("L['this']", "flag"): "host", ("L['other']", "n"): "default", ("G['_GLOBAL_BOX']", "n"): "global",
        ("L['x'].inner", "n"): MISSING}  # through the bound object, a default, a global; a target not there
    route._check_stores([], None)
    for before in (None, {("L['box']", "flag"): True}):
        with pytest.raises(route.Refused) as refused:
            route._check_stores(stores, before)
        assert str(refused.value) == "its constant stores are read before the next call through dynamo"
        assert not refused.value.permanent and refused.value.stores == tuple(stores)
    route._check_stores(stores, {("L['box']", "flag"): True, ("L['other']", "n"): 1})
    with pytest.raises(route.Refused, match=r"^the step changes L\['other'\].n on every call$") as refused:
        route._check_stores(stores, {("L['box']", "flag"): True, ("L['other']", "n"): 2})
    assert refused.value.permanent


@torch.no_grad()
def test_arming_refuses_what_dynamo_passed_otherwise_or_its_code_and_guards():
    model = Linear()
    fn, artifacts = armed(model, X)
    art = artifacts[0]
    frame, inputs = frame_of(model), art.graph_inputs
    args = [model.lin.weight, model.lin.bias, 3, X, model.shift]
    result = art.gm(*args)

    def refusal(served_args=args, key=(1, ()), call=(X,), policy=None, **changes):
        art.graph_inputs = dataclasses.replace(inputs, **changes)
        try:
            with pytest.raises(route.Refused) as refused:
                route.arm(frame, key, [Served(art, served_args, result)], call, {}, result, guard_policy=policy)
        finally:
            art.graph_inputs = inputs
        return str(refused.value)

    assert isinstance(route.arm(frame, (1, ()), [Served(art, args, result)], (X,), {}, result), route.Route)
    assert refusal(refusal="dynamo wrapped a tensor") == "dynamo wrapped a tensor"
    assert refusal(key=(3, ())) == "3 positional arguments; Linear.forward takes 2"
    assert refusal(args[:4]) == "dynamo passed 4 inputs, the sources name 5"
    assert refusal([*args[:4], model.shift.clone()]) == (
        "L['self']._buffers['shift'] gathers a Tensor where dynamo passed a Tensor")
    assert refusal([*args[:2], 3.0, *args[3:]]) == "L['x'].size()[0] gathers a int where dynamo passed a float"
    assert refusal(sources=(*inputs.sources, "L['zz']")) == (
        "the source L['zz'] reads 'zz', not an argument of Linear.forward")
    assert refusal(stores=(ConstantStore("L['zz']", "flag", True),)).startswith(
        "dynamo's code for Linear.forward does more than call the graph: ")
    seen = []
    assert refusal(policy=lambda guards: seen.append(guards) or "guards on globals") == "guards on globals"
    assert type(seen[0]).__name__ == "GuardManagerWrapper"
    assert isinstance(route.arm(frame, (1, ()), [Served(art, args, result)], (X,), {}, result,
                                guard_policy=lambda guards: None), route.Route)

    def elsewhere(self, x, scale=2.0):
        return x

    with pytest.raises(route.Refused, match=r"^dynamo's code calling this graph is not cached for "):
        route._check_code(frame_of(types.MethodType(elsewhere, model)), art, inputs, {"x": "a[0]", "self": "S"})


class _Recording:
    """An artifact recording, per direct call, its arguments and whether subclass dispatch was on."""

    def __init__(self, route_=None):
        self.calls, self.inner = [], None

    def call_direct(self, args, fixed=None):
        self.calls.append((list(args), torch._C._is_torch_function_enabled()))
        self.fixed = fixed
        if self.inner is not None:
            inner, self.inner = self.inner, None
            inner()
        return args[0]


def test_a_route_fills_its_list_unless_another_call_holds_it_and_says_why_it_falls_back():
    sentinel = object()
    namespace = {"LIMIT": 5, "T0": (sentinel,)}
    gathering = Gathering(("a[0]", "S"), (1,), (0,), ("self",))
    check = Check("x is small", "a[0] < LIMIT", True)
    art = _Recording()
    made = Route = route.Route(art, gathering.gather([check], namespace), gathering.build(namespace), [check], namespace,
                               lambda outs: outs, fixed=frozenset({1}), fill=gathering.fill([check], namespace),
                               graph_args=[0, sentinel])
    assert made((1,), {}) == 1 and made._args == [1, sentinel] and made.used and art.fixed == frozenset({1})
    art.inner = lambda: made((2,), {})  # a call inside a call: a fresh tuple, the outer's list untouched
    assert made((3,), {}) == 3 and made._args == [3, sentinel]
    assert [args for args, _ in art.calls] == [[1, sentinel], [3, sentinel], [2, sentinel]]
    with pytest.raises(route.Fallback) as why:
        made((7,), {})
    assert (why.value.kind, why.value.detail, str(why.value)) == ("x is small", "", "x is small")
    assert str(route.Fallback("kind", "detail")) == "kind: detail"
    failed = made.explain((1,), {})
    assert (failed.kind, failed.detail, str(failed)) == ("a check failed", "", "a check failed")
    broken = route.Route(art, lambda a, k: None, lambda a, k: a[5], [check], namespace, lambda outs: outs)
    fell = broken.explain((1,), {})
    assert (fell.kind, fell.detail) == ("the graph's inputs could not be gathered", "IndexError: tuple index out of range")
    plain = route.Route(art, gathering.gather([check], namespace), gathering.build(namespace), [check], namespace,
                        lambda outs: outs, torch_function_disabled=True)
    assert plain.used is False and plain((4,), {}) == 4 and art.calls[-1] == ([4, sentinel], False)
    assert plain.used is True and art.fixed == frozenset()
    by_keyword = Gathering(("k['y']", "S"), (1,), (0,), ("self",))  # no list to fill: gathered afresh each call
    keyword = route.Route(art, by_keyword.gather([], namespace), by_keyword.build(namespace), [], namespace,
                          lambda outs: outs)
    assert keyword((), {"y": 6}) == 6 and art.calls[-1][0] == [6, sentinel]
    disabled = route.Route(art, gathering.gather([check], namespace), gathering.build(namespace), [check], namespace,
                           lambda outs: outs, True, frozenset({1}))
    assert disabled((2,), {}) == 2 and art.fixed == frozenset({1}) and art.calls[-1] == ([2, sentinel], False)
    assert art.calls[0][1] is True  # dispatch on where dynamo's graph runs with it on


# ---------------------------------------------------------------- checks


def test_no_route_is_armed_in_a_state_a_direct_call_cannot_serve():
    with torch.no_grad():
        assert checks.arming_refusal() is None
        with torch.compiler.set_stance("force_eager"):
            assert checks.arming_refusal() == "torch.compiler stance 'force_eager'"
        with torch.compiler.set_stance("default", force_backend="eager"):
            assert checks.arming_refusal() == "torch.compiler stance 'default' (a forced backend)"
        for stance in ("eager_on_recompile", "fail_on_recompile"):
            with torch.compiler.set_stance(stance):
                assert checks.arming_refusal() is None
        handle = nn.modules.module.register_module_forward_hook(lambda *_: None)
        try:
            assert checks.arming_refusal() == "global module hooks are registered"
        finally:
            handle.remove()
        with forward_ad.dual_level():
            assert checks.arming_refusal() == "a functorch transform or forward-AD level is active"
        seen = []
        torch.func.vmap(lambda t: seen.append(checks.arming_refusal()) or t)(torch.ones(2, 1))
        assert seen == ["a functorch transform or forward-AD level is active"]
    with torch.enable_grad():
        assert checks.arming_refusal() == "grad mode is on (direct calls serve inference: no autograd)"


class _Loader(nn.Parameter):
    """A Parameter subclass with methods only (vLLM's parameter classes)."""


class _Wrapper(torch.Tensor):
    pass


def test_tensor_subclasses_are_refused_but_a_parameter_class_gathered_once():
    plain, loader = torch.ones(1), _Loader(torch.ones(1), requires_grad=False)
    checks._plain([plain, nn.Parameter(torch.ones(1)), nn.Buffer(torch.ones(1)), 3, loader], list("abcde"), (4,))
    with pytest.raises(checks.Unarmable, match="^e is a _Loader, a tensor subclass$"):
        checks._plain([plain, loader], ["d", "e"], (0,))
    with pytest.raises(checks.Unarmable, match="^w is a _Wrapper, a tensor subclass$"):
        checks._plain([torch.ones(1).as_subclass(_Wrapper)], ["w"], (0,))
    with pytest.raises(checks.Unarmable, match="^w is a _Wrapper, a tensor subclass$"):  # after an excepted one
        checks._plain([loader, torch.ones(1).as_subclass(_Wrapper)], ["e", "w"], (0,))
    from torch.testing._internal.two_tensor import TwoTensor
    wrapped = nn.Parameter(TwoTensor(torch.ones(1), torch.ones(1)), requires_grad=False)
    with pytest.raises(checks.Unarmable, match="^t is a .*, a tensor subclass$"):
        checks._plain([wrapped], ["t"], (0,))


def test_modules_are_each_listed_once():
    shared = nn.Linear(1, 1)
    one, two = nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared)
    tree = checks._tree([one, two])
    assert tree == [one, shared, one[1], two]


def test_shape_guards_are_written_over_the_call_leaving_out_what_holds_by_construction():
    gathering = Gathering(("a[0]", "T0x", "a[0].size()[0]", "a[1]"), (1,), (0, 2, 3), ("self",))
    inputs = graph_inputs.GraphInputs(("L['x']", "L['self'].w", "L['x'].size()[0]", "L['y']"), (), (),
                                      (("L['z']", (None,), (1,)),), (), None)
    inputs.__dict__["shape_guards"] = (
        "A[0].size()[0] == A[3].size()[0]", "A[0].size()[0] == A[3].size()[0]", "A[2] == a[0].size()[0]",
        "A[1].size()[0] == 2", "A[4].size()[0] <= 8", "0 <= A[3].size()[0]", "2 <= A[3].size()[0]")
    made = checks._shape_guards(inputs, {"x": "a[0]", "y": "a[1]", "z": "k['z']"}, gathering)
    assert [(c.description, c.expr) for c in made] == [
        ("dynamo's shape guard L['x'].size()[0] == L['y'].size()[0] fails", "a[0].size()[0] == a[1].size()[0]"),
        ("dynamo's shape guard L['self'].w.size()[0] == 2 fails", "A[1].size()[0] == 2"),
        ("dynamo's shape guard L['z'].size()[0] <= 8 fails", "k['z'].size()[0] <= 8"),
        ("dynamo's shape guard 2 <= L['y'].size()[0] fails", "2 <= a[1].size()[0]")]
    assert all(not c.before_gather for c in made)


# ---------------------------------------------------------------- graph_inputs


def _record(fn, *args, dynamic=None):
    """What `graph_inputs.record` keeps of `fn`'s graph, asked from the backend."""
    seen = []

    def grab(gm, example_inputs):
        seen.append(graph_inputs.record(gm))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab, fullgraph=True, dynamic=dynamic)(*args)
    return seen[0]


def _cast(x, like):
    return x.to(like.dtype) + 1


def _twice(x, y):
    return x + y


def _numpy(x, arr):
    return x + torch.from_numpy(arr)


def _scaled(x, scale):
    return x * scale


def test_the_record_keeps_each_placeholders_source_and_the_tensors_read_for_metadata():
    like = torch.empty_strided((3, 2), (1, 3), dtype=torch.float64)
    inputs = _record(_cast, torch.ones(3), like)
    assert inputs.sources == ("L['x']",) and inputs.static_sizes == ((3,),) and inputs.static_strides == ((1,),)
    assert inputs.unread == (("L['like']", (3, 2), (1, 3)),) and inputs.refusal is None
    assert inputs.shape_guards == ()
    x, y = torch.ones(4), torch.ones(4)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 0)
    inputs = _record(_twice, x, y)
    assert inputs.static_sizes == (None, (None,), (None,)) or None in inputs.static_sizes[1]
    assert inputs.refusal is None and any("A[" in g and "==" in g for g in inputs.shape_guards)
    assert inputs.static_strides[-1] == (1,)
    inputs = _record(_numpy, torch.ones(2), np.ones(2, dtype=np.float32))
    assert inputs.refusal == ("dynamo passes ___from_numpy(L['arr']) as a tensor it makes from a Python number on "
                              "each call")


def test_a_python_number_passed_as_a_tensor_is_refused():
    with torch._dynamo.config.patch(specialize_float=False):
        inputs = _record(_scaled, torch.ones(2), 0.5, dynamic=True)
    assert inputs.refusal == "dynamo passes L['scale'] as a tensor it makes from a Python number on each call"


# ---------------------------------------------------------------- side_effects


def _hooks(x):
    x.register_hook(lambda g: g * 2)
    return x * 2


def test_a_tensor_hook_refuses_the_direct_call():
    seen = []

    def grab(gm, example_inputs):
        seen.append(side_effects.record())
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_hooks, backend=grab, fullgraph=True)(torch.ones(2, requires_grad=True))
    assert seen == [((), "the step registers tensor hooks or saves tensors for backward")]


class _Box:
    """A plain object a step writes an attribute of."""


def _stores_a_flag(box, x):
    box.flag = True
    return x + 1


@stores_readable
def test_a_frame_ending_in_return_const_is_a_frame_end():
    """Python 3.12 on returns a constant with RETURN_CONST: the frame's end, as RETURN_VALUE is (dynamo's
    translator as it stands at such a return, built here on any Python)."""
    from torch._dynamo import symbolic_convert
    seen = []

    def grab(gm, example_inputs):
        tx = symbolic_convert.tls.current_tx
        real = tx.current_instruction
        for opname in ("RETURN_CONST", "RETURN_VALUE", "CALL"):
            tx.current_instruction = dataclasses.replace(real, opname=opname)
            seen.append(side_effects.record())
        tx.current_instruction = real
        return gm.forward

    torch._dynamo.reset()
    box = _Box()
    torch.compile(_stores_a_flag, backend=grab, fullgraph=True)(box, torch.ones(2))
    stored = ((ConstantStore("L['box']", "flag", True),), None)
    assert seen == [stored, stored, ((), "the graph was compiled at a graph break (CALL)")]


def test_a_graph_not_compiled_by_dynamo_is_refused_saying_what_is_missing():
    traced = torch.fx.symbolic_trace(_twice)  # placeholders with no source, and no dynamo frame
    inputs = graph_inputs.record(traced)
    assert inputs.sources == ("", "") and inputs.refusal == "placeholder x has no source dynamo recorded"
    assert inputs.static_sizes == (None, None) and inputs.unread == () and inputs.stores == ()
    constant = torch.fx.symbolic_trace(lambda: torch.ones(1))
    assert graph_inputs.record(constant).refusal == "dynamo's record of the tensors it wrapped is not readable"


def test_a_symbolic_graph_whose_shape_environment_is_out_of_reach_is_refused(monkeypatch):
    seen = []

    def grab(gm, example_inputs):
        with monkeypatch.context() as patched:
            patched.setattr(torch._guards.TracingContext, "try_get", staticmethod(lambda: None))
            seen.append(graph_inputs.record(gm))
        seen.append(graph_inputs.record(gm))
        return gm.forward

    torch._dynamo.reset()
    x, y = torch.ones(4), torch.ones(4)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 0)
    torch.compile(_twice, backend=grab, fullgraph=True)(x, y)
    assert seen[0].refusal == "the graph's shape environment is not reachable from the backend"
    assert seen[0].shape_guards == () and seen[1].refusal is None and seen[1].shape_guards


def _scaled_by_count(x, n):
    return x * n


@pytest.mark.parametrize("fn, args, symbolic", [
    (_twice, (torch.ones(4), torch.ones(4)), False),  # static: no shape environment needed
    (_scaled_by_count, (torch.tensor(2.0), 5), True),  # a 0-dim tensor and a symbolic int only
])
def test_only_a_symbolic_graph_needs_its_shape_environment(monkeypatch, fn, args, symbolic):
    seen = []

    def grab(gm, example_inputs):
        with monkeypatch.context() as patched:
            patched.setattr(torch._guards.TracingContext, "try_get", staticmethod(lambda: None))
            seen.append(graph_inputs.record(gm))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab, fullgraph=True, dynamic=symbolic)(*args)
    assert seen[0].refusal == ("the graph's shape environment is not reachable from the backend" if symbolic else None)


def _prefix_of(x, like):
    return x[: like.shape[0]] * 2


def test_the_shape_guards_cover_the_sizes_of_a_tensor_read_for_its_size_alone():
    """`like` is wrapped for its size, never passed: its guard (`A[3]`, after the three placeholders) is kept."""
    inputs = _record(_prefix_of, torch.ones(8), torch.ones(3), dynamic=True)
    assert inputs.unread == (("L['like']", (None,), (1,)),) and len(inputs.sources) == 3
    assert "A[3].size()[0] == A[0]" in inputs.shape_guards and "A[0] <= A[1]" in inputs.shape_guards


class _Scaling(torch.overrides.TorchFunctionMode):
    """A mode holding a tensor: dynamo reads it through one of its own helpers."""

    def __init__(self, tensor, use):
        super().__init__()
        self.tensor, self.use = tensor, use

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return self.use(out, self.tensor) if func is torch.Tensor.add else out


def _plus_one(x):
    return x + 1


def test_tensors_dynamo_reaches_through_its_own_helpers_are_refused():
    with _Scaling(torch.full((2,), 3.0), lambda out, t: out * t):
        inputs = _record(_plus_one, torch.ones(2))
    assert inputs.sources[1] == "___get_torch_function_mode_stack_at(0).tensor"
    assert inputs.refusal == ("the source of _get_torch_function_mode_stack_at_0_tensor "
                              "(___get_torch_function_mode_stack_at(0).tensor) calls one of dynamo's own helpers")
    with _Scaling(torch.zeros(1, dtype=torch.float64), lambda out, t: out.to(t.dtype)):  # read for its dtype alone
        inputs = _record(_plus_one, torch.ones(2))
    assert inputs.sources == ("L['x']",) and inputs.unread == ()
    assert inputs.refusal == "dynamo wrapped a tensor from ___get_torch_function_mode_stack_at(0).tensor (one of its own helpers)"
