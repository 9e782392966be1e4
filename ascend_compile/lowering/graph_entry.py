"""One captured graph of a compiled artifact (`runner.py`): its staging, device graph, static outputs
and update table, and the capture, replay and eager run of that one graph; the runner chooses which
graph serves a step and owns what graphs share (workspaces, the undo plan, the statistics)."""
from __future__ import annotations

import functools
import time
from typing import Any, Sequence

import torch
from torch import fx

from ..gc_pause import gc_paused
from ..passes.kernel_call import HostSource, StepGuard, host_sources
from ..passes.roles import GraphSignature, Role
from ..passes.workspaces import GraphKey
from ..runtime.base import GraphRuntime
from . import capture as capture_mod
from .inputs import Step, StepPlan, capture_plan, plan_step
from .input_checks import CapturedInputs
from .outputs import narrowed_outputs
from .phase_seconds import PhaseSeconds
from .staging import Staging, per_step_shape


def specialization_of(signature: GraphSignature, symbols: dict) -> tuple[tuple[str, int], ...]:
    """The values of the graph's specialized symbols in a step: part of the key of its capture."""
    return tuple((str(sym), symbols[sym]) for sym in signature.specialized) if signature.specialized else ()


class MovedInputs(Exception):
    """A direct call found in-place inputs of its graph (the names in `args`) at other addresses
    than at capture; nothing of the step has run."""


class GraphEntry:
    """One graph of a compiled artifact, for one graph key and one value of each specialized symbol:
    its staging and, once captured, its device graph, static outputs and update table."""

    def __init__(self, key: GraphKey, specialization: tuple, gm: fx.GraphModule, staging: Staging) -> None:
        self.key = key
        self.specialization = specialization
        self.gm = gm
        self.staging = staging
        self.sources: list[HostSource] = host_sources(gm)
        self.graph = None
        self.outputs = None
        self.table = capture_mod.UpdateTable()
        self.eager_reason: str | None = None  # why this graph cannot serve steps exactly, found at capture
        self.verified: dict[str, Any] | None = None  # the last replay check against eager (`verify.py`)
        self.replays = 0  # replays of this graph, for `verify_every`
        self.captured_inputs: CapturedInputs | None = None
        self.step_guard: StepGuard | None = None  # why a step may not run on this graph (`Target.step_guard`)
        self.packed = False  # captured with its padding packed, serving mixed steps (`passes/padding.py`)
        self._output_views: dict[tuple, list] = {}
        self.capture_seconds = 0.0

    @functools.cached_property
    def name(self) -> str:
        """The graph key, with the specialized sizes it was captured for (both fixed for the entry's life)."""
        return str(self.key) + "".join(f"[{s}={v}]" for s, v in self.specialization)

    def plan(self, step: Step) -> StepPlan:
        return plan_step(step, self.sources, self.staging.geometry)

    def capture(self, runtime: GraphRuntime, step_args: Sequence[Any], workspaces: capture_mod.WorkspaceFor,
                seq_len: int | None, restore: Sequence[int], updates: capture_mod.UpdateSchedule,
                lifetime: capture_mod.WorkspaceLifetime, checked: Sequence[int], identified: Sequence[int]) -> None:
        """Capture with an all-padding step in the buffers (nothing depends on capture-time values),
        its kernels given KV lengths `seq_len` (None: padding lengths). Inputs in `restore`, which
        the graph writes in place by plain ops, get their contents back after the capture's run;
        the in-place inputs in `checked` must keep their addresses for the graph to serve a step,
        those in `identified` must stay the same objects."""
        start = time.perf_counter()
        self.staging.fill_padding()
        plan = capture_plan(self.sources, self.staging.geometry, seq_len, self.packed)
        graph_args = self.staging.graph_args(step_args)
        refusal = self.step_guard(plan.host, graph_args) if self.step_guard is not None else None
        if refusal:  # the target refuses the very step it would be captured with: it serves no step
            self.eager_reason = f"{self.name}: not captured, its capture step is refused ({refusal})"
            return
        saved = {i: step_args[i].clone() for i in restore}
        try:
            with gc_paused():
                graph, outputs, table = capture_mod.capture_graph(
                    self.gm, runtime, graph_args + [plan.host[s] for s in self.sources], workspaces, updates, lifetime,
                    self.name)
        finally:  # a capture that raises half-way (an op that cannot be captured) leaves them as they were too
            for i, contents in saved.items():
                step_args[i].copy_(contents)
        self.graph, self.outputs, self.table = graph, outputs, table
        # Only one graph replays at a time and its outputs are read (cloned) right after: they need
        # not pin their memory, which later captures of other buckets may then reuse from the pool.
        self.outputs = [runtime.weak_alias(o) if isinstance(o, torch.Tensor) else o for o in self.outputs]
        self._output_views = {}
        self.locate_writes(graph_args)
        scalars = [spec.index for spec in self.staging.signature.by_role(Role.SCALAR)]
        self.captured_inputs = CapturedInputs(step_args, checked, scalars, identified)
        self.capture_seconds = time.perf_counter() - start

    def output_views(self, symbols: dict, skip: Sequence[int]) -> list:
        """The captured outputs narrowed to a step's sizes (views of the static outputs, made once
        per step shape)."""
        return per_step_shape(self._output_views, tuple(symbols.values()),
                              lambda: narrowed_outputs(self.outputs, self.staging.signature.outputs, symbols, skip))

    def locate_writes(self, graph_args: Sequence[Any]) -> None:
        clashes = self.staging.locate_writes(graph_args)
        if clashes:
            self.eager_reason = f"{self.name}: inputs {clashes} are written twice at overlapping places in the padded graph"

    def replay(self, runtime: GraphRuntime, plan: StepPlan, updates: capture_mod.UpdateSchedule,
               seconds: PhaseSeconds) -> int:
        """Copy in, launch, update, synchronize; returns the number of task updates issued. A replay
        that raises may leave the graph's events and tasks mid-replay: the graph is dropped, and
        captured again on its next use."""
        t0 = time.perf_counter()
        self.staging.copy_in(plan.step)  # the step's shapes are checked here, before the graph runs
        t1 = time.perf_counter()
        try:
            self.graph.replay()
            count = updates.apply(self.table, runtime, plan.host) if self.table.entries else 0
            t2 = time.perf_counter()
            runtime.after_replay()
        except BaseException:
            self.graph, self.verified = None, None
            runtime.replay_failed()
            raise
        seconds.replayed(t0, t1, t2, time.perf_counter())
        return count

    def run_eager(self, plan: StepPlan, workspaces: capture_mod.WorkspaceFor) -> Any:
        """Run the graph op by op (a runtime without graphs), workspaces from the artifact."""
        self.staging.copy_in(plan.step)
        env = capture_mod.workspace_env(self.gm, workspaces)
        args = self.staging.graph_args(plan.step.args) + [plan.host[s] for s in self.sources]
        return fx.Interpreter(self.gm).run(*args, initial_env=env)

    def memory(self) -> dict[str, int]:
        outs = sum(o.numel() * o.element_size() for o in (self.outputs or ()) if isinstance(o, torch.Tensor))
        return {"static_inputs_bytes": self.staging.nbytes(), "outputs_bytes": outs}
