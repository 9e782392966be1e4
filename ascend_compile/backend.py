"""The `ascend_graph` dynamo backend: passes, then lowering onto a runtime, then the runner.

`torch.compile(model, backend="ascend_graph", options={...})` reaches `ascend_graph`; a runtime that
registers the backend itself calls `backend(CompileConfig(...))`.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from .config import CompileConfig
from .lowering.runner import CompiledArtifact
from .ops import timing
from .passes.find_attention import AttentionArgs, find_attention
from .passes.fx_utils import example_value
from .passes.pipeline import rewrite_buckets
from .passes.select_kernels import KernelPolicy
from .runtime import create_runtime

log = logging.getLogger("ascend_compile")


def _device_of(gm: fx.GraphModule) -> torch.device:
    for node in find_attention(gm):
        return example_value(AttentionArgs.of(node).query).device
    return torch.device("cpu")


def kernel_policy(config: CompileConfig, gm: fx.GraphModule, device: torch.device) -> KernelPolicy:
    """The kernel policy of `config`; for "auto", timing the real kernels on `device`."""
    timer = None
    if config.kernel_policy == "auto":
        query = example_value(AttentionArgs.of(find_attention(gm)[0]).query)
        seq_len = config.auto_timing_seq_len

        @functools.lru_cache(maxsize=None)
        def timer(kernel, shape, bucket):
            return timing.time_kernel(kernel, shape, bucket, seq_len, query.dtype, device)

    return KernelPolicy(
        kind=config.kernel_policy,
        pa_max_batch=config.pa_max_batch,
        pa_batch_sizes=config.pa_batch_sizes,
        timer=timer,
        timing_seq_len=config.auto_timing_seq_len,
    )


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], config: CompileConfig) -> Callable[..., Any]:
    """Compile one dynamo graph: the rewritten bucket graphs behind a runner."""
    device = _device_of(gm)
    rewritten = rewrite_buckets(gm, config, kernel_policy(config, gm, device))
    if rewritten is None:
        log.info("ascend_compile: graph has no attention: running it as traced")
        return gm.forward
    runtime = create_runtime(config.runtime, device, config.sim_overflow)
    return CompiledArtifact(rewritten, runtime, config)


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
    **options: Any,
) -> Callable[..., Any]:
    """A dynamo backend for `config` (or for `options`), for runtimes that register it themselves.

    `on_compiled` receives each compiled artifact (for its `memory_report()`, `stats`, `describe()`).
    """
    if config is None:
        config = CompileConfig.from_options(options)
    elif options:
        raise ValueError("backend: pass either a CompileConfig or options, not both")

    def compile_fn(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        compiled = compile_graph(gm, example_inputs, config)
        if on_compiled is not None and isinstance(compiled, CompiledArtifact):
            on_compiled(compiled)
        return compiled

    return compile_fn
