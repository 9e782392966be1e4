"""Graph memory known before any capture (`passes/memory_estimate.py`, `runtime/pool_model.py`): a
dynamo graph's allocations traced on its fake values, replayed over a model of a runtime's pool,
against what the simulator's own captures of the same graph reserve and hold."""
from __future__ import annotations

import pytest
import torch
from torch import fx

from ascend_compile.passes.fx_utils import example_value
from ascend_compile.passes.memory_estimate import pool_reserved, trace_allocations
from ascend_compile.runtime.pool_model import (CUDA_ROUND_LARGE, LARGE_BUFFER, NPU_ROUND_LARGE, SMALL_BUFFER,
                                               caching_allocator_model, one_kernel, pool_model, sim_pool_model)
from ascend_compile.runtime.sim import SimRuntime

SEGMENT = 1 << 16


def _dynamo_graph(fn, x, *weights):
    """The graph dynamo hands a backend for `fn`, the token dim of `x` symbolic (fake values in meta)."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(fn, backend=grab, fullgraph=True)(x, *weights)
    return graphs[0]


def mlp(x, w1, w2):
    h = torch.nn.functional.silu(x @ w1) * (x @ w1)
    return torch.nn.functional.rms_norm(h @ w2 + x, (x.shape[-1],))


def _weights():
    torch.manual_seed(0)
    return torch.randn(64, 192) / 8, torch.randn(192, 64) / 8


def _captured(rt, gm, tokens, weights):
    """What the simulator's pool holds after capturing `gm` once at each of `tokens` (outputs dropped
    after each, as the runner keeps only weak aliases), and the last capture's output and input."""
    out = x = None
    for n in tokens:
        x = rt.empty((n, 64), torch.float32)
        x.copy_(torch.randn(n, 64))
        graph = rt.graph()
        with graph.capture():
            out = gm(n, x, *weights)[0]
        graph.replay()
        rt.synchronize()
        torch.testing.assert_close(out, mlp(x, *weights), atol=1e-5, rtol=1e-5)
        del out
    return rt.memory_stats()["graph"]


@pytest.mark.parametrize("order", [[32, 16, 8, 4], [4, 8, 16, 32], [16, 4, 32, 8]])
def test_the_traced_pool_is_what_the_simulators_captures_reserve(order):
    """Replayed over the simulator's pool model, in capture order, the trace reserves exactly what the
    simulator's captures of the same graph reserve, and hands every block back."""
    weights = _weights()
    gm = _dynamo_graph(mlp, torch.randn(8, 64), *weights)
    rt = SimRuntime(segment_bytes=SEGMENT)
    trace = trace_allocations(gm, one_kernel(rt))
    assert trace is not None
    (tokens,) = {s for kind, _, n in trace.events if kind == "alloc" and not isinstance(n, int) for s in n.free_symbols}
    model = pool_model(rt)
    figure = pool_reserved(model, [(trace, {tokens: n}) for n in order])
    stats = _captured(rt, gm, order, weights)
    assert figure == stats["reserved_bytes"] > SEGMENT
    assert model.large.stats()["allocated_bytes"] == 0  # nothing held once the captures end


def test_the_trace_sizes_follow_the_symbols_and_only_the_outputs_outlive_the_capture():
    weights = _weights()
    trace = trace_allocations(_dynamo_graph(mlp, torch.randn(8, 64), *weights))
    allocs = [e for e in trace.events if e[0] == "alloc"]
    frees = [e for e in trace.events if e[0] == "free"]
    assert len(frees) == len(allocs) - 1  # everything but the output is freed within the capture
    (tokens,) = {s for _, _, n in allocs if not isinstance(n, int) for s in n.free_symbols}
    model = sim_pool_model(1 << 30)
    trace.replay(model, {tokens: 40})
    assert model.large.stats()["allocated_bytes"] == 40 * 64 * 4  # the output, still held by the caller


def test_a_graph_given_sizes_alone_is_traced_on_their_shape_environment():
    """A graph whose only input is a size (a piece making a buffer of the token count's rows, as the
    stand-in vLLM model's first piece): no input is a tensor, yet it runs on fakes, its allocation an
    expression of the size's symbol; a graph given nothing fake has no trace."""
    gm = _dynamo_graph(lambda x: x * 2, torch.randn(8, 64))
    tokens = next(v for v in map(example_value, gm.graph.find_nodes(op="placeholder")) if isinstance(v, torch.Tensor))
    size = tokens.shape[0]
    assert isinstance(size, torch.SymInt)
    graph = fx.Graph()
    n = graph.placeholder("n")
    n.meta["example_value"] = size
    graph.output((graph.call_function(torch.zeros, ((n, 64),), {"dtype": torch.float32}),))
    trace = trace_allocations(fx.GraphModule({}, graph))
    assert trace is not None and len(trace.events) == 1 and trace.outputs == ((0,),)
    kind, _, nbytes = trace.events[0]
    assert kind == "alloc" and nbytes == 256 * size.node.expr
    del n.meta["example_value"]
    assert trace_allocations(fx.GraphModule({}, graph)) is None


