"""The device memory our graphs take outside vLLM's KV-cache budget: estimated before vLLM sizes
its KV cache, and measured after each capture.

vLLM sizes its KV cache from an eager profiling run, counting 0 bytes for graphs under
`cudagraph_mode=NONE`; the profiling run has no attention metadata and no caches, so nothing of
ours can be compiled, let alone captured, before that sizing. What the captures will take is
therefore estimated then (`estimate`), by host arithmetic only: nothing runs on the device, no
throwaway capture (vLLM-Ascend reverted an estimator that warmed up and captured before the KV cache
existed, #11562: its extra capture hung an HCCL collective). The graph's own binder rewrites a copy
of it against a planning context (`planning_context.py`: vLLM's layers, stand-in metadata and caches
of fake tensors), and the pass pipeline runs over it as the compile will, for the kernels, the
buckets and the workspace plan. From that:

- the workspace slots: the plan's slots as `Target.workspace_estimate` sizes them, which is the compile's
  own sizing where the target's need is a formula (the simulator, CUDA) but on `npu` the simulator's
  formula, torch_npu's queries being asked only at the compile: the device's answers may differ (MLA's
  max workspace is sized by the core count, ops-transformer c29bc106 `fia_tiling_nonquant_mla.cpp`
  L431-437), and the figure measured after each capture says by how much;
- each graph's static input buffers: its copied inputs at its bucket's padded sizes, as staged;
- the graph pool: each rewritten graph's allocations traced on fake tensors
  (`passes/memory_estimate.py`) and replayed in capture order (decode graphs largest first as
  `capture_all` does, then mixed ones) over a model of the runtime's pool allocator
  (`runtime/pool_model.py`);
- the piecewise graphs (`lowering/piecewise.py`, sizes up to vLLM's `max_num_batched_tokens`):
  the pieces traced one by one, each output held until its last reader is captured, every size's
  replayed smallest first on a pool model of their own (added: see `_piece_pool`), and every size's
  static buffers.

It covers every graph the compile can capture (each bucket's decode graph and, where its decode
kernels include one of the target's `mixed_graph_kernels`, its mixed graph: PA on every target, FIA and
MLA too on the simulator and `npu`), and the piecewise sizes: what serving reaches, not just
`capture_all`. "auto" kernels are sized for both kernels it may pick. `kv_budget.py` takes the figure
out of vLLM's KV-cache budget; `ASCEND_COMPILE_GRAPH_MEMORY` overrides it (bytes; 0 reserves nothing). After each new capture the
measured figure is logged beside the reserved one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import weakref
from typing import Any, Iterator

import torch

from ...lowering.inputs import padded_shape
from ...passes.fx_utils import example_value, size_expr
from ...passes.roles import IN_PLACE_ROLES, Role
from ...passes.size_symbols import evaluate
from ...passes.memory_estimate import pool_reserved, trace_allocations
from ...passes.pipeline import rewrite_buckets
from ...passes.providers import fake_mode_of
from ...runtime.pool_model import one_kernel, pool_model
from .planning_context import planning_context

log = logging.getLogger("ascend_compile")
MIB = 2 ** 20
#: Bytes to reserve instead of the estimate (0: reserve nothing); unset or "auto": the estimate.
ENV = "ASCEND_COMPILE_GRAPH_MEMORY"
#: The pieces' pool, modelled piece by piece, is short of what the simulator's captures of them reserve:
#: by 2.3% for vLLM's Llama (hidden 256, 1024 tokens, 64 KiB segments; pieces alone 17.37 MB measured,
#: 16.98 modelled; the example Llama's match to the byte). Each piece's allocations match the simulator's
#: exactly (counts and bytes); the pool model reuses freed blocks across the pieces' captures more than
#: the simulator does (not found why yet). Until it is, the figure takes 5% more for them.
PIECES_MARGIN = 1.05

#: The vLLM graphs of this process (`DeferredCompile`s), each with the order it was handed over in.
_TRACKED: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_HANDED_OVER = [0]


def track(graph: Any) -> None:
    """Count `graph` (a `DeferredCompile`) among the graphs handed over from now on."""
    _HANDED_OVER[0] += 1
    _TRACKED[graph] = _HANDED_OVER[0]


def handed_over() -> int:
    """How many graphs were handed over so far (`tracked(since=...)`)."""
    return _HANDED_OVER[0]


_RESERVED = [False]  # whether this process took graph memory out of vLLM's KV-cache budget


def reserved_once() -> None:
    """Note that this process reserved graph memory before vLLM sized its KV cache (`kv_budget.py`)."""
    _RESERVED[0] = True


def tracked(since: int = 0) -> list[Any]:
    """The graphs handed over after the first `since` and not compiled yet (what one profiling
    run handed over, for `since` taken before it)."""
    return [g for g, n in list(_TRACKED.items()) if n > since and g.compiled is None]


@dataclasses.dataclass(frozen=True)
class GraphMemoryEstimate:
    """What a vLLM graph's captures will take, by kind (see the module docstring), in bytes."""

    workspaces: int
    buffers: int
    pool: int
    graphs: int  # the graphs it covers

    @property
    def total(self) -> int:
        return self.workspaces + self.buffers + self.pool

    def describe(self) -> str:
        return (f"{self.total / MIB:.1f} MiB (workspaces {self.workspaces / MIB:.1f}, static buffers "
                f"{self.buffers / MIB:.1f}, graph pool {self.pool / MIB:.1f} MiB, over {self.graphs} graphs)")


