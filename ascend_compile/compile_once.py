"""One backend compile per model for every step shape.

Left to itself, dynamo hands the backend one graph per kind of step shape: the first call's static
shapes, then (automatic dynamic) a dynamic graph, plus separate graphs for batch 1 and one-sequence
mixed steps (a size of 0 or 1 is specialised, not given a symbol) and, when decode traced tokens and
sequences with one symbol (duck shaping: equal sizes share a symbol), one more for mixed steps.
`torch.compile(dynamic=True)` alone changes none of that but the first static graph.

Three tracing settings make the first trace general, whatever its shape
(`tools/compile_count_experiments.py` tries the others):

- every size of the caller's tensors symbolic: `torch._dynamo.config.assume_static_by_default =
  False`, which is what `torch.compile(dynamic=True)` sets (parameters and buffers stay static),
  with `specialize_float = True` so that float attributes of modules stay constants;
- `torch.fx.experimental._config.backed_size_oblivious = True`: sizes 0 and 1 get symbols too,
  and the shape checks of the model, of dynamo and of the backend's own passes reason about them
  as "any size" instead of guarding on the value seen;
- `torch.fx.experimental._config.use_duck_shape = False`: sizes that happen to be equal at trace
  time (tokens == sequences in a decode step) get distinct symbols.

They must be in force while dynamo traces and while the backend compiles (the backend's passes
re-run shape functions, which guard like the model's code does). Two ways to have that:

- `compile(model, options)`: the helper. `torch.compile(model, backend="ascend_graph", options=...)`
  with the settings in force whenever dynamo compiles for it (dynamo's compile start and end
  callbacks); the first trace is general, so there is one backend compile and one dynamo trace.
  `trace_settings()` is the same as a context manager, for callers of `torch.compile` itself.
  `step_dims` names the step dims instead of making every size symbolic: needed where a tensor has
  a size-1 dim that is not a step dim (`[1, T]` token ids), which would otherwise get a symbol too.
- `retrace_general(gm)`: what the backend can do alone (no caller cooperation). Called by the
  backend on a graph whose caller inputs have static sizes, it switches the settings on for the
  rest of this frame's compilation and asks dynamo to trace the frame again (dynamo's own restart
  exception); the settings are put back when the compilation ends. One backend compile, but two
  dynamo traces of the first call, and it relies on dynamo internals (see its docstring).

`backed_size_oblivious` removes the guards on 0 and 1 of the shape checks written for it, not of
every op: a model whose code still guards on a size being 1 (`q[:, :1].contiguous()` guards `T != 1`)
gets a second graph for that size; `TORCH_LOGS=recompiles` names the line.

Without duck shaping, two inputs that carry the same step size (ids `[T]`, positions `[T, 1]`) keep
distinct symbols unless the model's code equates them (a reshape, a matmul); a broadcast only adds
`Or(s == 1, s == t)`, and the backend then pads one and specialises the other: the capture fails with
a `CaptureError` that names the sizes kept and points to `step_dims`
(tests/test_runtime_graphs.py::test_token_dims_the_general_trace_keeps_apart_are_a_clear_capture_error).
Not the case for examples/llama.py.

Guards are kept by default: with every step size symbolic no guard fails on a step shape, but
dropping them (vLLM's `guard_filter_fn`) is wrong where a size is still specialised (e.g. a first
call at batch 1 without `backed_size_oblivious`), and their evaluation is only part of dynamo's
cost per call (fetching every lifted parameter again is the rest). `dispatch="direct"` skips
dynamo altogether after the first call, with checks of its own that include dynamo's shape guards
(`ascend_compile.dispatch`).

Two things torch's guards miss by default are handled here for every `CompiledStep`: dynamo's guards
on the modules' hook dicts are turned on while it compiles (`GUARD_SETTINGS`: a forward hook
registered on a submodule after the compile then recompiles the frame with the hook traced in), and
while global module hooks are registered (`register_module_forward_hook`, which no guard sees) the
model is called eagerly.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from typing import Any, Callable, Iterator, Mapping

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config
from torch import fx
from torch.nn.modules import module as nn_module

from .dispatch import DirectDispatcher

log = logging.getLogger("ascend_compile")

#: The settings under which named step dims (`step_dims`) are traced general: (config module, name, value).
SIZE_SETTINGS: tuple[tuple[Any, str, Any], ...] = (
    (fx_config, "backed_size_oblivious", True),
    (fx_config, "use_duck_shape", False),
)
#: The settings of a general trace: every size of the caller's tensors symbolic, too.
TRACE_SETTINGS: tuple[tuple[Any, str, Any], ...] = (
    (torch._dynamo.config, "assume_static_by_default", False),
    # floats stay constants: under assume_static_by_default=False a float attribute of a module (an
    # RMSNorm's eps) would become a graph input, one more scalar for the runner to copy every step
    (torch._dynamo.config, "specialize_float", True),
    *SIZE_SETTINGS,
)
#: A general trace where equal sizes share a symbol (duck shaping kept): for callers whose every
#: step-sized input carries the one token count, as vLLM's `input_ids [T]` and `positions [T]` do
#: (its lengths and tables come from the forward context, not the caller). Without duck shaping the
#: two get distinct symbols that vLLM's model never equates (rotary embedding's
#: `query.view(positions.shape[0], -1, head_size)` only divides), and the one the runner does not pad
#: is held at the traced value. Automatic dynamic is off meanwhile: dynamo gives a size it saw change
#: in an earlier compile of the frame (a batch-3 trace under `dynamic=True`, then batch 1) a symbol of
#: its own (`DimDynamic.DYNAMIC`), never a duck-shaped one, so a recompile's retrace would split them
#: again (issue 36); every size is symbolic under these settings anyway.
SHARED_TOKEN_SETTINGS: tuple[tuple[Any, str, Any], ...] = (
    *(setting for setting in TRACE_SETTINGS if setting[1] != "use_duck_shape"),
    (torch._dynamo.config, "automatic_dynamic_shapes", False),
)


#: Dynamo settings in force whenever it compiles for a `CompiledStep`, whatever the trace settings:
#: guards on the hook dicts of the modules the frame calls (torch skips them by default, so a hook
#: registered on a submodule after the compile would be missing from every later call).
GUARD_SETTINGS: tuple[tuple[Any, str, Any], ...] = ((torch._dynamo.config, "skip_nnmodule_hook_guards", False),)


def _apply_settings(settings: tuple[tuple[Any, str, Any], ...] = TRACE_SETTINGS) -> list[tuple[Any, str, Any]]:
    saved = [(module, name, getattr(module, name)) for module, name, _ in settings]
    for module, name, value in settings:
        setattr(module, name, value)
    return saved


def _restore_settings(saved: list[tuple[Any, str, Any]]) -> None:
    for module, name, value in reversed(saved):
        setattr(module, name, value)


@contextlib.contextmanager
def trace_settings() -> Iterator[None]:
    """The general-trace settings in force inside the block (process-wide, like any dynamo config
    patch: another thread compiling at the same moment sees them too)."""
    saved = _apply_settings()
    try:
        yield
    finally:
        _restore_settings(saved)


_local = threading.local()  # settings: those of the CompiledStep being called; saved: those they replaced


def _on_compile_start(*_: Any) -> None:
    """Dynamo starts compiling a frame: inside a `CompiledStep` call, put the guard settings and its
    trace settings in force (the latter unless the caller asked for static shapes:
    `torch.compile(dynamic=False)`)."""
    settings = getattr(_local, "settings", None)
    if settings and getattr(_local, "saved", None) is None:
        config = torch._dynamo.config
        general = config.automatic_dynamic_shapes or not config.assume_static_by_default
        _local.saved = _apply_settings(GUARD_SETTINGS + (settings if general else ()))
        _local.compiled = general


def _on_compile_end(*_: Any) -> None:
    saved = getattr(_local, "saved", None)
    if saved is not None:
        _local.saved = None
        _restore_settings(saved)


def _compile_callbacks() -> Any:
    """dynamo's compile start/end callback handler (torch 2.9 .. 2.13), or None."""
    handler = getattr(getattr(torch._dynamo, "callback", None), "callback_handler", None)
    if isinstance(getattr(handler, "start_callbacks", None), list) and isinstance(
        getattr(handler, "end_callbacks", None), list
    ):
        return handler
    return None


