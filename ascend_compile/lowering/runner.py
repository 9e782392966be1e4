"""The runner: what `torch.compile` calls each step.

Per call: read the step (one host conversion per length input), pick the bucket and its graph, plan
it (padded host lists), copy the inputs into static buffers, replay, apply the update table, the
runtime's `after_replay`, copy back what the step writes, unpad and clone the outputs; nothing else
runs outside the graph (a failed step: `undo.py`). Steps no graph holds run piecewise or eagerly.
Parameters, buffers, KV caches and host scalars are used in place, checked every step, and a graph
whose inputs moved is re-captured (`input_checks.py`).

Dynamo calls the artifact (`__call__`, reporting itself to the direct dispatcher's probe, `served.py`);
the direct dispatcher calls `call_direct`, where moved inputs raise `MovedInputs` (not re-captured)
so that the step goes through dynamo's guards. Each graph is a `GraphEntry` (`graph_entry.py`).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Sequence

import torch
from torch import fx

from ..config import CompileConfig
from ..errors import UncapturableOp
from ..passes import dump
from ..passes.find_attention import attention_nodes
from ..passes.padding import packed_capture
from ..passes.pipeline import RewrittenGraphs
from ..passes.roles import IN_PLACE_ROLES, GraphSignature
from ..passes.size_symbols import SymbolKind
from ..passes.workspaces import WORKSPACE_META_KEY, GraphKey
from ..runtime.base import GraphRuntime, Runtime
from . import capture as capture_mod, report, served
from .capture_failures import CaptureFailures
from .graph_entry import GraphEntry, MovedInputs, specialization_of
from .inputs import Step, StepPlan, capture_seq_len, choose_bucket, overlapping_inputs, read_step, step_kind
from .input_checks import ChangeLog
from .outputs import narrowed_outputs, returned_outputs
from .phase_seconds import PhaseSeconds
from .piecewise import PiecewiseGraph
from .piecewise_serve import PiecewiseServer
from .staging import Staging
from .startup import Startup, progress
from .undo import UndoPlan
from .verify import first_replay_check, written_regions

log = logging.getLogger("ascend_compile")


class CompiledArtifact:
    """The callable dynamo runs in place of the graph; owns graphs, buffers and workspace slots."""

    def __init__(self, rewritten: RewrittenGraphs, target: Any, config: CompileConfig) -> None:
        self.rewritten = rewritten
        self.signature: GraphSignature = rewritten.signature
        self.target = target
        self.runtime: Runtime = target.runtime
        self.has_graphs = isinstance(self.runtime, GraphRuntime)  # asked on every step: an ABC's check is not free
        self.config = config
        self.lock, self.fixed = threading.Lock(), None  # fixed: the direct call's (`call_direct`)
        self.group = None  # the workspace group sharing its slot, runtime and lock (`workspace_group.py`)
        self.graphs: dict[tuple[GraphKey, tuple], GraphEntry] = {}
        self.specialized: dict[GraphKey, fx.GraphModule] = {}
        #: the step's counters; those of work outside graphs shown even at 0 (`plan.json`, `inspect`)
        self.stats: collections.Counter = collections.Counter(launches_outside_graph=0, saved_bytes=0, synchronizes=0)
        #: Seconds spent per phase of graph steps: copy_in, launch_and_updates, synchronize (the
        #: device work, or on the simulator its execution), host (the rest of the runner's step).
        self.seconds = PhaseSeconds()
        self._fallbacks_logged: set[str] = set()
        #: ops found uncapturable (`errors.UncapturableOp`) -> why: every graph holding one serves eagerly
        self.uncapturable: dict[Any, str] = {}
        #: the piecewise graphs (`piecewise_serve.py`), and `piecewise`: them by key and specialized sizes
        self.pieces = PiecewiseServer(self)
        self.failures = CaptureFailures(self.stats, self.runtime.device)  # captures the device refused
        self.startup = Startup()  # the compile's phases and graph budget, set by the backend (`startup.py`)
        self.piecewise: dict[tuple[GraphKey, tuple], PiecewiseGraph] = self.pieces.graphs
        #: steps by kind ("decode", "mixed", "prefill") and what served them ("full", "piecewise", "eager")
        self.served: collections.Counter = collections.Counter()
        #: why steps a full graph did not serve went piecewise or eager, and how many
        self.not_full: collections.Counter = collections.Counter()
        self.written = rewritten.mutations.written()
        self.copied = {spec.index for spec in self.signature.inputs if spec.copied}
        #: the alias groups where a step's inputs could overlap a staged input the graph writes (`_step`)
        self.alias_groups = [g for g in rewritten.mutations.alias_groups if g & self.written and g & self.copied]
        self.names = {spec.index: spec.name for spec in self.signature.inputs}
        self.changes = ChangeLog(self.signature, self.names)  # what moved since a graph's capture, logged once
        self.layers = len(attention_nodes(rewritten.original))  # the depth `verify`'s tolerance grows with
        self.restore = sorted({w.input for w in rewritten.mutations.unsafe()} - self.copied)
        #: the in-place inputs whose addresses a captured graph holds, checked every step
        self.checked = [spec.index for spec in self.signature.inputs if spec.role in IN_PLACE_ROLES
                        and not (config.frozen_parameters and spec.parameter)]
        #: whether steps are padded to the buckets' token counts: else each step size gets a capture of its
        #: own (a static graph, or `GraphSignature.pad_reason`), and a bucket's key says nothing of its sizes
        self.pads_tokens = SymbolKind.TOKENS in self.signature.symbol_kinds.values()
        #: under `frozen_parameters`, the parameters: the same objects as at capture, every step
        self.identified = [spec.index for spec in self.signature.inputs if spec.role in IN_PLACE_ROLES
                           and config.frozen_parameters and spec.parameter]
        #: first replays checked against eager (`verify.py`): by default where the runtime asks for it
        self.verify = config.verify if config.verify is not None else self.runtime.verify_first_replays
        self.workspaces = {slot.name: self.runtime.empty((slot.nbytes,), torch.uint8)
                           for slot in rewritten.plan.slots.values()}
        #: what dynamo passes this graph, where it gets it (`dispatch/graph_inputs.py`): set by the backend
        self.graph_inputs: Any = None
        #: what a step's graph may write in place: inputs written whole saved before it runs and put back if
        #: it raises, caches' rows only under `save_cache_rows`; a failed step names the rows it wrote (`undo.py`)
        self.undo = UndoPlan.of(next(iter(rewritten.variants.values())).gm, rewritten.mutations,
                                self.written - self.copied)
        self.write_plan()

    def workspaces_for(self, key: GraphKey) -> capture_mod.WorkspaceFor:
        """The artifact-owned tensor of the slot each workspace node stands for in `key`'s graph."""
        return lambda node: self.workspaces[node.meta[WORKSPACE_META_KEY][str(key)]]

    def __call__(self, *args: Any) -> Any:
        result = self._call(args, direct=False)
        served.report(self, args, result)
        return result

    def call_direct(self, args: Sequence[Any], fixed: frozenset[int] | None = None) -> Any:
        """One step called by the direct dispatcher, not by dynamo: as `__call__`, but a graph whose
        in-place inputs moved raises `MovedInputs` instead of being captured again, so that the step
        goes through dynamo, whose guards see what else changed with them (a module converted to
        another dtype). `fixed`: the route's positions holding the same objects every call (`input_checks.py`)."""
        return self._call(args, True, fixed)

    def _call(self, args: Sequence[Any], direct: bool, fixed: frozenset[int] | None = None) -> Any:
        with self.lock:
            self.fixed, seconds = fixed, self.seconds
            start, before = time.perf_counter(), seconds.device
            result = self._step(self.rewritten.prologue.extend(args), args, direct)
            seconds["host"] += time.perf_counter() - start - (seconds.device - before)
            return result

    def _count(self, step: Step, sign: int) -> None:
        stats, reads = self.stats, step.reads
        stats["steps"] += sign
        stats["host_conversions"] += sign * reads
        stats["host_copies"] += sign * (len(step.seq_lens) + len(step.query_start_loc) - reads)  # `Step.copies`

    def _step(self, args: Sequence[Any], caller_args: Sequence[Any], direct: bool) -> Any:
        """One step: `args` are the graph's inputs (the caller's, then any hoisted metadata). Under grad
        mode with an input requiring grad (which dynamo 2.10's guards miss) it runs as traced, with autograd."""
        if torch.is_grad_enabled() and any(getattr(a, "requires_grad", False) for a in args):
            return self._fallback(caller_args, "grad mode is on and an input requires grad (autograd kept)")
        step = read_step(self.signature, args, self.config.max_model_len, self.target.host_lengths,
                         self.rewritten.prologue.host_copies(caller_args))
        self._count(step, 1)
        bucket = choose_bucket(self.rewritten.buckets, step.tokens, step.seqs)
        overlap = self.alias_groups and overlapping_inputs(self.signature, self.alias_groups, self.written, self.copied, args)
        if overlap:
            return self._fallback(caller_args, f"inputs {overlap} overlap in memory and the graph writes one of them",
                                  step)
        if bucket is None:
            return self._not_full(args, caller_args, step, direct, f"no graph for {step.tokens} tokens in "
                                  f"{step.seqs} sequences (buckets {list(self.rewritten.buckets)})")
        key = self.rewritten.key_for(bucket, step.decode)
        entry = self._entry(key, args, step, direct)
        if entry is None:
            return self._fallback(caller_args, f"{key} already has {self.config.max_specializations} captures "
                                               f"for other values of {[str(s) for s in self.signature.specialized]}",
                                  step)
        if entry.eager_reason:
            return self._not_full(args, caller_args, step, direct, entry.eager_reason)
        plan = entry.plan(step)
        refusal = entry.step_guard(plan.host, entry.staging.graph_args(args)) if entry.step_guard is not None else None
        if refusal:
            return self._not_full(args, caller_args, step, direct, refusal)
        self.served[(step_kind(step), "full")] += 1
        return self._transaction(entry.name, args, step, lambda: self._run_entry(entry, key, plan, args, caller_args))

    def _run_entry(self, entry: GraphEntry, key: GraphKey, plan: StepPlan, args: Sequence[Any],
                   caller_args: Sequence[Any]) -> Any:
        step = plan.step
        if not self.has_graphs:
            outputs = entry.run_eager(plan, self.workspaces_for(key))
            narrowed = narrowed_outputs(outputs, self.signature.outputs, step.symbols, self.rewritten.write_back.outputs)
            return returned_outputs(narrowed, False, entry.staging.copy_back(step))
        every = self.config.verify_every
        if self.verify and (entry.verified is None or (every and entry.replays % every == 0)):
            return self._verified_replay(entry, plan, args, caller_args)
        return self._replay(entry, plan)

    def _transaction(self, name: str, args: Sequence[Any], step: Step, run: Any) -> Any:
        """`run()`, what it may write in place saved before and put back if it raises, the error then
        noting which cache rows the step may have written (`undo.py`); the host's waits counted."""
        undo = self.undo.save(args, self.config.save_cache_rows)
        if undo.launches:  # nothing saved on the default path: its counts stay as they are
            self.stats["launches_outside_graph"] += undo.launches
            self.stats["saved_bytes"] += undo.nbytes
        waits = self.runtime.synchronizes
        try:
            return run()
        except BaseException as err:
            undo.restore()
            self.stats["failed_steps"] += 1
            written = self.undo.failure_note(undo, args, step)
            log.warning("ascend_compile: %s: the step raised %s; %s", name, type(err).__name__, written)
            getattr(err, "add_note", lambda _: None)(f"ascend_compile: {name}: {written}")  # Python 3.11+
            raise
        finally:
            if self.runtime.synchronizes != waits:
                self.stats["synchronizes"] += self.runtime.synchronizes - waits

    def _not_full(self, args: Sequence[Any], caller_args: Sequence[Any], step: Step, direct: bool, why: str) -> Any:
        """A step no full graph serves (`why`): on the piecewise graphs of the smallest piecewise size
        holding it (`piecewise_serve.py`), else eagerly."""
        variant = self.rewritten.piecewise
        if variant is None or not self.has_graphs:
            return self._fallback(caller_args, why if variant is not None else f"{why}; not piecewise: "
                                  f"{self.rewritten.piecewise_reason or 'the runtime has no graphs'}", step)
        graph, refusal = self.pieces.graph_for(args, step, direct)
        if graph is None:
            return self._fallback(caller_args, f"{why}; {refusal}", step)
        served, refusal = self.pieces.serve(graph, step, args)
        if refusal:
            return self._fallback(caller_args, f"{why}; {refusal}", step)
        self.not_full[why] += 1
        if why not in self._fallbacks_logged:
            log.info("ascend_compile: %s: serving it piecewise (%s)", why, graph.name)
            self._fallbacks_logged.add(why)
        self.served[(step_kind(step), "piecewise")] += 1
        self.stats["piecewise_steps"] += 1
        return self._transaction(graph.name, args, step, lambda: self.pieces.run(graph, served, step, args, caller_args))

    def _replay(self, entry: GraphEntry, plan: StepPlan) -> tuple:
        """Replay `entry` for the planned step; its outputs (write-back done)."""
        self.stats["updates"] += entry.replay(self.runtime, plan, self.target.updates, self.seconds)
        self.stats["replays"] += 1
        entry.replays += 1
        narrowed = entry.output_views(plan.step.symbols, self.rewritten.write_back.outputs)
        return returned_outputs(narrowed, self.config.clone_outputs, entry.staging.copy_back(plan.step))

    def _verified_replay(self, entry: GraphEntry, plan: StepPlan, args: Sequence[Any], caller_args: Sequence[Any]
                         ) -> Any:
        """`entry`'s first replay (and, with `verify_every`, every Nth), checked against the step run
        eagerly (`verify.py`): a graph that differs serves no step, this one included."""
        replay = entry.replays + 1
        outputs, entry.verified = self.verified_run(entry.name, args, caller_args, lambda: self._replay(entry, plan))
        entry.verified["replay"] = replay
        if not entry.verified["ok"]:
            entry.eager_reason = f"{entry.name}: its replay {replay} differed from eager ({entry.verified['mismatches'][0]})"
        self.write_plan()
        return outputs

    def verified_run(self, name: str, args: Sequence[Any], caller_args: Sequence[Any], run: Any) -> tuple[Any, dict]:
        """`run()` (a replay, or a piecewise step) checked against the step run eagerly through dynamo's
        graph (`verify.py`): the step's outputs and the check's record, counted."""
        regions = written_regions(self.signature, self.written, args)
        outputs, record = first_replay_check(name, regions, args, lambda: self.rewritten.original(*caller_args), run,
                                             self.names, self.runtime.generators_kept, self.layers)
        self.stats["verified_replays"] += 1
        self.stats["verify_failures"] += not record["ok"]
        return outputs, record

    def specialize(self, key: GraphKey) -> fx.GraphModule:
        """`key`'s graph: its variant, specialised by the target for the bucket (once per key)."""
        gm = self.specialized.get(key)
        if gm is None:
            variant = self.rewritten.variant_for(key)
            gm = self.specialized[key] = self.target.specialize(variant.gm, key, self.config)
            if gm is not variant.gm:
                dump.dump_graph(gm, self.rewritten.graph_dir, str(key), "3_specialized")
        return gm

    def _new_entry(self, key: GraphKey, symbols: dict) -> GraphEntry:
        gm = self.specialize(key)
        padded = self.signature.padded_symbols(key.bucket, self.rewritten.max_blocks, symbols)
        staging = Staging(self.signature, self.rewritten.write_back, self.runtime, gm, padded)
        entry = GraphEntry(key, specialization_of(self.signature, symbols), gm, staging)
        entry.step_guard = self.target.step_guard(gm, key, self.config)
        entry.eager_reason = self.target.eager_reason(gm, key)
        entry.packed = packed_capture(gm, key, self.target.mixed_graph_kernels)
        blocked = next((n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in self.uncapturable), None)
        if blocked is not None and entry.eager_reason is None:  # not tried again: its capture would fail as the first one did
            entry.eager_reason = f"{entry.name}: not captured, {self.uncapturable[blocked]}"
        return entry

    def _entry(self, key: GraphKey, args: Sequence[Any], step: Step, direct: bool) -> GraphEntry | None:
        """The graph serving `key` at the step's symbol values, captured if new; None when the key has
        used up its captures for other values of the specialized symbols."""
        symbols = step.symbols
        specialization = specialization_of(self.signature, symbols)
        entry = self.graphs.get((key, specialization))
        if entry is None:
            if sum(1 for k, _ in self.graphs if k == key) >= self.config.max_specializations:
                return None
            if specialization:
                log.info("ascend_compile: %s: new specialized sizes %s: capturing it", key, dict(specialization))
            entry = self.graphs[(key, specialization)] = self._new_entry(key, symbols)
        if not self.has_graphs:
            if not entry.staging.written_views and self.rewritten.write_back.located:
                entry.locate_writes(entry.staging.graph_args(args))
            return entry
        if entry.graph is not None and self.moved(entry, args, step, direct):
            entry = self.graphs[(key, specialization)] = self._new_entry(key, symbols)
        if entry.graph is not None or entry.eager_reason is not None:  # captured (or never to be): as kept
            return entry
        if self.config.capture_all and self.stats["captures"] == 0 and self.pads_tokens:
            self.capture_all(args, symbols)
        if entry.graph is None and entry.eager_reason is None:  # a mixed step's graph, or no capture_all
            self._capture(entry, args)
        self.write_plan()
        return self.graphs[(key, specialization)]

    def moved(self, graph: Any, args: Sequence[Any], step: Step, direct: bool) -> bool:
        """Whether in-place inputs of captured `graph` (a `GraphEntry` or a `PiecewiseGraph`) moved since
        its capture, so that it must be captured again (logged, counted); a direct call raises
        `MovedInputs` instead, having run nothing of the step."""
        moved = graph.captured_inputs.changed(args, self.fixed if direct else None)
        if moved and direct:
            self._count(step, -1)  # the step is not run here: dynamo calls the artifact again
            raise MovedInputs([self.names[i] for i in moved])
        if moved:
            self.changes.log(graph, moved, args, self.graphs.values())
            self.stats["recaptures"] += 1
        return bool(moved)

    def _capture(self, entry: GraphEntry, args: Sequence[Any]) -> None:
        target = self.target
        try:
            self.failures.begin(entry.name)  # `NotTried` once the device's streams ran out
            seq_len = capture_seq_len(entry.gm, entry.key, self.signature, entry.staging.buffers, self.config.max_model_len)
            entry.capture(self.runtime, args, self.workspaces_for(entry.key), seq_len, self.restore, target.updates,
                          target.workspaces, self.checked, self.identified)
        except UncapturableOp as err:
            self._serve_eagerly(entry, err)
            return
        except RuntimeError as err:  # the device's own error costs this graph (`capture_failures.py`)
            failure: RuntimeError | None = self.failures.device_failure(entry.name, entry.key.bucket,
                                                                        entry.specialization, err)
        else:
            failure = None
        why = self.failures.settle(entry.name, entry.gm, failure)
        if why:
            entry.graph, entry.eager_reason = None, why
            return
        self.stats["captures"] += 1
        log.info("ascend_compile: captured %s in %.3f s (%d update entries)", entry.name, entry.capture_seconds,
                 len(entry.table.entries))

    def _serve_eagerly(self, entry: GraphEntry, err: UncapturableOp) -> None:
        """`entry`'s capture failed at an op the device cannot capture: it serves its steps eagerly, and so
        does every graph of this artifact holding that op, none of them captured again (one WARNING per
        op; the step runs eagerly, as the graph would have computed it)."""
        why = self._note_uncapturable(err)
        entry.eager_reason = f"{entry.name}: not captured, {why}"
        self.stats["uncapturable_graphs"] += 1

    def _note_uncapturable(self, err: UncapturableOp) -> str:
        """Record the op `err` names as uncapturable (one WARNING per op): no graph holding it is
        captured again, and piecewise graphs run it eagerly."""
        why = f"{err.op} (node {err.node}) cannot be captured: {err.cause}"
        if err.op not in self.uncapturable:
            pieces = "; piecewise graphs run it eagerly" if self.rewritten.piecewise is not None else ""
            log.warning("ascend_compile: %s: graphs holding it run their steps eagerly%s", why, pieces)
        self.uncapturable[err.op] = why
        return why

    def capture_all(self, args: Sequence[Any], symbols: dict) -> None:
        """Capture every bucket's decode graph now, largest first so that smaller graphs fit in the
        pool memory larger ones left (with a progress bar when tqdm is installed), at the
        specialized sizes of `symbols`. Only for an artifact that pads steps to the buckets: where
        each step size is captured as is, a decode graph captured at a mixed step's sizes would put
        several query tokens of a sequence into PA (issue 36)."""
        keys = progress(sorted((k for k in self.rewritten.choices if k.decode), key=lambda k: -k.bucket),
                        "ascend_compile capture")
        specialization = specialization_of(self.signature, symbols)
        for key in keys:
            entry = self.graphs.get((key, specialization)) or self._new_entry(key, symbols)
            self.graphs[(key, specialization)] = entry
            if entry.graph is None and entry.eager_reason is None:
                self._capture(entry, args)

    def _fallback(self, args: Sequence[Any], why: str, step: Step | None = None) -> Any:
        if why not in self._fallbacks_logged:
            log.info("ascend_compile: %s: running eagerly", why)
            self._fallbacks_logged.add(why)
        self.stats["eager_fallbacks"] += 1
        if step is not None:
            self.served[(step_kind(step), "eager")] += 1
            self.not_full[why] += 1
        return self.rewritten.original(*args)

    def memory_report(self) -> dict[str, Any]:
        """Bytes held by this artifact: workspace slots, static buffers and outputs per graph, pool."""
        return report.memory_report(self)

    def describe(self) -> dict[str, Any]:
        """The plan.json content: the passes' plan, and what lowering decided and captured."""
        return report.describe(self)

    def write_plan(self) -> None:
        dump.dump_plan(self.rewritten.graph_dir, self.describe)

