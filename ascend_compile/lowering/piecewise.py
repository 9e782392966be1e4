"""Piecewise graphs: a step no full graph serves, run as captured pieces with its attention (and any
op that cannot be captured) run eagerly between them, on the step's real tensors.

The piecewise variant (`passes/pipeline.py: PiecewiseVariant`) is split once per token count
(`passes/split_pieces.py`); each piece is captured for that count, as vLLM's piecewise backend does
(`vllm/compilation/piecewise_backend.py`: one graph per piece and size, attention between), and holds
no lengths, so one set of pieces serves decode, mixed and prefill steps alike. Per step, in graph order:
- a piece: the step's values it reads from outside (the caller's inputs, eager nodes' results) copied
  into its static buffers, the real rows only (one `torch._foreach_copy_`), then its replay and the
  runtime's `after_piece` (nothing on a device, whose eager work queues after it on the same stream:
  no synchronize; the simulator runs that stream's queue, as the device would have); values it
  reads from an earlier piece are that piece's static outputs themselves, in place, and weights and KV
  caches the caller's tensors, their addresses checked each step as a full graph's are;
- an eager node: run as the runtime binds its op (`capture.run_bound`), on the real rows of the
  pieces' outputs (views narrowed to the step's sizes) and the caller's tensors; an attention kernel
  takes the step's own host lists (no padding) and the artifact's workspace slot, sized at compile
  time for every step of the piecewise sizes (`passes/workspaces.py`); where the target refuses the
  kernel the step's lengths (`Target.step_guard`: on NPU, MLA beyond 16 query tokens), every layer's
  attention op as adapted runs instead, writing the kernel's output rows.
At the step's end, `after_piecewise_step` (NPU: the host tensors its eager kernels read are held
until an event the stream records there has passed, never waited for). Everything the step's
eager nodes read stays referenced until the step returns.
Padding rows of a piece's buffers hold earlier steps' values (zeros at first): the ops of a piece are
the padded graph's, whose real rows never read padding rows (`passes/roles.py`, the same condition
full graphs are padded under).
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable, Collection, Sequence

import torch
from torch import fx

from ..gc_pause import gc_paused
from ..passes.fx_utils import example_value, is_op, nodes_in, placeholders, shape_exprs
from ..passes.kernel_call import HOST_META_KEY, HostSource, KernelCall, StepGuard, is_kernel
from ..passes.pipeline import PiecewiseVariant
from ..passes.roles import IN_PLACE_ROLES, PAD_VALUE, GraphSignature, Role
from ..passes.size_symbols import evaluate
from ..passes.split_pieces import EagerNode, Piece, Segment, eager_nodes, padding_safe_writes, piece_module, split
from ..passes.workspaces import GraphKey
from ..runtime.base import GraphRuntime
from . import capture as capture_mod
from .inputs import Geometry, Step, StepPlan, padded_copies, plan_step
from .input_checks import CapturedInputs
from .phase_seconds import PhaseSeconds
from .staging import per_step_shape


def real_plan(step: Step, sources: Sequence[HostSource]) -> StepPlan:
    """The host lists of the step itself, unpadded: what an eager kernel between pieces takes."""
    return plan_step(step, sources, Geometry(step.tokens, step.seqs))


def sym_value(example: Any, symbols: dict) -> Any:
    """A SymInt, SymFloat or SymBool of the graph at given symbol values."""
    value = example.node.expr.xreplace(symbols)
    return bool(value) if isinstance(example, torch.SymBool) else float(value) if isinstance(
        example, torch.SymFloat) else int(value)


SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _narrow(value: Any, example: Any, symbols: dict) -> Any:
    """`value` (padded) cut to a step's sizes, as `example`'s shape expressions give them."""
    if isinstance(value, torch.Tensor):
        shape = shape_exprs(example)
        if shape is None:
            return value
        real = [evaluate(d, symbols) for d in shape]
        if real == list(value.shape):
            return value
        return value[tuple(slice(0, n) for n in real)]
    if isinstance(value, (tuple, list)) and isinstance(example, (tuple, list)):
        return type(value)(_narrow(v, e, symbols) for v, e in zip(value, example))
    if isinstance(example, SYM_TYPES):
        return sym_value(example, symbols)
    return value


class _CapturedPiece:
    """One piece captured: its device graph, static outputs and the buffers it copies each step."""

    def __init__(self, piece: Piece, gm: fx.GraphModule) -> None:
        self.piece = piece
        self.gm = gm
        self.graph: Any = None
        self.outputs: tuple = ()
        self.released: set[int] = set()  # outputs held as weak aliases (`PiecewiseGraph._release`)
        #: (input node, static buffer): values copied in each step (real rows only)
        self.copied: list[tuple[fx.Node, torch.Tensor]] = []


class PiecewiseGraph:
    """The pieces of one piecewise key (a token count) at one value of the specialised sizes."""

    def __init__(self, key: GraphKey, specialization: tuple, variant: PiecewiseVariant, gm: fx.GraphModule,
                 signature: GraphSignature, padded: dict, uncapturable: Any, step_guard: StepGuard | None,
                 kernels_refused: str | None = None, padding_safe: Collection[str] = ()) -> None:
        """`gm`: the piecewise variant as the target runs it (`Target.piecewise_graph`); `step_guard`:
        why the target refuses its kernels a step's lengths, `kernels_refused` why it refuses them every
        step (`Target.eager_reason`: the layers' attention ops then always run instead). A graph one of
        whose kernels has no attention op to run instead serves no step either refuses. `padding_safe`: the
        names of the graph's padding-safe input writes (`mutations.InputWrite`), kept in pieces."""
        self.key = key
        self.specialization = specialization
        self.variant = variant
        self.gm = gm
        self.signature = signature
        self.padded = padded
        self.inputs = placeholders(gm)
        self.index = {node: i for i, node in enumerate(self.inputs)}
        self.host = {node: node.meta[HOST_META_KEY] for node in self.inputs if HOST_META_KEY in node.meta}
        self.sources = list(dict.fromkeys(self.host.values()))
        self.roles = {spec.index: spec.role for spec in signature.inputs}
        self.step_guard = step_guard
        self.fallbacks = self._fallbacks()
        self.kernels_refused = kernels_refused
        #: a kernel node with no attention op to run instead, if any
        self.unbacked = next((n.name for n in gm.graph.nodes if is_kernel(n) and n not in self.fallbacks), None)
        self.eager_reason: str | None = None
        if self.unbacked and kernels_refused:
            self.eager_reason = f"{key}: {kernels_refused}, and {self.unbacked} has no attention op to run instead"
        tokens = signature.tokens
        token_symbols = set(getattr(tokens, "free_symbols", ())) | set(signature.specialized)
        safe = padding_safe_writes(gm, signature, padding_safe)
        self.eager = eager_nodes(gm, token_symbols, uncapturable, safe)
        self.workspace_nodes = [n for n in gm.graph.nodes if is_op(n, torch.ops.ascend.workspace)]
        self.output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self.segments: list[Segment] = split(gm, self.eager, {n: nodes for n, (_, nodes) in self.fallbacks.items()},
                                             safe)
        self.pieces: list[_CapturedPiece] = []
        self.produced: dict[fx.Node, tuple[_CapturedPiece, int]] = {}
        self.buffers: dict[fx.Node, torch.Tensor] = {}  # each value copied in: one static buffer
        self.captured_inputs: CapturedInputs | None = None
        self.capture_seconds = 0.0
        self.verified: dict[str, Any] | None = None
        self.replays = 0
        #: why the target refused the kernels a step's lengths (its layers' attention ops ran instead)
        self.refusals: collections.Counter = collections.Counter()
        self._views: dict[tuple, dict] = {}
        self._dests: dict[tuple, tuple] = {}

    @property
    def name(self) -> str:
        return str(self.key) + "".join(f"[{s}={v}]" for s, v in self.specialization)

    def _fallbacks(self) -> dict[fx.Node, tuple[tuple[Any, tuple, dict], list[fx.Node]]]:
        """Each kernel node's attention call as adapted, over this graph's nodes (by name: the target's
        form of the variant may be a copy), where every node it reads is still in the graph."""
        by_name = {n.name: n for n in self.gm.graph.nodes}
        found = {}
        for node in self.gm.graph.nodes:
            if not is_kernel(node):
                continue
            call = self.variant.attention.get(KernelCall.of(node).meta.attention)
            if call is None:
                continue
            op, args, kwargs = call
            if any(n.name not in by_name for n in nodes_in((args, kwargs))):
                continue
            args, kwargs = fx.node.map_arg((args, kwargs), lambda n: by_name[n.name])
            found[node] = ((op, args, kwargs), nodes_in((args, kwargs)))
        return found

    def describe(self) -> dict[str, Any]:
        eager = [s for s in self.segments if isinstance(s, EagerNode)]
        why = collections.Counter(s.why.split(" (")[0] for s in eager)
        return {
            "pieces": sum(isinstance(s, Piece) for s in self.segments),
            "eager_nodes": len(eager),
            "eager_why": dict(why),
            "captured": bool(self.pieces) and all(p.graph is not None for p in self.pieces),
            "capture_seconds": round(self.capture_seconds, 4),
            "replays": self.replays,
            **({"attention_op_steps": dict(self.refusals)} if self.refusals else {}),
            **({"verified": self.verified} if self.verified is not None else {}),
            **({"eager_reason": self.eager_reason} if self.eager_reason else {}),
        }

    # -- capture -------------------------------------------------------------------------------------

    def capture(self, runtime: GraphRuntime, args: Sequence[Any], checked: Sequence[int], identified: Sequence[int],
                workspace: torch.Tensor, step: Step | None = None) -> None:
        """Capture every piece at the padded sizes, in graph order (later pieces read earlier ones'
        static outputs); raises `errors.UncapturableOp` naming the node a capture refused. With `step`
        (the step it is captured for), each piece is captured on that step's live values
        (`piecewise_live.py`): what earlier pieces and the nodes between them made for it."""
        from .piecewise_live import LiveCapture

        start = time.perf_counter()
        self.pieces, self.produced, self.buffers = [], {}, {}
        live = LiveCapture(self, runtime, step, args, workspace) if step is not None else None
        if live is not None and live.refused:
            live = None
        last_use = self.last_uses()
        with runtime.generators_kept():  # the live run's replays and eager nodes draw nothing of the step's
            for index, segment in enumerate(self.segments):
                if isinstance(segment, Piece):
                    self._release(runtime, last_use, index)
                    self.pieces.append(self._capture_piece(runtime, segment, args, workspace, live))
                elif live is not None:
                    live.run(segment)
            if live is not None:
                live.end()
        self._release(runtime, last_use, len(self.segments) + 1)
        scalars = [spec.index for spec in self.signature.by_role(Role.SCALAR)]
        self.captured_inputs = CapturedInputs(args, checked, scalars, identified)
        self._views, self._dests = {}, {}
        self.capture_seconds = time.perf_counter() - start

    def last_uses(self) -> dict[fx.Node, int]:
        """Each piece output's last reader: the index of its segment (the graph's output: past the last)."""
        where = {n: i for i, s in enumerate(self.segments) for n in (s.nodes if isinstance(s, Piece) else [s.node])}
        reads = {n: set(nodes) for n, (_, nodes) in self.fallbacks.items()}
        readers: dict[fx.Node, int] = {}
        for i, segment in enumerate(self.segments):
            members = segment.nodes if isinstance(segment, Piece) else [segment.node]
            for m in members:
                for a in [*m.all_input_nodes, *reads.get(m, ())]:
                    if where.get(a, i) != i:
                        readers[a] = max(readers.get(a, -1), i)
        for a in self.output.all_input_nodes:
            readers[a] = len(self.segments)
        return readers

    def _release(self, runtime: GraphRuntime, last_use: dict[fx.Node, int], before: int) -> None:
        """Hold the static outputs no segment from `before` on reads only as weak aliases: the graph pool
        may hand their memory to the pieces captured next, as replays run in the same order (as vLLM's
        piecewise backend keeps only each piece's last output; every output, past the last piece: as a
        full graph's, read right after the step)."""
        for node, (captured, i) in self.produced.items():
            value = captured.outputs[i]
            if isinstance(value, torch.Tensor) and last_use.get(node, -1) < before and i not in captured.released:
                outputs = list(captured.outputs)
                outputs[i] = runtime.weak_alias(value)
                captured.outputs = tuple(outputs)
                captured.released.add(i)

    def _capture_piece(self, runtime: GraphRuntime, piece: Piece, args: Sequence[Any], workspace: torch.Tensor,
                       live: Any = None) -> _CapturedPiece:
        """`piece` captured (on `live`'s values, a `piecewise_live.LiveCapture`, then replayed once for it)."""
        captured = _CapturedPiece(piece, piece_module(self.gm, piece))
        values = []
        for node in piece.inputs:
            values.append(self._capture_input(runtime, captured, node, args))
        if live is not None:
            live.copy_in(captured)
        with gc_paused():
            graph, outputs, _ = capture_mod.capture_graph(captured.gm, runtime, values, lambda n: workspace,
                                                          capture_mod.UpdateSchedule(), capture_mod.WorkspaceLifetime(),
                                                          f"{self.name} piece {len(self.pieces)}")
        captured.graph, captured.outputs = graph, tuple(outputs)
        for i, node in enumerate(piece.outputs):
            self.produced[node] = (captured, i)
        if live is not None:
            live.replay(captured)
        return captured

    def _capture_input(self, runtime: GraphRuntime, captured: _CapturedPiece, node: fx.Node, args: Sequence[Any]
                       ) -> Any:
        """What a piece is captured with for one input: an earlier piece's static output, the caller's
        in-place tensor, a padded SymInt, or a static buffer copied into each step."""
        if node in self.produced:
            producer, i = self.produced[node]
            return producer.outputs[i]
        example = example_value(node)
        index = self.index.get(node)
        if index is not None and index < len(args) and self.roles.get(index) in (*IN_PLACE_ROLES, Role.SCALAR):
            return args[index]  # used in place: its address (a host scalar: its value) is checked each step
        if isinstance(example, SYM_TYPES):
            return sym_value(example, self.padded)
        if not isinstance(example, torch.Tensor):
            if index is not None and index < len(args):
                return args[index]
            raise ValueError(f"{node.name}: a piece reads a non-tensor value made outside it ({type(example).__name__})")
        if node in self.buffers:  # copied in by the first piece reading it, which runs before this one
            return self.buffers[node]
        shape = tuple(evaluate(d, self.padded) for d in shape_exprs(example))
        buffer = runtime.empty(shape, example.dtype).fill_(PAD_VALUE.get(self.roles.get(index), 0))
        captured.copied.append((node, buffer))
        self.buffers[node] = buffer
        return buffer

    # -- one step ------------------------------------------------------------------------------------

    def plan(self, step: Step, args: Sequence[Any], counted: bool = True) -> tuple[StepPlan, bool, str | None]:
        """The step's own host lists, whether its kernels run (else the layers' attention ops), and why
        the step cannot run on these pieces (the target refuses a kernel that has no op to run instead)."""
        plan = real_plan(step, self.sources)
        if self.kernels_refused is not None:
            return plan, False, None
        refusal = self.step_guard(plan.host, list(args)) if self.step_guard is not None else None
        if refusal is None:
            return plan, True, None
        if self.unbacked:
            return plan, False, f"{refusal}, and {self.unbacked} has no attention op to run instead"
        if counted:  # a refused step counted once: not in the capture's plan of the step `serve` plans again
            self.refusals[refusal] += 1
        return plan, False, None

    def run(self, runtime: GraphRuntime, step: Step, plan: StepPlan, use_kernels: bool, args: Sequence[Any],
            workspace: torch.Tensor, seconds: PhaseSeconds, launches: collections.Counter) -> list[Any]:
        """One step through the pieces (`plan`, `use_kernels`: as `plan` said); the graph's outputs at
        the step's sizes (views of static outputs where a piece made them)."""
        symbols = step.symbols
        shape_key = tuple(symbols.values())
        views = per_step_shape(self._views, shape_key, lambda: self._narrowed(symbols))
        dests = per_step_shape(self._dests, shape_key, lambda: self._destinations(symbols))
        env: dict[fx.Node, Any] = dict.fromkeys(self.workspace_nodes, workspace)

        def value(node: fx.Node) -> Any:
            found = views.get(node)
            if found is not None or node in views:
                return found
            if node in env:
                return env[node]
            host = self.host.get(node)
            if host is not None:
                return plan.host[host]
            return args[self.index[node]]

        piece_index = 0
        for segment in self.segments:
            if isinstance(segment, Piece):
                captured = self.pieces[piece_index]
                targets, padding = dests[piece_index]
                piece_index += 1
                t0 = time.perf_counter()
                if targets:
                    torch._foreach_copy_(targets + [d for d, _ in padding],
                                         [value(node) for node, _ in captured.copied] + [c for _, c in padding])
                    launches["copies"] += 1
                t1 = time.perf_counter()
                captured.graph.replay()
                t2 = time.perf_counter()
                runtime.after_piece()  # what the host issues next (the eager nodes) reads its results
                seconds.replayed(t0, t1, t2, time.perf_counter())
                launches["replays"] += 1
                continue
            node = segment.node
            env[node] = self.run_eager(runtime, node, value, workspace, use_kernels)
            launches["eager_ops"] += 1
        runtime.after_piecewise_step()
        self.replays += 1
        return list(fx.node.map_arg(self.output.args[0], value))

    def run_eager(self, runtime: GraphRuntime, node: fx.Node, value: Callable[[fx.Node], Any],
                   workspace: torch.Tensor, use_kernels: bool) -> Any:
        args = fx.node.map_arg(node.args, value)
        kwargs = fx.node.map_arg(node.kwargs, value)
        if not use_kernels and node in self.fallbacks:
            (op, call_args, call_kwargs), _ = self.fallbacks[node]
            result = op(*fx.node.map_arg(call_args, value), **fx.node.map_arg(call_kwargs, value))
            out = value(KernelCall.of(node).arg("out"))  # the kernel's output is its `out` argument
            out.copy_(result.view(out.shape))
            return None
        if node.op == "call_function":
            return runtime.kernel(node.target)(*args, **kwargs)
        if node.op == "call_method":
            self_obj, *rest = args
            return getattr(self_obj, node.target)(*rest, **kwargs)
        raise ValueError(f"{node.name}: a {node.op} node cannot run between pieces")

    def _narrowed(self, symbols: dict) -> dict[fx.Node, Any]:
        """Every piece output cut to the step's sizes (views of the static outputs, made once per step shape)."""
        return {node: _narrow(captured.outputs[i], example_value(node), symbols)
                for node, (captured, i) in self.produced.items()}

    def _destinations(self, symbols: dict) -> list[tuple[list, list]]:
        """Per piece, the regions of its static buffers a step's values are copied into, then the
        padding copies of the inputs padded by role (a slot mapping's -1 past the step's tokens, which
        the pieces' cache writes skip): (destination, constant) pairs."""
        return [self.piece_copies(captured, symbols) for captured in self.pieces]

    def piece_copies(self, captured: _CapturedPiece, symbols: dict) -> tuple[list, list]:
        """One piece's copy-in at a step's sizes: the regions of its buffers, and its padding copies."""
        tokens, inputs = evaluate(self.signature.tokens, symbols), self.signature.inputs
        dests, padding = [], []
        for node, buffer in captured.copied:
            real = _narrow(buffer, example_value(node), symbols)
            index = self.index.get(node)
            if index is None or index >= len(inputs):  # an eager node's result: its real rows only
                dests.append(real)
                continue
            first, *rest = padded_copies(inputs[index], real.shape, buffer, tokens, self.key.bucket)
            dests.append(first[0])
            padding += rest
        return dests, padding

    def memory(self) -> dict[str, int]:
        def nbytes(values: Sequence[Any]) -> int:
            return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))

        return {"static_inputs_bytes": sum(nbytes([b for _, b in p.copied]) for p in self.pieces),
                "outputs_bytes": sum(nbytes([o for i, o in enumerate(p.outputs) if i not in p.released])
                                     for p in self.pieces)}