#: Step dims by argument name, or a function marking a call's step dims itself (nested inputs).
StepDims = "Mapping[str, int | tuple[int, ...]] | Callable[[tuple, dict], None]"
DISPATCHES = ("dynamo", "direct")


class CompiledStep:
    """A model compiled so that one backend compile serves every step shape (see `compile`).

    The settings are in force only while dynamo compiles (dynamo's compile start and end
    callbacks), so a call that compiles nothing costs a thread-local write; where torch has no such
    callbacks, they are put in force around every call (about 10-20 us).

    With `dispatch="direct"`, calls after the first go to the compiled graph without dynamo
    (`ascend_compile.dispatch`)."""

    def __init__(self, compiled: Callable[..., Any], model: Any, step_dims: StepDims | None = None,
                 dispatch: str = "dynamo") -> None:
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch: expected one of {list(DISPATCHES)}, got {dispatch!r}")
        self.compiled = compiled  # what torch.compile returned
        self.model = model
        self._mark_dims = step_dims if callable(step_dims) else self._mark_named
        self.step_dims = {} if callable(step_dims) else {k: (v,) if isinstance(v, int) else tuple(v)
                                                          for k, v in (step_dims or {}).items()}
        self.settings = SIZE_SETTINGS if step_dims is not None else TRACE_SETTINGS
        forward = model.forward if isinstance(model, torch.nn.Module) else model
        self._signature = inspect.signature(forward) if step_dims is not None else None
        self._marking = step_dims is not None  # until the first compile: marks are read when dynamo traces
        self.dispatcher = DirectDispatcher(model) if dispatch == "direct" else None
        self._warned_global_hooks = False

    def recheck(self) -> None:
        """Under `dispatch="direct"`: send the next call of every argument layout through dynamo's
        guards, which see what the direct checks do not (a Python attribute the model reads, a
        global, a monkeypatched function), and arm the direct route again from it."""
        if self.dispatcher is not None:
            self.dispatcher.recheck()

    def mark(self, args: tuple, kwargs: dict) -> None:
        """Mark the step dims of this call's tensors dynamic (`maybe_mark_dynamic`)."""
        self._mark_dims(args, kwargs)

    def _mark_named(self, args: tuple, kwargs: dict) -> None:
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        for name, dims in self.step_dims.items():
            value = bound.get(name)
            if isinstance(value, torch.Tensor):
                for dim in dims:
                    torch._dynamo.maybe_mark_dynamic(value, dim % value.dim())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.dispatcher is not None:
            return self.dispatcher(args, kwargs, self._through_dynamo)
        return self._through_dynamo(args, kwargs)

    def _through_dynamo(self, args: tuple, kwargs: dict) -> Any:
        if nn_module._has_any_global_hook():
            return self._eager(args, kwargs)
        if self._marking:
            self.mark(args, kwargs)
        handler = _compile_callbacks()
        if handler is None:
            saved = _apply_settings(GUARD_SETTINGS + self.settings)
            try:
                return self.compiled(*args, **kwargs)
            finally:
                _restore_settings(saved)
        if _on_compile_start not in handler.start_callbacks:  # torch._dynamo.reset() clears them
            handler.register_start_callback(_on_compile_start)
            handler.register_end_callback(_on_compile_end)
        outer, _local.settings, _local.compiled = getattr(_local, "settings", None), self.settings, False
        try:
            result = self.compiled(*args, **kwargs)
            if _local.compiled:
                self._marking = False
            return result
        finally:
            _local.settings = outer

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        """The model called eagerly: global module hooks (`register_module_forward_hook`) are
        registered, which dynamo's guards do not see (a graph would run with or without them as
        when it was traced) and `torch.compile(module)` would fire an extra time around the model."""
        if not self._warned_global_hooks:
            self._warned_global_hooks = True
            log.warning("ascend_compile: global module hooks are registered: calls run eagerly while they are")
        return self.model(*args, **kwargs)


