"""The split of a piecewise graph (`ascend_compile/passes/split_pieces.py`), on FX graphs built here node by
node, each node's fake value computed as the compiler's graphs carry them: which nodes run eagerly and
why (kernels, attention ops, workspaces, KV-cache writes, uncapturable ops, unpacks of eager results,
writes into a caller's tensor and the views they write through, sizes other than the token count), which
cache writes may stay in pieces, where each other node is placed (the earliest piece after what it reads,
or where it was when it writes or is written), which writes become eager because another piece made
their value, each piece's inputs and outputs, and a piece as a graph module of its own: running the
segments in order computes what the graph computes. mutmut's tests for this module (the compile's use
of the split is `tests/test_piecewise.py`'s)."""
from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import ascend_compile.ops.library  # noqa: F401  (registers the ascend ops)
import ascend_compile.ops.mla  # noqa: F401
from ascend_compile.passes import split_pieces as sp
from ascend_compile.passes.roles import GraphSignature, InputSpec, Role
from ascend_compile.passes.split_pieces import (EagerNode, Piece, Why, eager_nodes, padding_safe_writes, piece_module,
                                                split)

ascend = torch.ops.ascend


@torch.library.custom_op("split_pieces_test::bump_all", mutates_args=("ys",))
def bump_all(ys: list[torch.Tensor], by: float) -> None:
    """Adds `by` to each of `ys` in place: an op writing a list of tensors (`Tensor(a!)[]`)."""
    for y in ys:
        y.add_(by)


@bump_all.register_fake
def _(ys, by) -> None:
    return None


BUMP_ALL = torch.ops.split_pieces_test.bump_all.default

KERNEL = "attention kernel: takes the step's lengths"
ATTENTION = "attention op (its layer served eagerly): takes the step's lengths"
WORKSPACE = "workspace: the artifact's slot"
CACHE = "writes the KV cache at the step's slots"
UNPACKS = "unpacks an eager node's result"


