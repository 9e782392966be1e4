"""`ascend_compile.compile(..., dispatch="direct")`: calls after the first skip dynamo's frame hook and
guards, and what dynamo's guards would have caught is caught by the direct checks (the call then goes
through dynamo, which reuses its graph or compiles another), or is a documented limitation.

Whether a call went through dynamo is seen with the artifact's probe (`lowering/served.py`): the
artifact reports calls dynamo makes, not direct ones.
"""
from __future__ import annotations

import copy
import functools
import logging
import types

import pytest
import torch

import ascend_compile
from ascend_compile import CompileConfig, backend
from ascend_compile.lowering import served
from examples.llama import DecoderLayer, LlamaConfig, PagedBatch, build

CFG = LlamaConfig(num_layers=1, num_blocks=256)
OPTIONS = dict(max_model_len=256, capture_sizes=(4, 8, 16), runtime="sim")


def compiled(model, **options):
    """`model` compiled with dispatch="direct", and the list its artifacts are appended to."""
    torch._dynamo.reset()
    artifacts = []
    fn = ascend_compile.compile(model, backend=backend(CompileConfig(**OPTIONS, **options),
                                                       on_compiled=artifacts.append), dispatch="direct")
    return fn, artifacts


def call(fn, step):
    """(the call's result, whether it went through dynamo)."""
    with served.probe() as calls:
        result = fn(**step)
    return result, bool(calls)


def armed(model, **options):
    """`model` compiled, called once through dynamo and once directly; and a batch for more steps."""
    fn, artifacts = compiled(model, **options)
    batch = PagedBatch(CFG, seed=1)
    assert call(fn, batch.step([5, 30, 9]))[1]
    assert not call(fn, batch.step([7, 3]))[1]
    return fn, artifacts, batch


def close(a, b):
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_direct_calls_equal_eager_and_skip_dynamo():
    model, reference = build(CFG), build(CFG)
    fn, artifacts = compiled(model)
    batch = PagedBatch(CFG, seed=3)
    went = []
    for lens, query_lens in [([37], None), ([5, 80, 17, 250, 3, 64], None), ([45], [5]), ([30, 9, 100], [3, 1, 4]),
                             ([12, 7], None)]:
        step = batch.step(lens, query_lens)
        result, through_dynamo = call(fn, step)
        close(result, reference(**step))
        went.append(through_dynamo)
    assert went == [True, False, False, False, False] and len(artifacts) == 1
    positional = batch.step([9, 4])  # another layout of arguments: its own route, armed through dynamo once
    assert call(lambda **s: fn(*s.values()), positional)[1]
    close(call(lambda **s: fn(*s.values()), positional)[0], reference(**positional))


@torch.no_grad()
def test_grad_mode_enabled_runs_the_graph_as_traced():
    """Dynamo's guard on grad mode compiles another graph, whose parameters require grad: the backend
    runs it as traced (autograd kept), and the route armed under no_grad stays for later calls."""
    model, reference = build(CFG), build(CFG)
    fn, artifacts, batch = armed(model)
    step = batch.step([5, 9])
    with torch.enable_grad():
        result, served_by_an_artifact = call(fn, step)
        expected = reference(**step)
    assert not served_by_an_artifact and len(artifacts) == 1 and result.requires_grad
    close(result.detach(), expected.detach())
    went = [call(fn, batch.step(lens))[1] for lens in ([6, 2], [3, 9, 1])]
    assert went == [False, False]
    assert len(artifacts) == 1


@torch.no_grad()
def test_an_input_of_another_dtype_goes_through_dynamo(caplog):
    model, reference = build(CFG), build(CFG)
    fn, artifacts, batch = armed(model)
    step = batch.step([5, 9])
    step["input_ids"] = step["input_ids"].to(torch.int32)
    with caplog.at_level(logging.INFO, logger="ascend_compile"):
        result, through_dynamo = call(fn, step)
    assert through_dynamo and len(artifacts) == 2
    close(result, reference(**step))
    # the first check failing is named, with what differs (`Route.explain`: `Check.holds`, `Check.detail`)
    assert ("a tensor argument's type, dtype, device, requires_grad, static size or stride differs: this call goes "
            "through dynamo's guards (tensor 'L['input_ids']' dtype mismatch. expected Long, actual Int)") in caplog.text


