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

import torch
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
        # Here, inside dynamo's backend call, not at the deferred compile (outside dynamo). The model's
        # own tensors keep their sizes (`model_state_static`): only the step's inputs carry its sizes.
        model_state_static(gm, example_inputs)
        retrace_general(gm, SHARED_TOKEN_SETTINGS)
        recorded = graph_inputs.record(gm)
        if dispatch == "direct":
            recorded.shape_guards  # noqa: B018 - produced now, under the settings dynamo traced with
        return DeferredCompile(gm, example_inputs, deferred, binder, target, on_compiled, recorded,
                               direct=dispatch == "direct")

    return compile_fn


def model_state_static(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Mark static (as `torch._dynamo.mark_static` does) every tensor the model holds that the graph reads: the
    placeholders dynamo made static inputs (parameters, buffers, and tensors held as attributes of modules,
    as vLLM's LoRA layers hold their stacked adapter weights `[max_loras, 1, rank, in]` and their punica
    wrapper its index buffers and `[1]` flags), by their real tensors, and the tensors they are views of
    (`lora_a_stacked_2d` of the embedding's stacks, its `_base` guarded by dynamo too).

    The general retrace (`SHARED_TOKEN_SETTINGS`) makes every size of every non-parameter tensor symbolic
    and keeps duck shaping, so that vLLM's `input_ids [T]` and `positions [T]` share the token count's
    symbol; without this, a held tensor's dim equal to the traced token count got that symbol too (traced at
    one token: the stacks' size-1 dim, the `[1]` flags; at 2 tokens, `max_loras`), the roles took it for
    batch data and padded it to the bucket: the capture failed at every lone decode
    (`tests/test_vllm_lora.py`). Dynamo keeps such marks over `assume_static_by_default=False`; the caller's
    own tensors (the frame's arguments: what vLLM's `support_torch_compile` marks dynamic) stay symbolic.

    The marks are set as `mark_static` sets them outside a trace (`_dynamo_static_indices`, and
    `_has_dynamo_dim_marking` that torch 2.14 adds): inside dynamo's backend call torch 2.14's `mark_static`
    takes itself for a call in traced code (`is_compiling()`) and marks nothing."""
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if "_dynamo_static_input_type" not in node.meta.get("tensor_dict", {}):
            continue
        while isinstance(value, torch.Tensor):  # and the tensor a view is of, which dynamo wraps too
            indices = getattr(value, "_dynamo_static_indices", None)
            value._dynamo_static_indices = (indices or set()) | set(range(value.dim()))
            value._has_dynamo_dim_marking = True
            value = value._base


def configured_backend(vllm_config: Any, model_tag: str | None = None) -> Callable[..., Any]:
    """`backend(...)` with the options for `vllm_config` (`options.options_for`: vLLM's
    `max_model_len` and capture sizes, `ASCEND_COMPILE_OPTIONS` over them; `model_tag` for a model
    beside the target, `drafter.py`), with our graphs' memory reserved in the KV-cache budget of the
    worker class vLLM runs (`kv_budget.py`)."""
    compile_fn = backend(**options_for(vllm_config, model_tag))
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