class Builder:
    """An FX graph built node by node, each node's fake value (`meta["val"]`) computed from its arguments'
    in one fake mode with a shape environment, as dynamo's graphs carry them."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode(shape_env=ShapeEnv())

    def tensor(self, *shape: Any, dynamic: tuple[int, ...] = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A fake tensor of `shape` (ints or SymInts), the dims `dynamic` given fresh size symbols."""
        real = torch.zeros([s if isinstance(s, int) else 1 for s in shape], dtype=dtype)
        if not dynamic:
            with self.mode:
                return torch.zeros(shape, dtype=dtype)
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if i in dynamic else DimDynamic.STATIC
                                                          for i in range(real.dim())])
        return self.mode.from_tensor(real.new_zeros([s + 2 if i in dynamic else s for i, s in enumerate(real.shape)]),
                                     symbolic_context=context)

    def input(self, name: str, value: Any) -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = value
        return node

    def call(self, target: Any, *args: Any, name: str | None = None, **kwargs: Any) -> fx.Node:
        name = name or getattr(target, "_opname", None)  # an overload's node named as its packet's
        node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        with self.mode:
            node.meta["val"] = target(*_vals(args), **_vals(kwargs))
        return node

    def method(self, name: str, *args: Any) -> fx.Node:
        node = self.graph.create_node("call_method", name, args)
        self_value, *rest = _vals(args)
        with self.mode:
            node.meta["val"] = getattr(self_value, name)(*rest)
        return node

    def module(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _vals(value: Any) -> Any:
    return fx.node.map_arg(value, lambda n: n.meta["val"])


def _symbols(*values: Any) -> set:
    return {s for v in values for d in v.shape if not isinstance(d, int) for s in d.node.expr.free_symbols}


def _names(eager: dict[fx.Node, str]) -> dict[str, str]:
    return {n.name: str(why) for n, why in eager.items()}


def _layout(segments: list) -> list:
    """Each segment as the names of its nodes (a piece) or `("eager", name)`."""
    return [[n.name for n in s.nodes] if isinstance(s, Piece) else ("eager", s.node.name) for s in segments]


# --- which nodes run eagerly, and why -------------------------------------------------------------------------------


def _attention_graph() -> tuple[Builder, dict[str, fx.Node], torch.SymInt]:
    """A layer's nodes: an attention op, the FIA kernel on a workspace into `out`, MLA's ops, both cache writes."""
    b = Builder()
    q = b.tensor(4, 2, 8, dynamic=(0,))
    tokens = q.shape[0]
    n = {"q": b.input("q", q),
         "kc": b.input("kc", b.tensor(3, 16, 2, 8)), "vc": b.input("vc", b.tensor(3, 16, 2, 8)),
         "table": b.input("table", b.tensor(2, 3, dtype=torch.int32)),
         "lens": b.input("lens", b.tensor(2, dtype=torch.int32)),
         "starts": b.input("starts", b.tensor(3, dtype=torch.int32)),
         "slots": b.input("slots", b.tensor(tokens, dtype=torch.int64)),
         "c_cache": b.input("c_cache", b.tensor(3, 16, 8)), "pe_cache": b.input("pe_cache", b.tensor(3, 16, 4)),
         "pe": b.input("pe", b.tensor(tokens, 2, 4))}

    def add(name: str, target: Any, *args: Any) -> None:
        n[name] = b.call(target, *args, name=name)

    add("k", torch.ops.aten.mul.Tensor, n["q"], 2.0)
    add("write", ascend.reshape_and_cache, n["k"], n["k"], n["kc"], n["vc"], n["slots"])
    add("attn", ascend.attention, n["q"], n["kc"], n["vc"], n["table"], n["lens"], n["starts"], 0.5)
    add("ws", ascend.workspace.default, 64, torch.device("cpu"))
    add("out", torch.ops.aten.empty_like.default, n["q"])
    add("kernel", ascend.fused_infer_attention.default, n["q"], n["kc"], n["vc"], n["table"], [4], [4], 0.5,
        n["ws"], n["out"])
    add("mla", ascend.mla_attention, n["q"], n["pe"], n["c_cache"], n["pe_cache"], n["table"], n["lens"],
        n["starts"], 0.5)
    add("c", torch.ops.aten.select.int, n["q"], 1, 0)
    add("pe_row", torch.ops.aten.select.int, n["pe"], 1, 0)
    add("mla_write", ascend.mla_cache_write, n["c"], n["pe_row"], n["c_cache"], n["pe_cache"], n["slots"])
    add("total", torch.ops.aten.add.Tensor, n["attn"], n["out"])
    return b, n, tokens


def test_kernels_attention_ops_workspaces_and_cache_writes_run_eagerly_each_saying_why():
    b, n, tokens = _attention_graph()
    gm = b.module(n["total"], n["mla"])
    eager = eager_nodes(gm, _symbols(n["q"].meta["val"]))
    assert _names(eager) == {"write": CACHE, "attn": ATTENTION, "ws": WORKSPACE, "kernel": KERNEL, "mla": ATTENTION,
                             "mla_write": CACHE}
    assert not any(EagerNode(node, why).writes_caller for node, why in eager.items())  # a KV cache is no caller's


def test_a_cache_write_kept_in_the_pieces_is_no_eager_node():
    b, n, tokens = _attention_graph()
    gm = b.module(n["total"], n["mla"])
    eager = eager_nodes(gm, _symbols(n["q"].meta["val"]), padding_safe={n["write"], n["mla_write"]})
    assert set(_names(eager)) == {"attn", "ws", "kernel", "mla"}


def test_an_uncapturable_op_runs_eagerly_a_function_or_a_method_and_so_does_what_unpacks_it():
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    top = b.call(torch.topk, x, 2)
    values, indices = b.call(operator.getitem, top, 0), b.call(operator.getitem, top, 1)
    cum = b.method("cumsum", x, 1)
    kept = b.call(torch.topk, cum, 1)
    kept_values = b.call(operator.getitem, kept, 0)
    gm = b.module(values, indices, kept_values)
    allowed = _symbols(x.meta["val"])
    eager = eager_nodes(gm, allowed, uncapturable={torch.topk, "cumsum"})
    assert _names(eager) == {"topk": f"{torch.topk} cannot be captured", "getitem": UNPACKS, "getitem_1": UNPACKS,
                             "cumsum": "cumsum cannot be captured", "topk_1": f"{torch.topk} cannot be captured",
                             "getitem_2": UNPACKS}
    assert eager_nodes(gm, allowed) == {}  # none is found uncapturable: the same nodes are pieces' nodes
    eager = eager_nodes(gm, allowed, uncapturable={"cumsum"})
    assert _names(eager) == {"cumsum": "cumsum cannot be captured"}  # unpacking a piece's tuple is no eager node


def test_a_node_holding_a_size_other_than_the_token_count_runs_eagerly_naming_the_sizes():
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    table = b.input("table", b.tensor(2, 3, dynamic=(0, 1), dtype=torch.int32))
    lens = b.input("lens", b.tensor(2, dynamic=(0,), dtype=torch.int32))
    tokens, = _symbols(x.meta["val"])
    seqs, width = (table.meta["val"].shape[i].node.expr for i in (0, 1))
    (lens_sym,) = _symbols(lens.meta["val"])
    doubled = b.call(torch.mul, table, 2)  # reads and makes [B, W]
    total = b.call(torch.sum, lens)  # a 0-d tensor of a [B] tensor: its input holds B
    count = b.method("size", table, 0)  # a SymInt
    found = b.call(torch.nonzero, x)  # [u0, 2] of [T, 6]: a size only its value holds
    row = b.call(torch.sum, x, 0)  # [6]
    scaled = b.call(torch.mul, x, 3)  # [T, 6]
    gm = b.module(doubled, total, count, found, row, scaled)
    eager = eager_nodes(gm, {tokens})
    (unbacked,) = _symbols(found.meta["val"]) - {tokens}
    assert _names(eager) == {
        "mul": f"holds the sizes {', '.join(sorted(map(str, (seqs, width))))} (not the token count)",
        "sum_1": f"holds the size {lens_sym} (not the token count)",
        "size": f"holds the size {seqs} (not the token count)",
        "nonzero": f"holds the size {unbacked} (not the token count)"}
    # sizes a piece may hold (the specialised ones too) make no node eager
    assert _names(eager_nodes(gm, {tokens, seqs, width, lens_sym, unbacked})) == {}


def test_a_tuple_value_holding_another_size_runs_eagerly():
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    lens = b.tensor(2, dynamic=(0,), dtype=torch.int32)
    both = b.call(torch.topk, x, 1)
    both.meta["val"] = (both.meta["val"][0], lens)  # a tuple whose second tensor has the sequence count
    gm = b.module(both)
    (lens_sym,) = _symbols(lens)
    assert _names(eager_nodes(gm, _symbols(x.meta["val"]))) == {
        "topk": f"holds the size {lens_sym} (not the token count)"}


def test_a_write_into_a_graph_input_runs_eagerly_and_so_does_each_view_it_writes_through():
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    buf = b.input("buf", b.tensor(4, 6))
    other = b.input("other", b.tensor(4, 6))
    rows = b.call(torch.ops.aten.slice.Tensor, buf, 0, 0, 2)  # a view of buf
    row = b.call(torch.ops.aten.select.int, rows, 0, 1)  # a view of the view
    bumped = b.method("add_", row, 1.0)  # writes buf through both views
    fresh = b.call(torch.mul, x, 2)  # not a graph input's storage
    fresh_rows = b.call(torch.ops.aten.slice.Tensor, fresh, 0, 0, 2)
    b.method("mul_", fresh_rows, 2.0)  # writes a value the graph made: no caller's tensor
    other_view = b.call(torch.ops.aten.slice.Tensor, other, 0, 0, 1)  # a view of another input, written by nothing
    into = b.call(torch.add, other, 1, out=other)  # writes `other` by out=
    gm = b.module(bumped, fresh, into, other_view)
    eager = eager_nodes(gm, _symbols(x.meta["val"]))
    assert _names(eager) == {"add_": "writes graph input storage (select)", "select": "a view add_ writes through",
                             "slice_1": "a view add_ writes through", "add": "writes graph input storage (other)"}
    assert all(EagerNode(node, why).writes_caller for node, why in eager.items())
    assert all(isinstance(why, Why) and why.writes_caller for why in eager.values())
    assert not any(node.op == "placeholder" for node in eager)  # the input itself is no node run eagerly


def test_a_view_sized_by_a_graph_input_is_followed_back_to_the_input_it_views():
    """A view reading a size input (a SymInt placeholder) beside the view it is of: the walk back from the
    write passes the size input and goes on to the view of the written input."""
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    count = b.input("count", x.meta["val"].shape[0])
    buf = b.input("buf", b.tensor(8, 6))
    rows = b.call(torch.ops.aten.slice.Tensor, buf, 1, 0, 4, name="rows")
    first = b.call(torch.ops.aten.slice.Tensor, rows, 0, 0, count, name="first")  # reads rows, then count
    bumped = b.method("add_", first, 1.0)
    gm = b.module(bumped, x)
    eager = eager_nodes(gm, _symbols(x.meta["val"]))
    assert _names(eager) == {"add_": "writes graph input storage (first)", "first": "a view add_ writes through",
                             "rows": "a view add_ writes through"}


def test_every_view_of_the_written_input_a_written_view_is_computed_from_runs_eagerly():
    """A written view computed from two views of the input (`view_as`): the walk back goes through both."""
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    buf = b.input("buf", b.tensor(4, 6))
    top = b.call(torch.ops.aten.slice.Tensor, buf, 0, 0, 2, name="top")
    bottom = b.call(torch.ops.aten.slice.Tensor, buf, 0, 2, 4, name="bottom")
    shaped = b.method("view_as", top, bottom)  # a view of `top`, shaped as `bottom`
    bumped = b.method("add_", shaped, 1.0)
    gm = b.module(bumped, x)
    eager = _names(eager_nodes(gm, _symbols(x.meta["val"])))
    assert eager["add_"] == "writes graph input storage (view_as)"
    assert eager["view_as"] == eager["top"] == "a view add_ writes through"  # the view written through, its base


def test_the_views_a_cache_write_writes_through_run_eagerly_writing_no_callers_tensor():
    """vLLM's caches: one `[blocks, 2, ...]` tensor, its key and value caches views of it."""
    b = Builder()
    k = b.input("k", b.tensor(4, 2, 8, dynamic=(0,)))
    kv = b.input("kv", b.tensor(3, 2, 16, 2, 8))
    slots = b.input("slots", b.tensor(k.meta["val"].shape[0], dtype=torch.int64))
    key_cache = b.call(torch.ops.aten.select.int, kv, 1, 0)
    value_cache = b.call(torch.ops.aten.select.int, kv, 1, 1)
    write = b.call(ascend.reshape_and_cache, k, k, key_cache, value_cache, slots)
    gm = b.module(write)
    eager = eager_nodes(gm, _symbols(k.meta["val"]))
    assert _names(eager) == {"reshape_and_cache": CACHE, "select": "a view reshape_and_cache writes through",
                             "select_1": "a view reshape_and_cache writes through"}
    assert not any(EagerNode(node, why).writes_caller for node, why in eager.items())


def test_why_is_its_text_and_says_whether_a_callers_tensor_is_written():
    why = Why("writes graph input storage (x)", writes_caller=True)
    assert why == "writes graph input storage (x)" and why.writes_caller
    assert not Why("a view").writes_caller
    b = Builder()
    node = b.input("x", b.tensor(2))
    assert EagerNode(node, why).writes_caller and not EagerNode(node, "writes graph input storage (x)").writes_caller


def test_a_value_without_storage_is_no_graph_inputs_storage():
    b = Builder()
    x = b.input("x", b.tensor(4, 6))
    empty = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0), (3, 3), check_invariants=False)
    sparse = b.input("sparse", empty)
    y = b.call(torch.mul, x, 2)
    gm = b.module(y, sparse)
    assert eager_nodes(gm, set()) == {}
    assert sp._storage(sparse.meta["val"]) is None and sp._storage(3) is None


