"""What the backend returns for a vLLM graph: when it runs compiled, and when as traced.

vLLM compiles during its profiling run, before the KV caches exist and with no attention metadata;
the graph runs as traced (vLLM's own ops and kernels) until a step's forward context has metadata
and every one of the graph's layers has its cache, then compiles once against it. After that, a
step with a sequence longer than the `max_model_len` the workspaces were sized for runs as traced
too (correct, uncompiled), instead of failing inside vLLM's `execute_model` and with it the engine,
and so does a step whose metadata asks for other than causal attention (vLLM 0.33's per-request
`causal`, PrefixLM ranges, R-SWA: `context.step_semantics`), which the graph would compute wrongly.
Each reason a step runs as traced is logged once: a model that stays uncompiled says why. Each
graph is tracked until it compiles, so that its memory can be estimated and reserved before vLLM
sizes its KV cache (`memory.py`, `kv_budget.py`); after each new capture the measured graph memory
is logged beside the reserved figure.

What it asks of the binder is the `StepBinder` protocol below, which `binder.ForwardContextBinder`
satisfies: this module does not import the binder (the backend, `dynamo_backend.py`, imports both).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Protocol, Sequence

from torch import fx

from ...backend import compile_graph
from ...config import CompileConfig
from ...lowering import served
from ...lowering.runner import CompiledArtifact
from ...passes.providers import Provider
from ...targets import TargetFactory
from . import fast_path
from . import memory

log = logging.getLogger("ascend_compile")

#: Reasons expected on every vLLM start-up (logged at DEBUG; any other at WARNING).
EXPECTED = ("no forward context", "no attention metadata (vLLM's profiling run)")


class StepBinder(Protocol):
    """What `DeferredCompile` asks of its binder (`binder.ForwardContextBinder`): the graph's layers,
    whether a step can be compiled against, and the step checks after; called, the rewrite itself
    (a `passes/providers.py` Binder, `compile_graph(..., bind=binder)`)."""

    def layer_names(self, gm: fx.GraphModule) -> list[str]: ...

    def not_ready(self, layers: Sequence[str]) -> str | None: ...

    def unserved_step(self) -> str | None: ...

    def longest_sequence(self) -> int | None: ...

    def __call__(self, gm: fx.GraphModule) -> Provider | None: ...


class DeferredCompile:
    """A vLLM graph: as traced until a step can be compiled against, then the compiled artifact.

    It is what dynamo calls, so it is also what the direct dispatcher calls (`fast_path.py`): it
    reports itself to the dispatcher's probe (`lowering/served.py`) in the artifact's place, and
    `call_direct` makes the same per-step checks as a call through dynamo. `graph_inputs` (what
    dynamo passes the graph, and from where) is recorded by the backend while dynamo compiles."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: CompileConfig,
                 binder: StepBinder, target: TargetFactory,
                 on_compiled: Callable[[CompiledArtifact], None] | None, recorded_inputs: Any = None,
                 direct: bool = False) -> None:
        self.gm, self.example_inputs, self.config = gm, list(example_inputs), config
        self.binder, self.target, self.on_compiled = binder, target, on_compiled
        self.recorded_inputs = recorded_inputs
        self.direct = direct  # put the direct dispatcher in front of the model at the first compiled step
        self.layers = binder.layer_names(gm)
        self.compiled: Callable[..., Any] | None = None
        self.logged: set[str] = set()
        self.captures = 0  # the artifact's captures last reported (`memory.py`)
        self.reserved: int | None = None  # bytes taken out of vLLM's KV-cache budget for it (`kv_budget.py`)
        memory.track(self)

    @property
    def graph_inputs(self) -> Any:
        """What dynamo passes this graph (None until the graph is compiled: the direct dispatcher arms
        no route for a graph that still runs as traced, and none where the graph compiled to no artifact)."""
        return self.recorded_inputs if isinstance(self.compiled, CompiledArtifact) else None

    def __call__(self, *args: Any) -> Any:
        with served.unreported():  # this, not the artifact, is what dynamo called
            result = self._step(args, direct=False)
        served.report(self, args, result)
        return result

    def call_direct(self, args: Sequence[Any], fixed: frozenset[int] | None = None) -> Any:
        """One step from the direct dispatcher: the same checks as `__call__`, then the artifact's
        `call_direct` (moved in-place inputs raise `MovedInputs`: the step goes through dynamo)."""
        return self._step(args, direct=True, fixed=fixed)

    def _step(self, args: Sequence[Any], direct: bool, fixed: frozenset[int] | None = None) -> Any:
        if self.compiled is None:
            reason = self.binder.not_ready(self.layers)
            if reason is not None:
                return self.as_traced(args, reason)
            self.compiled = compile_graph(self.gm, self.example_inputs, self.config, self.target, bind=self.binder)
            if self.on_compiled is not None and isinstance(self.compiled, CompiledArtifact):
                self.on_compiled(self.compiled)
            if self.direct and self.graph_inputs is not None:
                fast_path.install(self)
        unserved = self.binder.unserved_step()
        if unserved is not None:
            return self.as_traced(args, unserved)
        longest = self.binder.longest_sequence()
        if longest is not None and longest > self.config.max_model_len:
            return self.as_traced(args, f"a sequence is longer than max_model_len="
                                        f"{self.config.max_model_len}, the longest the graphs' workspaces were "
                                        f"sized for (set max_model_len in ASCEND_COMPILE_OPTIONS or vLLM's config)")
        result = self.compiled.call_direct(args, fixed) if direct else self.compiled(*args)
        if isinstance(self.compiled, CompiledArtifact):
            captures = self.compiled.stats["captures"] + self.compiled.stats["piecewise_captures"]
            if captures != self.captures:  # a full graph or a piecewise size captured: what graphs take now
                self.captures = captures
                memory.log_graph_memory(self.compiled, self.reserved)
        return result

    def as_traced(self, args: Sequence[Any], reason: str) -> Any:
        """Run the graph as dynamo traced it (vLLM's ops), logging `reason` the first time."""
        if reason not in self.logged:
            self.logged.add(reason)
            level = logging.DEBUG if reason in EXPECTED else logging.WARNING
            log.log(level, "ascend_compile: vLLM graph (%d attention layers) runs uncompiled: %s (logged once)",
                    len(self.layers), reason)
        return self.gm(*args)