def graph_memory(report: dict[str, Any]) -> dict[str, int]:
    """Bytes by kind from `CompiledArtifact.memory_report()`: workspaces, static input buffers, and
    the graph pool where the runtime reports one (the graphs' outputs live in it)."""
    buffers = sum(graph["static_inputs_bytes"] for graph in report["graphs"].values())
    buffers += sum(graph["static_inputs_bytes"] for graph in report.get("piecewise", {}).values())
    pool = report.get("pool", {}).get("graph", {}).get("reserved_bytes", 0)
    return {"workspaces": sum(report["workspace_bytes"].values()), "buffers": buffers, "pool": pool}


def _captures(artifact: Any) -> int:
    """The artifact's captures so far: its full graphs and its piecewise sizes."""
    return artifact.stats["captures"] + artifact.stats["piecewise_captures"]


def log_graph_memory(artifact: Any, reserved: int | None = None) -> int:
    """Log the artifact's graph memory now (after a capture) beside what was `reserved` before the
    KV cache was sized (None: nothing was); the total in bytes."""
    parts = graph_memory(artifact.memory_report())
    total = sum(parts.values())
    detail = (f"(workspaces {parts['workspaces'] / MIB:.1f}, static buffers {parts['buffers'] / MIB:.1f}, "
              f"graph pool {parts['pool'] / MIB:.1f} MiB)")
    if reserved is None and _RESERVED[0]:
        log.warning("ascend_compile: a vLLM graph handed over after the KV cache was sized (dynamo compiled the "
                    "model again) takes %.1f MiB after %d captures %s outside vLLM's KV-cache budget, none of it "
                    "reserved: set %s to the total of every graph's figure logged", total / MIB,
                    _captures(artifact), detail, ENV)
    elif reserved is None:
        log.info("ascend_compile: vLLM graphs take %.1f MiB outside vLLM's KV-cache budget after %d captures %s: "
                 "reserve it by lowering gpu_memory_utilization or kv_cache_memory_bytes", total / MIB,
                 _captures(artifact), detail)
    elif total > reserved:
        log.warning("ascend_compile: vLLM graphs take %.1f MiB after %d captures %s, more than the %.1f MiB "
                    "reserved before the KV cache was sized: set %s to at least %d", total / MIB,
                    _captures(artifact), detail, reserved / MIB, ENV, total)
    else:
        log.info("ascend_compile: vLLM graphs take %.1f MiB after %d captures %s, of the %.1f MiB reserved "
                 "before the KV cache was sized", total / MIB, _captures(artifact), detail, reserved / MIB)
    return total