# --- padding-safe cache writes --------------------------------------------------------------------------------------


def _signature(gm: fx.GraphModule, roles: dict[str, Role]) -> GraphSignature:
    inputs = tuple(InputSpec(i, n.name, roles.get(n.name, Role.BATCH), None)
                   for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"))
    return GraphSignature(inputs, 4, 2, {}, {}, ())


def _cache_writes() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    b = Builder()
    k = b.input("k", b.tensor(4, 2, 8, dynamic=(0,)))
    tokens = k.meta["val"].shape[0]
    n = {"k": k, "kc": b.input("kc", b.tensor(3, 16, 2, 8)), "vc": b.input("vc", b.tensor(3, 16, 2, 8)),
         "slots": b.input("slots", b.tensor(tokens, dtype=torch.int64))}
    n["kc_view"] = b.call(torch.ops.aten.slice.Tensor, n["kc"], 0, 0, 3, name="kc_view")
    n["slots2"] = b.call(torch.mul, n["slots"], 1, name="slots2")
    n["plain"] = b.call(ascend.reshape_and_cache, k, k, n["kc"], n["vc"], n["slots"], name="plain")
    n["through_view"] = b.call(ascend.reshape_and_cache, k, k, n["kc_view"], n["vc"], n["slots"], name="through_view")
    n["made_slots"] = b.call(ascend.reshape_and_cache, k, k, n["kc"], n["vc"], n["slots2"], name="made_slots")
    n["reads"] = b.call(torch.mul, k, 2, name="reads")
    return b.module(n["reads"]), n


@pytest.mark.parametrize("key_role, value_role", [(Role.KV_CACHE, Role.KV_CACHE), (Role.KV_CACHE, Role.STATIC),
                                                  (Role.STATIC, Role.KV_CACHE)])
def test_a_cache_write_into_caches_used_in_place_at_the_slot_mapping_input_is_padding_safe(key_role, value_role):
    gm, n = _cache_writes()
    signature = _signature(gm, {"kc": key_role, "vc": value_role, "slots": Role.SLOT_MAPPING})
    names = ["no_such_node", "plain", "through_view", "made_slots", "reads"]
    assert padding_safe_writes(gm, signature, names) == {n["plain"]}
    assert padding_safe_writes(gm, signature, ["through_view", "made_slots"]) == set()


@pytest.mark.parametrize("roles", [{"kc": Role.BATCH, "vc": Role.KV_CACHE, "slots": Role.SLOT_MAPPING},
                                   {"kc": Role.KV_CACHE, "vc": Role.BATCH, "slots": Role.SLOT_MAPPING},
                                   {"kc": Role.KV_CACHE, "vc": Role.KV_CACHE, "slots": Role.BATCH},
                                   {"kc": Role.KV_CACHE, "vc": Role.KV_CACHE, "slots": Role.KV_CACHE}],
                         ids=["key-copied", "value-copied", "slots-batch", "slots-cache"])
def test_a_cache_write_into_a_copied_input_or_at_other_slots_is_not_padding_safe(roles):
    gm, n = _cache_writes()
    assert padding_safe_writes(gm, _signature(gm, roles), ["plain"]) == set()


def test_a_node_writing_nothing_or_with_no_arguments_is_no_padding_safe_write():
    b = Builder()
    slots = b.input("slots", b.tensor(4, dtype=torch.int64))
    empty = b.call(torch.ops.aten.empty.memory_format, [4])  # no tensor argument
    reads = b.call(torch.mul, empty, slots)  # last argument the slot mapping, writes nothing
    zeros = b.call(torch.ops.aten.zeros.default, size=[4], name="zeros")  # no positional argument at all
    gm = b.module(reads, zeros)
    signature = _signature(gm, {"slots": Role.SLOT_MAPPING})
    assert padding_safe_writes(gm, signature, ["empty", "zeros", "mul", "slots"]) == set()


# --- the split: where each node goes -------------------------------------------------------------------------------


def _chain() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """x -> a -> [top: uncapturable] -> values (unpacks it) -> b -> [cum: uncapturable] -> c -> inner -> d, and
    `early`, `cut` reading only x though placed after the first eager node; the graph returns d and b."""
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    n = {"x": x}

    def add(name: str, target: Any, *args: Any) -> None:
        n[name] = b.call(target, *args, name=name)

    add("a", torch.mul, x, 2)
    add("top", torch.topk, n["a"], 3)
    add("values", operator.getitem, n["top"], 0)
    add("b", torch.add, n["values"], 1)
    add("early", torch.sin, x)
    add("cut", torch.ops.aten.slice.Tensor, n["early"], 1, 0, 3)
    n["cum"] = b.method("cumsum", n["b"], 1)
    add("c", torch.mul, n["cum"], n["cut"])
    add("inner", torch.cos, n["c"])
    add("d", torch.add, n["inner"], n["c"])
    return b.module(n["d"], n["b"]), n


def _run(gm: fx.GraphModule, segments: list, inputs: list[torch.Tensor]) -> Any:
    """The segments run in order, each piece as its own graph module on the values before it, each eager
    node as itself: what the graph returns."""
    env: dict[fx.Node, Any] = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs, strict=True))
    for segment in segments:
        if isinstance(segment, Piece):
            outputs = piece_module(gm, segment)(*[env[i] for i in segment.inputs])
            env.update(zip(segment.outputs, outputs, strict=True))
        else:
            node = segment.node
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
            env[node] = (getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method"
                         else node.target(*args, **kwargs))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return fx.node.map_arg(output.args[0], lambda a: env[a])


