"""The `ascend_graph` dynamo backend: passes, then lowering onto a runtime, then the runner.

`torch.compile(model, backend="ascend_graph", options={...})` reaches `ascend_graph`; a runtime that
registers the backend itself calls `backend(CompileConfig(...))`.
"""
from __future__ import annotations

import collections
import logging
from contextlib import nullcontext
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from . import ledger, plan_cache
from .compile_once import retrace_general
from .config import CompileConfig
from .dispatch import graph_inputs
from .gc_pause import gc_paused
from .lowering import budget, workspace_group
from .lowering.runner import CompiledArtifact
from .passes.find_attention import attention_args, attention_nodes, has_attention
from .passes.fx_utils import example_value
from .passes.pipeline import rewrite_buckets
from .passes.providers import Binder
from .targets import TargetFactory, default_target

log = logging.getLogger("ascend_compile")
ledger.DynamoClock.install()  # dynamo's trace timed from its start (`ledger.py`)


def _device_of(gm: fx.GraphModule) -> torch.device:
    """The device of the graph's tensors: the first attention query's, else the first tensor input's."""
    attention = attention_nodes(gm)
    if attention:
        return example_value(attention_args(attention[0]).query).device
    for node in gm.graph.find_nodes(op="placeholder"):
        value = example_value(node)
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _needing_grad(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """The graph's inputs that require grad, in a few words, where grad mode is on ("" otherwise): a
    captured graph's outputs carry no autograd history, so such a graph must run as traced."""
    if not torch.is_grad_enabled():
        return ""
    names = [node.name for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
             if isinstance(value, torch.Tensor) and value.requires_grad]
    return f"{len(names)} inputs ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" if names else ""


def _plan_key(gm: fx.GraphModule, config: CompileConfig, runtime: Any) -> dict[str, Any]:
    """The key of the graph's persisted plan (`plan_cache.key`): its code and inputs' shapes, the options
    but where files go and what names the model, the runtime, versions, device and rank."""
    inputs = [(n.name, str(getattr(example_value(n), "shape", None)), str(getattr(example_value(n), "dtype", None)))
              for n in gm.graph.find_nodes(op="placeholder")]
    named = ("dump_dir", "plan_dir", "model_name", "workspace_group")
    options = {k: v for k, v in vars(config).items() if k not in named}
    return plan_cache.key(gm.code + repr(inputs), options, runtime.describe(), runtime.device)


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], config: CompileConfig,
                  target: TargetFactory = default_target, bind: Binder | None = None) -> Callable[..., Any]:
    """Compile one dynamo graph: its rewritten variants behind a runner on the device's target
    (`bind`: an integration's binder of inputs provided outside the graph, `passes/providers.py`)."""
    needing_grad = _needing_grad(gm, example_inputs)
    if needing_grad:
        log.warning("ascend_compile: grad mode is on and %s require grad: this graph runs eagerly, with autograd "
                    "(serve under torch.no_grad() or torch.inference_mode() for captured graphs)", needing_grad)
        return gm.forward
    if bind is None and not has_attention(gm):
        log.info("ascend_compile: graph has no attention: running it as traced")
        return gm.forward
    if config.retrace_static:
        retrace_general(gm)  # may raise dynamo's restart: the frame is traced again, general
    phases = collections.Counter({"dynamo_trace": ledger.DynamoClock.trace_seconds() or 0.0})
    device_target = target(_device_of(gm), config)
    device_target.check(config)
    group = None
    if config.workspace_group is not None:  # its members share one runtime and slot (`workspace_group.py`)
        device_target, group = workspace_group.group_for(config.workspace_group, device_target)
    plan = (plan_cache.PlanCache(config.plan_dir, _plan_key(gm, config, device_target.runtime))
            if config.plan_dir else None)
    persisted = plan_cache.using(plan) if plan else nullcontext()  # a warm start asks nothing asked before
    with gc_paused(), ledger.recording(phases), ledger.phase("passes"), persisted:
        rewritten = rewrite_buckets(gm, config, device_target, bind)
        if rewritten is None:
            log.info("ascend_compile: graph has no attention: running it as traced")
            return gm.forward
        graph_budget = budget.fit(rewritten, device_target.runtime, config, group.planned_graphs() if group else 0)
        artifact = CompiledArtifact(rewritten, device_target, config)
        artifact.graph_inputs = graph_inputs.record(gm)  # dynamo drops its records once the compile is over
        if group is not None:
            group.join(artifact)
    artifact.startup.compiled(phases, graph_budget, plan)
    ledger.DynamoClock.install()  # again, for the next frame, after a `torch._dynamo.reset()`
    artifact.write_plan()
    return artifact


def ascend_graph(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None, **kwargs: Any
) -> Callable[..., Any]:
    """The dynamo backend registered as "ascend_graph" (options from `torch.compile(options=...)`)."""
    if kwargs:
        raise ValueError(f"torch.compile: ascend_graph takes only options=..., got {sorted(kwargs)}")
    return compile_graph(gm, example_inputs, CompileConfig.from_options(options))


def backend(
    config: CompileConfig | None = None,
    on_compiled: Callable[[CompiledArtifact], None] | None = None,
    target: TargetFactory = default_target,
    **options: Any,
) -> Callable[..., Any]:
    """A dynamo backend for `config` (or for `options`), for runtimes that register it themselves.

    `on_compiled` receives each compiled artifact (for its `memory_report()`, `stats`, `describe()`);
    `target` builds the device target (see `targets.py`; by default the one `config.runtime` means).
    """
    if config is None:
        config = CompileConfig.from_options(options)
    elif options:
        raise ValueError("backend: pass either a CompileConfig or options, not both")
    ledger.DynamoClock.install()  # before dynamo's first frame for this backend

    def compile_fn(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        compiled = compile_graph(gm, example_inputs, config, target)
        if on_compiled is not None and isinstance(compiled, CompiledArtifact):
            on_compiled(compiled)
        return compiled

    return compile_fn