def compile(  # noqa: A001 - mirrors torch.compile
    model: Any,
    options: Mapping[str, Any] | None = None,
    *,
    backend: str | Callable[..., Any] = "ascend_graph",
    step_dims: StepDims | None = None,
    dispatch: str = "dynamo",
    **torch_compile_kwargs: Any,
) -> CompiledStep:
    """`torch.compile(model, backend="ascend_graph", options=options)` whose first trace is general:
    one backend compile serves every batch size (1 included), token count, decode or mixed step,
    whatever the first call's shape.

    `step_dims`: None (default) makes every size of the caller's tensors symbolic; sizes that are
    not step sizes (a fixed buffer's width) get one capture per value, as under `dynamic=True`. A
    mapping from argument names to dims (e.g. `{"input_ids": 1, "positions": 1, "block_table": 0,
    "seq_lens": 0, "query_start_loc": 0, "slot_mapping": 0}` for `[1, T]` token inputs) makes only
    those symbolic: needed where a tensor has a dim of size 1 that is not a step dim (`[1, T]`),
    which would otherwise get a symbol too and make the token count a product the backend cannot
    pad. A function `(args, kwargs) -> None` marks a call's step dims itself (`maybe_mark_dynamic`),
    for tensors nested in the arguments.

    `dispatch`: "dynamo" (default) sends every call through dynamo's frame hook and guards;
    "direct" sends calls after the first straight to the compiled graph, with cheap checks in place
    of dynamo's guards (`ascend_compile.dispatch`; what they do not catch, and `recheck()`, are in
    the README's "Calling the graph directly").

    `backend` may also be a backend callable (`ascend_compile.backend(config, on_compiled=...)`) or
    another backend name (e.g. "eager", to compare); other keyword arguments go to `torch.compile`
    (e.g. `fullgraph=True`). The result is called like the model."""
    options = dict(options) if options is not None else None
    compiled = torch.compile(model, backend=backend, options=options, **torch_compile_kwargs)
    return CompiledStep(compiled, model, step_dims, dispatch)