def test_pieces_are_the_runs_between_eager_nodes_their_inputs_and_outputs_and_run_as_the_graph():
    """A node reading only what is made before an eager node is placed in the piece before it (`early`, `cut`)."""
    gm, n = _chain()
    eager = eager_nodes(gm, _symbols(n["x"].meta["val"]), uncapturable={torch.topk, "cumsum"})
    segments = split(gm, eager)
    assert _layout(segments) == [["a", "early", "cut"], ("eager", "top"), ("eager", "values"), ["b"],
                                 ("eager", "cumsum"), ["c", "inner", "d"]]
    first, second, third = (s for s in segments if isinstance(s, Piece))
    assert first.inputs == [n["x"]] and first.outputs == [n["a"], n["cut"]]  # `early` is read inside it only
    assert second.inputs == [n["values"]] and second.outputs == [n["b"]]  # read by cumsum and by the output
    assert third.inputs == [n["cum"], n["cut"]] and third.outputs == [n["d"]]  # `c` read by the output via d only
    assert [s.why for s in segments if isinstance(s, EagerNode)] == [f"{torch.topk} cannot be captured", UNPACKS,
                                                                     "cumsum cannot be captured"]
    x = torch.randn(5, 6)
    got = _run(gm, segments, [x])
    want = gm(x)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_piece_module_takes_its_inputs_as_placeholders_and_returns_its_outputs():
    gm, n = _chain()
    eager = eager_nodes(gm, _symbols(n["x"].meta["val"]), uncapturable={torch.topk, "cumsum"})
    third = [s for s in split(gm, eager) if isinstance(s, Piece)][-1]
    third.outputs = [n["c"], n["d"]]
    module = piece_module(gm, third)
    placeholders = [p for p in module.graph.nodes if p.op == "placeholder"]
    assert [p.name for p in placeholders] == ["cumsum", "cut"]
    assert [p.meta["val"] for p in placeholders] == [n["cum"].meta["val"], n["cut"].meta["val"]]
    assert placeholders[0].meta is not n["cum"].meta  # a copy: the piece's graph is its own
    cum, cut = torch.randn(5, 3), torch.randn(5, 3)
    got = module(cum, cut)
    assert isinstance(got, tuple) and len(got) == 2
    assert torch.equal(got[0], cum * cut) and torch.equal(got[1], torch.cos(cum * cut) + cum * cut)