class _Flagged(torch.nn.Module):
    """Logits doubled on `flag is True` (a constant checked by type and value), cast to `like`'s and
    `other`'s dtype (tensors the graph does not take: their checks read them from the call's arguments)."""

    def __init__(self):
        super().__init__()
        self.model = build(CFG)

    def forward(self, input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping, flag, like, other):
        out = self.model(input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping).to(like.dtype)
        out = out.to(other.dtype)
        return out * 2 if flag is True else out


@torch.no_grad()
def test_a_later_check_failing_is_named_for_positional_arguments(caplog):
    """`Route.explain` evaluates the checks up to the first failing one (`Check.holds`) over a call's
    positional arguments `a`, keyword arguments `k` and the gathered `A`, and names it with what differs
    (`Check.detail`, over all three), nothing where the check says no more: the constant's check, after
    the ambient ones; the tensor check, after the aliasing check. mutmut's `Check.holds` and
    `Check.detail` survivors fail here."""
    model, reference = _Flagged(), _Flagged()
    fn, artifacts = compiled(model)
    batch = PagedBatch(CFG, seed=1)
    went, like, other = [], torch.zeros(2), torch.zeros(3)
    with caplog.at_level(logging.DEBUG, logger="ascend_compile"):
        for lens, flag, dtype in (([5, 30, 9], True, torch.long), ([7, 3], True, torch.long), ([5, 9], 1, torch.long),
                                  ([6, 2], 1, torch.long), ([3, 4], 1, torch.int32)):
            step = batch.step(lens)
            step["input_ids"] = step["input_ids"].to(dtype)
            result, through_dynamo = call(lambda **s: fn(*s.values(), flag, like, other=other), step)
            close(result, reference(**step, flag=flag, like=like, other=other))
            went.append(through_dynamo)
    assert went == [True, False, True, False, True] and len(artifacts) == 3
    why = [m.removeprefix("ascend_compile: dispatch='direct': ") for m in caplog.messages if "goes through" in m]
    assert why == ["argument 'flag' differs from the traced call's: this call goes through dynamo's guards",
                   "a tensor argument's type, dtype, device, requires_grad, static size or stride differs: this call "
                   "goes through dynamo's guards (tensor 'L['input_ids']' dtype mismatch. expected Long, actual Int)"]


@torch.no_grad()
def test_a_replaced_parameter_is_seen():
    model, reference = build(CFG), build(CFG)
    fn, artifacts, batch = armed(model)
    weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    model.lm_head.weight, reference.lm_head.weight = weight, torch.nn.Parameter(weight.detach().clone())
    step = batch.step([5, 9])
    result, through_dynamo = call(fn, step)
    assert through_dynamo  # the module-assignment count moved; the runner re-captures for the new address
    close(result, reference(**step))
    step = batch.step([11, 2, 7])
    result, through_dynamo = call(fn, step)
    assert not through_dynamo  # armed again, with the new parameter gathered
    close(result, reference(**step))


@torch.no_grad()
def test_a_swapped_module_is_seen():
    model, reference = build(CFG), build(CFG)
    fn, artifacts, batch = armed(model)
    torch.manual_seed(5)
    layer = DecoderLayer(CFG)
    for p in layer.parameters():
        p.data.normal_(std=0.05)
    model.layers[0], reference.layers[0] = layer, copy.deepcopy(layer)
    step = batch.step([5, 9])
    result, through_dynamo = call(fn, step)
    assert through_dynamo
    close(result, reference(**step))
    assert not call(fn, batch.step([3, 3]))[1]


@torch.no_grad()
def test_a_parameter_moved_in_place_goes_through_dynamo():
    """`p.data = t` runs no hook: the runner's address check sees it, and the step goes through
    dynamo (whose guards would see a new dtype or size with it) instead of being re-captured directly."""
    model, reference = build(CFG), build(CFG)
    fn, artifacts, batch = armed(model)
    for m in (model, reference):
        m.lm_head.weight.data = m.lm_head.weight.data * 2
    step = batch.step([5, 9])
    result, through_dynamo = call(fn, step)
    assert through_dynamo and artifacts[0].stats["recaptures"] == 1
    close(result, reference(**step))
    assert not call(fn, batch.step([4, 8]))[1]