def override() -> int | None:
    """The bytes `ASCEND_COMPILE_GRAPH_MEMORY` sets (None: estimate)."""
    value = os.environ.get(ENV, "auto").strip()
    if value == "auto":
        return None
    try:
        nbytes = int(value)
    except ValueError:
        nbytes = -1
    if nbytes < 0:
        raise ValueError(f"{ENV}: expected 'auto' or a number of bytes >= 0, got {value!r}")
    return nbytes


class _Planning:
    """`target` as the passes see it when estimating: workspaces sized by `Target.workspace_estimate`
    (PA's and FIA's by formula, torch_npu's own queries for them asked at the compile; MLA's reservation
    asked of the device now, before vLLM sizes its KV cache: `targets.NpuTarget.workspace_estimate`)."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def workspace_need(self, config: Any, dtype: torch.dtype) -> Any:
        return self._target.workspace_estimate(config, dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The estimate's rewrite logs nothing below WARNING: it is not the compile."""
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(level)


def _piecewise_graph(rewritten: Any, key: Any) -> Any:
    """`key`'s piecewise graph, split as the runner splits it (`lowering/piecewise.py`), not captured."""
    from ...lowering.piecewise import PiecewiseGraph

    safe = {w.node for w in rewritten.mutations.writes if w.padding_safe}
    padded = rewritten.signature.padded_symbols(key.bucket, rewritten.max_blocks)
    return PiecewiseGraph(key, (), rewritten.piecewise, rewritten.piecewise.gm, rewritten.signature, padded, (),
                          None, None, safe)


def _piece_pool(rewritten: Any, runtime: Any) -> int | None:
    """The pool the pieces of every piecewise size reserve on a pool model of their own, the sizes'
    pieces replayed as they are captured, smallest size first: each piece's allocations traced (once:
    the split is the same at every size), its outputs held until the last piece reading them is
    captured (`PiecewiseGraph._release`), all let go when the size's last piece is. None where a
    piece's allocations cannot be traced. A size's pieces are captured when a step first needs them,
    in whatever order serving meets the sizes, and a larger size's blocks fit in only some of what a
    smaller one freed: the smallest first reserves the most (measured on the simulator, every order
    of three sizes: largest first reserves what the largest alone does, smallest first up to 12.5%
    more). The figure adds it to the full graphs' pool: how much of their freed blocks a caching
    allocator hands the pieces depends on which full graphs serving captured first; on a pool of
    their own the pieces need at most fresh segments."""
    from ...passes.split_pieces import Piece, piece_module

    graph = _piecewise_graph(rewritten, rewritten.piecewise.keys[-1])
    traces = {}
    for index, segment in enumerate(graph.segments):
        if isinstance(segment, Piece):
            traces[index] = trace = trace_allocations(piece_module(graph.gm, segment), one_kernel(runtime))
            if trace is None:
                return None
    last_use = graph.last_uses()
    model = pool_model(runtime)
    for key in sorted(rewritten.piecewise.keys, key=lambda k: k.bucket):
        values = rewritten.signature.padded_symbols(key.bucket, rewritten.max_blocks)
        held: dict[Any, int] = {}  # a pool handle -> the last segment reading what it holds
        for index, trace in traces.items():
            for handle in [h for h, last in held.items() if last < index]:
                model.release(handle)
                del held[handle]
            handles = trace.replay_held(model, values)
            for node, ids in zip(graph.segments[index].outputs, trace.outputs):
                for ident in ids:
                    held[handles[ident]] = max(held.get(handles[ident], -1), last_use.get(node, -1))
            for ident, handle in handles.items():  # held by no output: released with the capture
                if handle not in held:
                    model.release(handle)
        for handle in held:
            model.release(handle)
    return model.reserved_bytes()