def test_a_graph_without_eager_nodes_is_one_piece_returning_what_the_output_reads():
    gm, n = _chain()
    (piece,) = split(gm, {})
    assert piece.nodes == [m for m in gm.graph.nodes if m.op not in ("placeholder", "output")]
    assert piece.inputs == [n["x"]] and piece.outputs == [n["b"], n["d"]]


def test_an_eager_nodes_extra_reads_are_outputs_of_their_piece():
    gm, n = _chain()
    eager = eager_nodes(gm, _symbols(n["x"].meta["val"]), uncapturable={torch.topk, "cumsum"})
    segments = split(gm, eager, {n["cum"]: [n["early"], n["x"]]})
    assert segments[0].outputs == [n["a"], n["early"], n["cut"]]
    segments = split(gm, eager, {n["top"]: [n["early"]], n["values"]: [n["early"]]})
    assert segments[0].outputs == [n["a"], n["early"], n["cut"]]
    assert split(gm, eager)[0].outputs == [n["a"], n["cut"]]


def test_workspaces_are_neither_pieces_nor_eager_nodes_and_what_reads_a_kernels_out_follows_the_kernel():
    b, n, tokens = _attention_graph()
    n["view"] = b.call(torch.ops.aten.view.default, n["out"], [-1], name="view")  # reads what the kernel wrote
    n["scaled"] = b.call(torch.mul, n["k"], 3, name="scaled")  # reads only what the first piece made
    n["peek"] = b.call(torch.sum, n["c_cache"], name="peek")  # reads the cache the last piece's write writes
    gm = b.module(n["total"], n["mla"], n["view"], n["scaled"], n["peek"])
    eager = eager_nodes(gm, _symbols(n["q"].meta["val"]), padding_safe={n["write"], n["mla_write"]})
    segments = split(gm, eager, padding_safe={n["write"], n["mla_write"]})
    # `c`, `pe_row`, `scaled` read only what the first piece reads or makes; `total` and `view` read the
    # kernel's `out`; the cache writes (padding-safe, kept in pieces) stay between the eager nodes they were
    assert _layout(segments) == [["k", "write", "out", "c", "pe_row", "scaled"], ("eager", "attn"),
                                 ("eager", "kernel"), ["total", "view"], ("eager", "mla"), ["mla_write", "peek"]]
    assert not any(isinstance(s, EagerNode) and s.node is n["ws"] for s in segments)
    first, second, third = (s for s in segments if isinstance(s, Piece))
    assert first.inputs == [n["q"], n["kc"], n["vc"], n["slots"], n["pe"]]
    assert first.outputs == [n["out"], n["c"], n["pe_row"], n["scaled"]]
    assert second.inputs == [n["attn"], n["out"]] and second.outputs == [n["total"], n["view"]]
    assert third.inputs == [n["c"], n["pe_row"], n["c_cache"], n["pe_cache"], n["slots"]]
    assert third.outputs == [n["peek"]]