# --- the backend alone -------------------------------------------------------------------------

_retrace_lock = threading.Lock()
_retrace_saved: list[tuple[Any, str, Any]] | None = None


def _end_of_compile(*_: Any) -> None:
    global _retrace_saved
    with _retrace_lock:
        if _retrace_saved is not None:
            _restore_settings(_retrace_saved)
            _retrace_saved = None


def _restart_exception() -> type[BaseException] | None:
    """The one restart exception dynamo lets through from a backend (torch 2.9 .. 2.13), or None."""
    exc = getattr(torch._dynamo.exc, "TensorifyScalarRestartAnalysis", None)
    handler = getattr(getattr(torch._dynamo, "callback", None), "callback_handler", None)
    if exc is None or not isinstance(getattr(handler, "end_callbacks", None), list):
        return None
    return exc


def specialized_inputs(gm: fx.GraphModule) -> list[str]:
    """The caller's tensor inputs (not parameters or buffers) that have a static size in the graph."""
    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            continue
        if "_dynamo_static_input_type" in node.meta.get("tensor_dict", {}):
            continue  # a parameter or buffer
        if any(not isinstance(d, torch.SymInt) for d in value.shape):
            names.append(node.name)
    return names


def retrace_general(gm: fx.GraphModule, settings: tuple[tuple[Any, str, Any], ...] = TRACE_SETTINGS) -> None:
    """Ask dynamo to trace this frame again with the general-trace settings, when `gm` has caller
    inputs with static sizes and the caller has not asked for static shapes (`dynamic=False`).

    Returns normally when the graph is to be compiled as it is; raises dynamo's restart exception
    otherwise. Dynamo internals it relies on (present in torch 2.9 .. 2.13): a backend may raise
    `torch._dynamo.exc.TensorifyScalarRestartAnalysis` (the one `RestartAnalysis` the backend call
    lets through) to have the frame traced again; an end callback of
    `torch._dynamo.callback.callback_handler` runs when the frame's compilation ends, successful or
    not, and puts the settings back. Costs one more
    dynamo trace of the first call."""
    global _retrace_saved
    exc = _restart_exception()
    if exc is None:
        return
    if not torch._dynamo.config.automatic_dynamic_shapes and torch._dynamo.config.assume_static_by_default:
        return  # torch.compile(dynamic=False): static shapes asked for
    if getattr(_local, "saved", None) is not None:
        return  # traced under a CompiledStep's settings: its static sizes are the caller's choice
    with _retrace_lock:
        if _retrace_saved is not None:
            return  # this is the retrace: compile what it traced
        static = specialized_inputs(gm)
        if not static:
            return
        handler = torch._dynamo.callback.callback_handler
        if _end_of_compile not in handler.end_callbacks:  # torch._dynamo.reset() clears them
            handler.register_end_callback(_end_of_compile)
        _retrace_saved = _apply_settings(settings)
    log.info("ascend_compile: inputs %s have static sizes: tracing again with every step size symbolic", static)
    raise exc()