def _piece_buffers(rewritten: Any) -> int:
    """Every piecewise size's static input buffers, as the pieces make them (`PiecewiseGraph._capture_input`):
    one per value a piece reads that no piece made and that is not used in place."""
    from ...passes.split_pieces import Piece

    graph = _piecewise_graph(rewritten, rewritten.piecewise.keys[-1])  # the split is the same at every size
    pieces = [s for s in graph.segments if isinstance(s, Piece)]
    made = {n for p in pieces for n in p.nodes}
    copied = []
    for node in dict.fromkeys(n for p in pieces for n in p.inputs):
        index = graph.index.get(node)
        value = example_value(node)
        if node in made or not isinstance(value, torch.Tensor) or (
                index is not None and graph.roles.get(index) in (*IN_PLACE_ROLES, Role.SCALAR)):
            continue
        copied.append(([size_expr(d) for d in value.shape], value.dtype.itemsize))
    sizes = [rewritten.signature.padded_symbols(k.bucket, rewritten.max_blocks) for k in rewritten.piecewise.keys]
    return sum(math.prod(evaluate(d, values) for d in shape) * itemsize for values in sizes for shape, itemsize in copied)


def estimate(graph: Any, vllm_config: Any) -> GraphMemoryEstimate | None:
    """The memory `graph`'s captures will take (see the module docstring), or None where its
    allocations cannot be traced (said why)."""
    gm, config = graph.gm, graph.config
    fake_mode = fake_mode_of(gm)
    tensors = [v for v in map(example_value, gm.graph.find_nodes(op="placeholder")) if isinstance(v, torch.Tensor)]
    device = tensors[0].device
    target = graph.target(device, config)
    runtime = target.runtime
    max_blocks = -(-config.max_model_len // int(vllm_config.cache_config.block_size))
    context = planning_context(graph.layers, vllm_config, device, fake_mode, max_blocks)
    binder = type(graph.binder)(lambda: context, graph.example_inputs)  # the graph's binder, on that context
    # "auto" times kernels on the device: sized for both of its choices instead
    kinds = ("pa", "fia") if config.kernel_policy == "auto" else (config.kernel_policy,)
    estimates = []
    for kind in kinds:
        planned = dataclasses.replace(config, kernel_policy=kind, dump_dir=None)
        with _quiet():
            rewritten = rewrite_buckets(gm, planned, _Planning(target), bind=binder)
        workspaces = sum(slot.nbytes for slot in rewritten.plan.slots.values())
        model = pool_model(runtime)
        if model is None:  # no graphs: the slots only
            estimates.append(GraphMemoryEstimate(workspaces, 0, 0, 0))
            continue
        keys = sorted(rewritten.choices, key=lambda k: (not k.decode, -k.bucket))  # capture order
        signature = rewritten.signature
        if signature.specialized:  # captured per value seen: how many, no one knows before serving
            log.warning("ascend_compile: no graph memory estimate: the graph keeps sizes %s as seen",
                        [str(sym) for sym in signature.specialized])
            return None
        traces = {name: trace_allocations(v.gm, one_kernel(runtime)) for name, v in rewritten.variants.items()}
        if any(t is None for t in traces.values()):
            return None
        values = {key: signature.padded_symbols(key.bucket, rewritten.max_blocks) for key in keys}
        captures = [(traces[rewritten.variant_for(key).name], values[key]) for key in keys]
        pool = pool_reserved(model, captures)
        if rewritten.piecewise is not None:  # on a pool of their own, added (see `_piece_pool`)
            pieces = _piece_pool(rewritten, runtime)
            if pieces is None:
                return None
            pool += math.ceil(pieces * PIECES_MARGIN)
        placeholders = next(iter(rewritten.variants.values())).gm.graph.find_nodes(op="placeholder")
        itemsize = {spec.index: example_value(placeholders[spec.index]).dtype.itemsize
                    for spec in signature.inputs if spec.copied}
        buffers = sum(math.prod(padded_shape(spec, values[key])) * itemsize[spec.index]
                      for key in keys for spec in signature.inputs if spec.copied)
        buffers += _piece_buffers(rewritten) if rewritten.piecewise is not None else 0
        estimates.append(GraphMemoryEstimate(workspaces, buffers, pool, len(keys)))
    return max(estimates, key=lambda e: e.total)