def test_a_node_a_piece_writes_stays_in_place_with_its_writer():
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    a = b.call(torch.mul, x, 2)
    cum = b.method("cumsum", a, 1)
    fresh = b.call(torch.ops.aten.zeros_like.default, x)  # reads only x, but written below: stays after cumsum
    bumped = b.method("add_", fresh, cum)
    gm = b.module(bumped)
    eager = eager_nodes(gm, _symbols(x.meta["val"]), uncapturable={"cumsum"})
    segments = split(gm, eager)
    assert _layout(segments) == [["mul"], ("eager", "cumsum"), ["zeros_like", "add_"]]
    assert "add_" not in _names(eager)
    out = torch.randn(5, 6)
    assert torch.equal(_run(gm, segments, [out])[0], gm(out)[0])


def test_a_write_into_a_value_another_piece_made_runs_eagerly_with_what_unpacks_it():
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    values = b.call(torch.zeros_like, x)  # the first piece
    indices = b.call(torch.zeros_like, x, dtype=torch.int64)
    cum = b.method("cumsum", x, 1)
    top = b.call(torch.ops.aten.topk.values, cum, 6, values=values, indices=indices)  # writes both
    got_values = b.call(operator.getitem, top, 0)
    got_indices = b.call(operator.getitem, top, 1)
    later = b.call(torch.mul, got_values, 2)
    gm = b.module(later, got_indices)
    eager = eager_nodes(gm, _symbols(x.meta["val"]), uncapturable={"cumsum"})
    segments = split(gm, eager)
    # `mul` reads only the first unpack: the piece before the second
    assert _layout(segments) == [["zeros_like", "zeros_like_1"], ("eager", "cumsum"), ("eager", "topk"),
                                 ("eager", "getitem"), ["mul"], ("eager", "getitem_1")]
    assert eager[top] == "writes zeros_like, zeros_like_1, which another piece made"
    assert eager[got_values] == eager[got_indices] == UNPACKS
    out = torch.randn(5, 6)
    assert all(torch.equal(g, w) for g, w in zip(_run(gm, segments, [out]), gm(out), strict=True))