@torch.no_grad()
def test_training_mode_goes_through_dynamo():
    model, reference = build(CFG), build(CFG)
    fn, artifacts, batch = armed(model)
    model.train()
    step = batch.step([5, 9])
    result, through_dynamo = call(fn, step)
    assert through_dynamo
    close(result, reference(**step))


@torch.no_grad()
def test_a_call_hook_goes_through_dynamo():
    model, reference = build(CFG), build(CFG)
    fn, artifacts, batch = armed(model)
    seen = []
    model.register_forward_hook(lambda module, args, kwargs, output: seen.append(output.shape), with_kwargs=True)
    step = batch.step([5, 9])
    result, through_dynamo = call(fn, step)
    assert through_dynamo and seen == [result.shape]
    close(result, reference(**step))


@torch.no_grad()
def test_sizes_that_disagree_go_through_dynamo():
    """dynamo's shape guards are checked: ids and positions of different lengths fail as through dynamo."""
    fn, artifacts, batch = armed(build(CFG))
    step = batch.step([5, 9])
    step["positions"] = step["positions"][:1]
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError):
        fn(**step)


class Scaled(torch.nn.Module):
    """The example model with a Python argument the trace specialises on."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping, scale=1.0):
        logits = self.model(input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping)
        return logits * scale if scale != 1.0 else logits


@torch.no_grad()
def test_another_value_of_an_argument_the_graph_does_not_read_goes_through_dynamo():
    model, reference = Scaled(build(CFG)), Scaled(build(CFG))
    fn, artifacts, batch = armed(model)
    step = dict(batch.step([5, 9]), scale=2.0)
    result, through_dynamo = call(fn, step)
    assert through_dynamo and len(artifacts) == 2
    close(result, reference(**step))


@torch.no_grad()
def test_a_changed_python_attribute_is_not_seen_until_recheck():
    """The documented limitation: Python values the model reads (an RMSNorm's eps) are constants of
    the trace; a direct call does not compare them, `recheck()` sends the next call through dynamo."""
    model, reference = build(CFG), build(CFG)
    traced = build(CFG)  # before the route is armed: building a model moves the module-assignment count
    fn, artifacts, batch = armed(model)
    model.norm.eps = reference.norm.eps = 0.5
    step = batch.step([5, 9])
    result, through_dynamo = call(fn, step)
    assert not through_dynamo
    close(result, traced(**step))  # the traced eps
    fn.recheck()
    step = batch.step([6, 2])
    result, through_dynamo = call(fn, step)
    assert through_dynamo and len(artifacts) == 2
    close(result, reference(**step))


class Counting(torch.nn.Module):
    """The example model counting its calls in a Python attribute: a side effect dynamo replays."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.calls = 0

    def forward(self, input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping):
        self.calls += 1
        return self.model(input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping)


class Breaking(Counting):
    """The example model with a graph break in its forward."""

    def forward(self, input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping):
        logits = self.model(input_ids, positions, block_table, seq_lens, query_start_loc, slot_mapping)
        torch._dynamo.graph_break()
        return logits + 0


@pytest.mark.parametrize("wrapper", [Counting, Breaking])
@torch.no_grad()
def test_side_effects_and_graph_breaks_keep_calls_on_dynamo(wrapper):
    model, reference = wrapper(build(CFG)), wrapper(build(CFG))
    fn, artifacts = compiled(model)
    batch = PagedBatch(CFG, seed=1)
    for lens in ([5, 30, 9], [7, 3], [4]):
        step = batch.step(lens)
        result, through_dynamo = call(fn, step)
        assert through_dynamo
        close(result, reference(**step))
    assert model.calls == reference.calls
    assert all(isinstance(route, str) for route in fn.dispatcher.routes.values())  # the refusal, once


@torch.no_grad()
def test_frozen_parameters_and_direct_dispatch_still_check_the_kv_caches():
    model, reference = build(CFG), build(CFG)
    fn, artifacts, batch = armed(model, frozen_parameters=True)
    for m in (model, reference):
        m.layers[0].attn.key_cache.data = m.layers[0].attn.key_cache.data.clone()
    step = batch.step([5, 9])
    result, through_dynamo = call(fn, step)
    assert through_dynamo and artifacts[0].stats["recaptures"] == 1
    close(result, reference(**step))


@torch.no_grad()
def test_concurrent_direct_callers_each_get_their_own_inputs():
    """A route writes a call's inputs into the argument list an earlier call left (`Route._fill`):
    a call running while another holds that list (another thread) must gather a list of its own,
    or its step runs on the other call's tokens. Switching threads every microsecond makes the
    calls interleave between gathering and the runner's lock."""
    import sys
    import threading

    from tests.test_backend import DisjointBatch

    cfg = LlamaConfig(num_layers=1, num_blocks=2048)
    model, reference = build(cfg), build(cfg)
    fn, _ = compiled(model, frozen_parameters=True)
    batch = DisjointBatch(cfg)
    steps = [batch.step(lens) for lens in ([5, 30, 9], [7, 3], [40, 2, 11, 6], [9], [3, 3, 3], [60, 1])]
    for step in steps[:2]:
        assert call(fn, step)[0] is not None and reference(**step) is not None
    assert not call(fn, batch.step([4, 8]))[1]  # the route is armed: later calls go straight to the graph
    errors = []

    def worker(items):
        try:
            with torch.no_grad():
                for step in items:
                    close(fn(**step), reference(**step))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(steps[2:] * 15,)) for _ in range(2)]
        threads += [threading.Thread(target=worker, args=(list(reversed(steps[2:])) * 15,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]


def test_dispatch_values_are_checked():
    with pytest.raises(ValueError, match="dispatch: expected one of"):
        ascend_compile.compile(build(CFG), dispatch="fast")


class _Box:
    """A plain object a step writes attributes of."""


def _recorded(fn, *args):
    """What `dispatch/side_effects.record` says of `fn`'s frame, asked from the backend as the direct
    route's backend asks it."""
    from ascend_compile.dispatch import side_effects
    seen = []

    def grab(gm, example_inputs):
        seen.append(side_effects.record())
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab, fullgraph=True)(*args)
    return seen[0]


def _flags(box, x):
    box.flag, box.name = True, "on"
    return x + 1


def _computed(box, x):
    box.total = x.sum()
    return x + 1


def _appends(items, x):
    items.append(1)
    return x + 1


def _class_store(box, x):
    _Box.count = 1
    return x + 1


def _made_and_dropped(box, x):
    box.scratch = 1
    del box.scratch
    box.flag = True  # recorded after the deletion that is nothing
    return x + 1


class _Slotted:
    __slots__ = ("flag",)


def _deletes_a_slot(obj, x):
    del obj.flag
    return x + 1


def _two_boxes(box, other, x):
    box.flag = True
    other.flag = False
    return x + 1


def _fills_and_empties_a_slot(obj, x):
    obj.flag = True
    del obj.flag
    return x + 1


def _deletes(box, x):
    del box.flag
    return x + 1


def test_side_effects_a_direct_call_may_replay_are_constant_attribute_stores_only():
    """`dispatch/side_effects.record`, the contract the route relies on: constants written into an
    existing object's instance dict are recorded (to be checked at each call); a computed value stored,
    a list mutated, a class attribute set, an attribute deleted refuse the direct call, naming what; an attribute added and
    deleted inside the frame is nothing. mutmut's survivors of `_stores_of` fail here."""
    import torch._dynamo.side_effects as dynamo_side_effects

    from ascend_compile.dispatch.side_effects import ConstantStore
    x = torch.ones(3)
    from ascend_compile.dispatch.side_effects import record
    assert record() == ((), "the graph was not compiled from a frame dynamo traced")  # asked outside dynamo
    if not hasattr(dynamo_side_effects, "AttrMutationKind"):  # torch 2.10: no record to read, every store refused
        stores, why = _recorded(_flags, _Box(), x)
        assert stores == () and why.startswith("dynamo's record of the step's side effects is not readable"), why
        return
    assert _recorded(_flags, _Box(), x) == (
        (ConstantStore("L['box']", "flag", True), ConstantStore("L['box']", "name", "on")), None)
    stores, why = _recorded(_computed, _Box(), x)
    assert stores == () and why.startswith("the step sets L['box'].total to ")
    assert _recorded(_appends, [], x) == ((), "the step mutates L['items']")
    assert _recorded(_class_store, _Box(), x) == ((), "the step mutates G['_Box']")  # a class: not an instance dict
    assert _recorded(_made_and_dropped, _Box(), x) == ((ConstantStore("L['box']", "flag", True),), None)
    slotted = _Slotted()
    slotted.flag = True  # held in a slot, not an instance dict: its deletion is a side effect all the same
    stores, why = _recorded(_deletes_a_slot, slotted, x)
    assert stores == () and why.startswith("the step sets L['obj'].flag to ")
    assert _recorded(_fills_and_empties_a_slot, _Slotted(), x) == ((), None)  # an empty slot: nothing happened
    assert _recorded(_two_boxes, _Box(), _Box(), x) == (
        (ConstantStore("L['box']", "flag", True), ConstantStore("L['other']", "flag", False)), None)  # each object's
    box = _Box()
    box.flag = True
    assert _recorded(_deletes, box, x) == ((), "the step sets L['box'].flag to DeletedVariable")  # what it is set to


class _Stepper(torch.nn.Module):
    def forward(self, x, y=2, *, z=3):
        return x


class _Host:
    def step(this, x, y):
        return x


def _plain(x, y=1):
    return x


def _varying(x, *rest):
    return x


def _keywords(x, **extra):
    return x


def test_a_frame_and_its_locals_per_layout():
    """`dispatch/frame.py`'s contract: what `frame_of` finds of a module, a bound method, a plain function
    and what dynamo does not trace (refused, saying why), and each local of a layout as an expression
    over `a`, `k`, `S` and `D`, or why calls of that layout do not bind (the words Route's refusal shows)."""
    from ascend_compile.dispatch.frame import Frame, frame_of, layout_key, local_expressions

    module = _Stepper()
    frame = frame_of(module)
    assert frame == Frame(_Stepper.forward, module, module, ("x", "y", "z"), {"y": 2, "z": 3})
    assert frame.self_name == "self"
    assert layout_key((1, 2), {"z": 4, "x": 5}) == (2, ("z", "x"))
    assert local_expressions(frame, (1, ("z",))) == {"x": "a[0]", "y": "D['y']", "z": "k['z']", "self": "S"}
    assert local_expressions(frame, (0, ("y", "x"))) == {"y": "k['y']", "x": "k['x']", "z": "D['z']", "self": "S"}
    assert local_expressions(frame, (3, ())) == {"x": "a[0]", "y": "a[1]", "z": "a[2]", "self": "S"}
    assert local_expressions(frame, (4, ())) == "4 positional arguments; _Stepper.forward takes 3"
    assert local_expressions(frame, (1, ("w",))) == "keyword 'w' does not bind to one parameter of _Stepper.forward"
    assert local_expressions(frame, (1, ("x",))) == "keyword 'x' does not bind to one parameter of _Stepper.forward"
    assert local_expressions(frame, (0, ("y",))) == "_Stepper.forward needs 'x'"
    host = _Host()
    frame = frame_of(host.step)
    assert frame == Frame(_Host.step, host, None, ("x", "y"), {}) and frame.self_name == "this"
    assert local_expressions(frame, (2, ())) == {"x": "a[0]", "y": "a[1]", "this": "S"}
    frame = frame_of(_plain)
    assert frame == Frame(_plain, None, None, ("x", "y"), {"y": 1}) and frame.self_name is None
    assert local_expressions(frame, (1, ())) == {"x": "a[0]", "y": "D['y']"}
    assert frame_of(_varying).refusal == "_varying takes *rest: its locals depend on the call"
    assert frame_of(_keywords).refusal == "_keywords takes *extra: its locals depend on the call"
    assert frame_of(_varying).names == ("x", "rest") and frame_of(_keywords).defaults == {}
    assert frame_of(torch.relu) == Frame(torch.relu, None, None, (), {},
                                         "builtin_function_or_method is not a Python function dynamo traces")
    module.forward = types.MethodType(functools.partial(_plain), module)  # bound, but no Python function's code
    assert frame_of(module) == Frame(module.forward.__func__, module, module, (), {},
                                     "partial is not a Python function dynamo traces")