def _no_fake_kernel(*args):
    raise RuntimeError("no fake kernel")


def test_a_graph_that_does_not_run_on_fakes_has_no_trace(caplog):
    gm = _dynamo_graph(mlp, torch.randn(8, 64), *_weights())
    next(iter(gm.graph.find_nodes(op="call_function", target=torch.nn.functional.silu))).target = _no_fake_kernel
    assert trace_allocations(gm) is None
    assert "does not run on fake tensors (RuntimeError: no fake kernel)" in caplog.text


def test_the_caching_allocator_models_segment_sizes_as_c10_and_torch_npu_do():
    """c10 (`AllocatorConfig.h`) / torch_npu (`NPUAllocatorConfig.h`): up to 1 MiB from 2 MiB small
    segments, up to 10 MiB from 20 MiB ones, larger rounded up to 2 MiB (torch_npu: 16 KB)."""
    for round_large in (CUDA_ROUND_LARGE, NPU_ROUND_LARGE):
        model = caching_allocator_model(round_large)
        model.allocate(1000)
        model.allocate(1 << 20)
        assert model.reserved_bytes() == SMALL_BUFFER
        model.allocate(5 << 20)
        assert model.reserved_bytes() == SMALL_BUFFER + LARGE_BUFFER
        model.allocate(14 << 20)  # a best fit in what the 20 MiB segment has left
        assert model.reserved_bytes() == SMALL_BUFFER + LARGE_BUFFER
        big = (12 << 20) + 1
        model.allocate(big)
        assert model.reserved_bytes() == SMALL_BUFFER + LARGE_BUFFER + -(-(big + 511) // 512 * 512 // round_large) * round_large


@torch.library.custom_op("memtest::scaled_twice", mutates_args=())
def _scaled_twice(x: torch.Tensor, *, scale: float) -> torch.Tensor:
    """A Python body issuing two ops: a temporary `x * scale`, then the output."""
    return (x * scale) * 2


@_scaled_twice.register_fake
def _(x, *, scale):
    return torch.empty_like(x)


def _allocs(trace):
    return [n for kind, _, n in trace.events if kind == "alloc"]


def test_what_the_graph_is_given_its_views_and_its_workspace_slot_are_no_allocation():
    """Only what an op makes is the pool's: a view of an input and a view of the artifact's workspace
    slot allocate nothing; an op's keyword arguments are read (`dtype=int8`: one byte a token, not a
    float's four). mutmut's survivors of `_Recorder` and `_trace` (the slot's op not told apart, the
    inputs' storages not noted, keyword arguments dropped) fail here."""
    def f(x):
        slot = torch.ops.ascend.workspace(1 << 20, x.device)
        return x[1:], torch.zeros(x.shape[0], dtype=torch.int8), slot[:8]

    trace = trace_allocations(_dynamo_graph(f, torch.randn(8, 64)))
    assert trace is not None
    (size,) = _allocs(trace)
    (tokens,) = size.free_symbols
    assert size == tokens  # one int8 a token
    assert trace.outputs == ((), (0,), ())  # the input's view and the slot's hold no pool block


def test_an_op_the_runtime_runs_as_its_body_counts_the_bodys_temporaries():
    """A custom op a capture records as the ops of its Python body (`one_kernel` false: on the
    simulator) allocates the body's temporary too, freed inside the op; one recorded as one kernel
    allocates its output only. The body is run with the op's keyword arguments."""
    gm = _dynamo_graph(lambda x: torch.ops.memtest.scaled_twice(x, scale=3.0), torch.randn(8, 64))
    as_body = trace_allocations(gm, lambda op: "memtest" not in str(op))
    as_kernel = trace_allocations(gm, lambda op: True)
    assert len(_allocs(as_body)) == 2 and len(_allocs(as_kernel)) == 1
    assert [kind for kind, _, _ in as_body.events] == ["alloc", "alloc", "free"]  # the temporary, in the op
    assert len(as_body.outputs[0]) == 1


class _Traced(torch.nn.Module):
    """A graph as `fx.symbolic_trace` writes it: a submodule (call_module), a method (call_method), a
    parameter read (get_attr), keyword arguments, a node nothing uses, an input returned."""

    def __init__(self):
        super().__init__()
        self.act = torch.nn.SiLU()
        self.scale = torch.nn.Parameter(torch.ones(16))

    def forward(self, x):
        torch.sin(x)  # made and never used: freed at once
        h = self.act(input=x).add(self.scale, alpha=2.0)  # a submodule called with a keyword
        return h.sum(dim=1), x


def test_every_kind_of_node_is_run_on_fakes_and_a_value_nobody_uses_is_freed():
    """Not only dynamo's call_function nodes: a submodule, a method with its arguments, a parameter,
    each op's keyword arguments; a node without users freed right after it runs (fixed sizes, no shape
    environment: the guards' suppression is skipped)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    gm = torch.fx.symbolic_trace(_Traced())
    (x,) = gm.graph.find_nodes(op="placeholder")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # the module's own parameters are real
        x.meta["val"] = mode.from_tensor(torch.randn(4, 16))
    trace = trace_allocations(gm)
    assert trace is not None
    # sin (freed: no user), act, add, sum [4] (its dim read)
    assert trace.events == (("alloc", 0, 4 * 16 * 4), ("free", 0, None), ("alloc", 1, 4 * 16 * 4),
                            ("alloc", 2, 4 * 16 * 4), ("free", 1, None), ("alloc", 3, 4 * 4), ("free", 2, None))
    assert trace.outputs == ((3,), ())  # an input returned holds no block


def test_a_storage_two_live_nodes_hold_is_freed_after_the_last_of_them():
    """A view keeps its base's block: freed when the last node holding the storage is done, not when
    the first is (an early free would undercount the pool's peak)."""
    def f(x):
        a = x * 2
        b = a[1:]
        c = a + 1  # a's last use; b still holds a's storage
        return c, b * 3

    trace = trace_allocations(_dynamo_graph(f, torch.randn(8, 64)))
    kinds = [(kind, ident) for kind, ident, _ in trace.events]
    assert kinds == [("alloc", 0), ("alloc", 1), ("alloc", 2), ("free", 0)]


@torch.library.custom_op("memtest::branchy", mutates_args=())
def _branchy(x: torch.Tensor) -> torch.Tensor:
    """A body that branches on the token count: run on fakes, it asks the shape environment."""
    return x * 2 if x.shape[0] > 2 else x * 3


@_branchy.register_fake
def _(x):
    return torch.empty_like(x)


def test_the_fake_run_adds_no_guard_to_what_dynamo_compiled():
    """A body dynamo never traced, run on the graph's fakes, branches on a size symbol: the trace
    suppresses the guard it would add (the shape environment is dynamo's, its guards the graph's)."""
    gm = _dynamo_graph(lambda x: torch.ops.memtest.branchy(x), torch.randn(8, 64))
    (x,) = [n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder")
            if isinstance(n.meta["example_value"], torch.Tensor)]
    shape_env = x.fake_mode.shape_env
    before = [str(g.expr) for g in shape_env.guards]
    assert trace_allocations(gm, lambda op: "memtest" not in str(op)) is not None
    assert [str(g.expr) for g in shape_env.guards] == before


def test_a_graph_returning_one_value_not_a_tuple():
    """An FX graph may return one node, not a tuple of them: its output is still the one block held."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    gm = torch.fx.symbolic_trace(lambda x: torch.sin(x) * 2)
    (x,) = gm.graph.find_nodes(op="placeholder")
    with FakeTensorMode() as mode:
        x.meta["val"] = mode.from_tensor(torch.randn(4, 16))
    trace = trace_allocations(gm)
    assert trace is not None and trace.outputs == ((1,),)


def test_a_graph_given_sizes_alone_adds_no_guard_to_their_shape_environment():
    """A graph given only the token count, whose op body branches on it: the fake mode made for it is
    over the size's own shape environment, so the guard the branch would add is suppressed there."""
    gm = _dynamo_graph(lambda x: x * 2, torch.randn(8, 64))
    tokens = next(v for v in map(example_value, gm.graph.find_nodes(op="placeholder")) if isinstance(v, torch.Tensor))
    size, shape_env = tokens.shape[0], tokens.fake_mode.shape_env
    graph = fx.Graph()
    n = graph.placeholder("n")
    n.meta["example_value"] = size
    buffer = graph.call_function(torch.zeros, ((n, 64),), {"dtype": torch.float32})
    graph.output((graph.call_function(torch.ops.memtest.branchy, (buffer,)),))
    before = [str(g.expr) for g in shape_env.guards]
    trace = trace_allocations(fx.GraphModule({}, graph), lambda op: "memtest" not in str(op))
    assert trace is not None
    assert [str(g.expr) for g in shape_env.guards] == before


class _Positional(torch.nn.Module):
    """A submodule called with a positional argument (as `split_module`'s pieces are)."""

    def __init__(self):
        super().__init__()
        self.act = torch.nn.Softmax(dim=1)

    def forward(self, x):
        return self.act(x) * 2


def test_a_submodule_is_run_with_its_positional_arguments():
    """A call_module node's positional arguments reach the submodule: its output's block is sized by them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    gm = torch.fx.symbolic_trace(_Positional())
    (x,) = gm.graph.find_nodes(op="placeholder")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x.meta["val"] = mode.from_tensor(torch.randn(5, 16))
    trace = trace_allocations(gm)
    assert trace is not None
    assert trace.events == (("alloc", 0, 5 * 16 * 4), ("alloc", 1, 5 * 16 * 4), ("free", 0, None))