def test_a_write_into_a_graph_input_left_to_a_piece_runs_eagerly_unless_padding_safe():
    b, n, tokens = _attention_graph()
    gm = b.module(n["total"], n["mla"])
    eager = eager_nodes(gm, _symbols(n["q"].meta["val"]), padding_safe={n["write"], n["mla_write"]})
    kept = split(gm, dict(eager), padding_safe={n["write"], n["mla_write"]})
    assert {n["write"], n["mla_write"]} <= {m for s in kept if isinstance(s, Piece) for m in s.nodes}
    moved = dict(eager)
    segments = split(gm, moved, padding_safe={n["mla_write"]})
    assert moved[n["write"]] == "writes kc, vc, which another piece made"
    assert ("eager", "write") in _layout(segments) and n["mla_write"] not in moved


def test_a_write_into_what_an_eager_node_made_and_what_follows_from_it_run_eagerly():
    """A piece's node writing an eager node's result runs eagerly; a node writing what that node made then
    does too (the split repeats until nothing moves)."""
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    cum = b.method("cumsum", x, 1)  # eager
    made = b.call(torch.ops.aten.topk.values, x, 6, values=cum, indices=b.call(torch.zeros_like, x,
                                                                               dtype=torch.int64))
    values = b.call(operator.getitem, made, 0)
    bumped = b.method("add_", values, 1.0)
    after = b.call(torch.mul, bumped, 2)  # reads a moved node: a piece's node, after it
    gm = b.module(after)
    eager = eager_nodes(gm, _symbols(x.meta["val"]), uncapturable={"cumsum"})
    assert _layout(split(gm, eager)) == [["zeros_like"], ("eager", "cumsum"), ("eager", "topk"), ("eager", "getitem"),
                                         ("eager", "add_"), ["mul"]]
    assert _names(eager) == {"cumsum": "cumsum cannot be captured",
                             "topk": "writes cumsum, zeros_like, which another piece made", "getitem": UNPACKS,
                             "add_": "writes getitem, which another piece made"}


