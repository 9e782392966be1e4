"""The dynamo backends users register for vLLM: `backend(...)`, `configured_backend(vllm_config)`
and `vllm_backend`, the qualified name vLLM's `compilation_config.backend` takes.

A graph calling vLLM's attention ops gets a `ForwardContextBinder` (`binder.py`) and, as what dynamo
calls, a `DeferredCompile` (`deferred.py`): vLLM hands the graph over during its profiling run,
before there is metadata or a KV cache to compile against. Layers whose features the rewrite cannot
compute are refused here, when dynamo hands the graph over, where the forward context already knows
them (`layers.py`, `mla.py`). Graphs without those ops compile as with `ascend_compile.backend`.

Plug it in (see `docs/vllm.md`): vLLM's stock-torch.compile mode takes it by qualified name,
`compilation_config={"mode": 1, "backend": "ascend_compile.integrations.vllm.vllm_backend",
"cudagraph_mode": "NONE"}`; vLLM-Ascend through the plug-in (`ascend_plugin.py`), which calls
`configured_backend`. The options come from vLLM's config, `ASCEND_COMPILE_OPTIONS` over them
(`options.py`); with vLLM's own forward context the installed vLLM must be a supported release
(`releases.py`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from torch import fx

from ...backend import compile_graph
from ...compile_once import DISPATCHES, SHARED_TOKEN_SETTINGS, retrace_general
from ...config import CompileConfig
from ...dispatch import graph_inputs
from ...lowering.runner import CompiledArtifact
from ...targets import TargetFactory, default_target
from . import kv_budget
from .binder import ForwardContextBinder, vllm_graph_nodes
from .deferred import DeferredCompile
from .mla import mla_graph_nodes
from .options import current_vllm_config, options_for
from .releases import check_version


def backend(config: CompileConfig | None = None, on_compiled: Callable[[CompiledArtifact], None] | None = None,
            get_forward_context: Callable[[], Any] | None = None, target: TargetFactory = default_target,
            dispatch: str = "direct", **options: Any) -> Callable[..., Any]:
    """A dynamo backend for vLLM model graphs (see the module docstring); graphs without vLLM's
    attention ops compile as with `ascend_compile.backend`. With vLLM's own forward context
    (`get_forward_context` None) the installed vLLM must be a supported release. `dispatch`:
    "direct" (default) puts the direct dispatcher in front of a `Module.compile`d model at its first
    compiled step (`fast_path.py`); "dynamo" leaves every step to dynamo's guards."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch: expected one of {list(DISPATCHES)}, got {dispatch!r}")
    if config is None:
        config = CompileConfig.from_options(options)
    elif options:
        raise ValueError("backend: pass either a CompileConfig or options, not both")
    if get_forward_context is None:  # vLLM's own forward context: check the release it comes from
        check_version()
    deferred = dataclasses.replace(config, retrace_static=False)  # retraced at dynamo's call, if at all

    def compile_fn(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if not vllm_graph_nodes(gm)[0] and not mla_graph_nodes(gm)[0]:
            compiled = compile_graph(gm, example_inputs, config, target)
            if on_compiled is not None and isinstance(compiled, CompiledArtifact):
                on_compiled(compiled)
            return compiled
        binder = ForwardContextBinder(get_forward_context, example_inputs)
        ctx = binder.current_context()
        if ctx is not None:  # vLLM's profile run: the layers are known, refuse what we cannot serve now
            binder.refuse_unsupported(gm, ctx)
        # vLLM's model.compile passes no dynamic=: have dynamo trace this first call again with every
        # step size symbolic (batch 1 included), so that one graph and one artifact serve every step.
        # Here, inside dynamo's backend call, not at the deferred compile (outside dynamo).
        retrace_general(gm, SHARED_TOKEN_SETTINGS)
        recorded = graph_inputs.record(gm)
        if dispatch == "direct":
            recorded.shape_guards  # noqa: B018 - produced now, under the settings dynamo traced with
        return DeferredCompile(gm, example_inputs, deferred, binder, target, on_compiled, recorded,
                               direct=dispatch == "direct")

    return compile_fn


def configured_backend(vllm_config: Any) -> Callable[..., Any]:
    """`backend(...)` with the options for `vllm_config` (`options.options_for`: vLLM's
    `max_model_len` and capture sizes, `ASCEND_COMPILE_OPTIONS` over them), with our graphs'
    memory reserved in the KV-cache budget of the worker class vLLM runs (`kv_budget.py`)."""
    compile_fn = backend(**options_for(vllm_config))
    kv_budget.install(vllm_config)
    return compile_fn


def __getattr__(name: str) -> Any:
    """`vllm_backend`: the backend for vLLM's `compilation_config.backend` (a qualified name, so no
    arguments). vLLM's runner resolves that name (`init_backend`, `getattr` on this module) while
    loading the model, under `set_current_vllm_config`, and calls the result later, when vLLM's
    config is no longer current: this module attribute is made at that lookup, from the config
    current then (`configured_backend`)."""
    if name == "vllm_backend":
        return configured_backend(current_vllm_config())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
