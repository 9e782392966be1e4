"""Which piecewise graph serves a step the runner could not serve with a full graph, captured (again)
when needed, and its run: checked against eager on its first step where `verify` is on, its outputs
returned as a full graph's are (`runner.py` owns the undo and the statistics of the step)."""
from __future__ import annotations

import collections
import logging
from typing import Any, Sequence

from torch import fx

from ..errors import UncapturableOp
from ..passes.workspaces import GraphKey
from .graph_entry import specialization_of
from .inputs import Step
from .outputs import returned_outputs
from .piecewise import PiecewiseGraph

log = logging.getLogger("ascend_compile")


class PiecewiseServer:
    """The piecewise graphs of one compiled artifact (`runner.CompiledArtifact`), by piecewise key and
    value of the specialized sizes."""

    def __init__(self, art: Any) -> None:
        self.art = art
        self.graphs: dict[tuple[GraphKey, tuple], PiecewiseGraph] = {}
        self.gms: dict[GraphKey, fx.GraphModule] = {}  # the target's form of the variant, per key
        #: host work of piecewise steps: pieces replayed, copies staged, nodes run eagerly
        self.launches: collections.Counter = collections.Counter()
        #: the graph's padding-safe input writes (the cache writes), which pieces may hold
        self.padding_safe = {w.node for w in art.rewritten.mutations.writes if w.padding_safe}

    def graph_for(self, args: Sequence[Any], step: Step, direct: bool) -> tuple[PiecewiseGraph | None, str]:
        """The graph serving `step` (captured if new, or again where its in-place inputs moved: a direct
        call raises `MovedInputs` instead), or None and why none does."""
        art = self.art
        keys = art.rewritten.piecewise.keys
        key = next((k for k in keys if k.bucket >= step.tokens), None)
        if key is None:
            return None, f"above the largest piecewise size ({keys[-1].bucket} tokens)"
        specialization = specialization_of(art.signature, step.symbols)
        graph = self.graphs.get((key, specialization))
        if graph is not None and graph.captured_inputs is not None and art.moved(graph, args, step, direct):
            graph = None
        if graph is None:
            if sum(
                    1 for k, _ in self.graphs if k == key) >= art.config.max_specializations:
                return None, (f"{key} already has {art.config.max_specializations} captures for other values "
                              f"of the specialized sizes")
            graph = self.graphs[(key, specialization)] = self._capture_for(key, specialization, args, step)
            art.write_plan()
        if graph.eager_reason:
            return None, graph.eager_reason
        return graph, ""

    def serve(self, graph: PiecewiseGraph, step: Step, args: Sequence[Any]) -> tuple[Any, str | None]:
        """What `run` needs of the step (its plan and kernel choice), or why `graph` cannot serve it."""
        plan, use_kernels, why = graph.plan(step, args)
        return (plan, use_kernels), why

    def _capture_for(self, key: GraphKey, specialization: tuple, args: Sequence[Any], step: Step) -> PiecewiseGraph:
        """`_capture` for `step`, which runs the step's nodes between pieces (`piecewise_live.py`): where one
        raises, the step failed, as in its run (`runner._transaction`): what it may have written is put back
        and the error names the cache rows it may have written."""
        art = self.art
        undo = art.undo.save(args, art.config.save_cache_rows)
        try:
            return self._capture(key, specialization, args, step)
        except BaseException as err:
            undo.restore()
            art.stats["failed_steps"] += 1
            written = art.undo.failure_note(undo, args, step)
            log.warning("ascend_compile: %s: the step raised %s while captured; %s", key, type(err).__name__, written)
            getattr(err, "add_note", lambda _: None)(f"ascend_compile: {key}: {written}")
            raise

    def _capture(self, key: GraphKey, specialization: tuple, args: Sequence[Any], step: Step) -> PiecewiseGraph:
        """Split and capture `key`'s pieces; a piece whose capture an op refuses is split again around
        that op (every later split too), as many times as ops are found. A capture the device refuses
        (`capture_failures.py`) costs this size: its steps run eagerly, its pieces captured so far freed."""
        art = self.art
        variant = art.rewritten.piecewise
        padded = art.signature.padded_symbols(key.bucket, art.rewritten.max_blocks, step.symbols)
        gm = self.gms.get(key)
        if gm is None:
            gm = self.gms[key] = art.target.piecewise_graph(variant.gm, key, art.config)
        guard = art.target.step_guard(gm, key, art.config)
        refused = art.target.eager_reason(gm, key)
        while True:
            graph = PiecewiseGraph(key, specialization, variant, gm, art.signature, padded, set(art.uncapturable),
                                   guard, refused, self.padding_safe)
            try:
                art.failures.begin(graph.name)  # `NotTried` once the device's streams ran out
                graph.capture(art.runtime, args, art.checked, art.identified, self.workspace(key), step)
            except UncapturableOp as err:
                if err.op in art.uncapturable:
                    raise
                art._note_uncapturable(err)
                continue
            except RuntimeError as err:
                failure: RuntimeError | None = art.failures.device_failure(graph.name, key.bucket, (), err)
            else:
                failure = None
            why = art.failures.settle(graph.name, gm, failure)
            if why:
                graph.eager_reason, graph.pieces, graph.produced = why, [], {}
                return graph
            art.stats["piecewise_captures"] += 1
            log.info("ascend_compile: captured %s: %d pieces around %d eager nodes in %.3f s", graph.name,
                     len(graph.pieces), len(graph.segments) - len(graph.pieces), graph.capture_seconds)
            return graph

    def workspace(self, key: GraphKey) -> Any:
        art = self.art
        return art.workspaces[art.rewritten.plan.graph_slot[str(key)]]

    def run(self, graph: PiecewiseGraph, served: Any, step: Step, args: Sequence[Any], caller_args: Sequence[Any]
            ) -> tuple:
        """One step on `graph` (`served`: what `serve` said): its first (and, with `verify_every`, every
        Nth, as a full graph's replays) checked against the step run eagerly (`verify.py`) where `verify`
        is on; a graph that differs serves no later step."""
        art = self.art
        run = lambda: self._outputs(graph, served, step, args)  # noqa: E731
        every = art.config.verify_every
        if not art.verify or not (graph.verified is None or (every and graph.replays % every == 0)):
            return run()
        replay = graph.replays + 1
        outputs, graph.verified = art.verified_run(graph.name, args, caller_args, run)
        graph.verified["replay"] = replay
        if not graph.verified["ok"]:
            graph.eager_reason = (f"{graph.name}: its step {replay} differed from eager "
                                  f"({graph.verified['mismatches'][0]})")
        art.write_plan()
        return outputs

    def _outputs(self, graph: PiecewiseGraph, served: Any, step: Step, args: Sequence[Any]) -> tuple:
        art = self.art
        plan, use_kernels = served
        outputs = graph.run(art.runtime, step, plan, use_kernels, args, self.workspace(graph.key), art.seconds,
                            self.launches)
        write_back = art.rewritten.write_back
        aliased = dict(zip(write_back.outputs, write_back.views(args)[1])) if write_back.outputs else {}
        return returned_outputs(outputs, art.config.clone_outputs, aliased)