def test_a_write_into_a_value_its_own_piece_made_stays_in_the_piece():
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    fresh = b.call(torch.mul, x, 2)
    bumped = b.method("add_", fresh, 1.0)
    cum = b.method("cumsum", bumped, 1)
    gm = b.module(cum)
    eager = eager_nodes(gm, _symbols(x.meta["val"]), uncapturable={"cumsum"})
    assert _layout(split(gm, eager)) == [["mul", "add_"], ("eager", "cumsum")]


# --- writes through a list argument (`Tensor(a!)[]`) ---------------------------------------------------------------


def test_a_write_into_a_graph_input_held_in_a_list_argument_runs_eagerly_with_its_views():
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    buf = b.input("buf", b.tensor(4, 6))
    fresh = b.call(torch.mul, x, 2, name="fresh")
    rows = b.call(torch.ops.aten.slice.Tensor, buf, 0, 0, 2, name="rows")
    bumped = b.call(BUMP_ALL, [fresh, rows], 1.0, name="bumped")
    gm = b.module(fresh, bumped)
    eager = eager_nodes(gm, _symbols(x.meta["val"]))
    assert _names(eager) == {"bumped": "writes graph input storage (rows)", "rows": "a view bumped writes through"}
    assert all(EagerNode(node, why).writes_caller for node, why in eager.items())


def test_a_write_into_another_pieces_value_held_in_a_list_argument_runs_eagerly():
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    fresh = b.call(torch.mul, x, 2, name="fresh")
    cum = b.method("cumsum", x, 1)
    mine = b.call(torch.mul, cum, 2, name="mine")
    bumped = b.call(BUMP_ALL, [mine, fresh], 1.0, name="bumped")  # `mine` its piece's, `fresh` the first piece's
    after = b.call(torch.mul, fresh, 3, name="after")
    gm = b.module(after, mine)
    eager = eager_nodes(gm, _symbols(x.meta["val"]), uncapturable={"cumsum"})
    segments = split(gm, eager)
    assert eager[bumped] == "writes mine, fresh, which another piece made"
    assert _layout(segments) == [["fresh"], ("eager", "cumsum"), ["mine"], ("eager", "bumped"), ["after"]]
    x = torch.randn(5, 6)
    assert all(torch.equal(g, w) for g, w in zip(_run(gm, segments, [x]), gm(x), strict=True))


def test_a_write_held_in_a_list_into_a_value_its_own_piece_made_stays_in_the_piece():
    b = Builder()
    x = b.input("x", b.tensor(4, 6, dynamic=(0,)))
    cum = b.method("cumsum", x, 1)
    mine = b.call(torch.mul, cum, 2, name="mine")
    bumped = b.call(BUMP_ALL, [mine], 1.0, name="bumped")
    late = b.call(torch.sin, x, name="late")  # reads only x, but after a write of its piece: hoisted all the same
    after = b.call(torch.mul, mine, 3, name="after")
    gm = b.module(after, late, bumped)
    eager = eager_nodes(gm, _symbols(x.meta["val"]), uncapturable={"cumsum"})
    assert _layout(split(gm, eager)) == [["late"], ("eager", "cumsum"), ["mine", "bumped", "after"]]
