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

from .compile_once import retrace_general
from .config import CompileConfig
from .lowering.runner import CompiledArtifact
from .ops import npu as npu_ops
from .ops import timing
from .ops.cuda import SplitsFn, gpu_splits
from .passes.device_lengths import apply_device_lengths, fixed_split_need
from .passes.find_attention import AttentionArgs, find_attention
from .passes.fx_utils import example_value
from .passes.inner_compile import compile_inner
from .passes.pipeline import rewrite_buckets
from .passes.probe import ProbedWorkspaceNeed
from .passes.select_kernels import KernelPolicy
from .passes.workspaces import NeedFn, node_need
from .runtime import create_runtime
from .runtime.base import Runtime

log = logging.getLogger("ascend_compile")


def _device_of(gm: fx.GraphModule) -> torch.device:
    for node in find_attention(gm):
        return example_value(AttentionArgs.of(node).query).device
    return torch.device("cpu")


def kernel_policy(
    config: CompileConfig, gm: fx.GraphModule, device: torch.device, runtime: Runtime | None = None
) -> KernelPolicy:
    """The kernel policy of `config`; for "auto", timing the real kernels on `device` (on "npu",
    the torch_npu kernels the runtime binds)."""
    timer = None
    if config.kernel_policy == "auto":
        query = example_value(AttentionArgs.of(find_attention(gm)[0]).query)
        seq_len = config.auto_timing_seq_len

        @functools.lru_cache(maxsize=None)
        def timer(kernel, shape, bucket):
            if runtime is not None and runtime.name == "npu":
                return npu_ops.time_kernel(
                    runtime.kernels, runtime.synchronize, kernel, shape, bucket, seq_len, query.dtype
                )
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
    if not find_attention(gm):
        log.info("ascend_compile: graph has no attention: running it as traced")
        return gm.forward
    if config.retrace_static:
        retrace_general(gm)  # may raise dynamo's restart: the frame is traced again, general
    runtime = create_runtime(config.runtime, device, config.sim_overflow)
    _check_inner_compiler(config, runtime)
    splits = _device_length_splits(runtime, config)
    rewritten = rewrite_buckets(
        gm, config, kernel_policy(config, gm, device, runtime), _workspace_need(runtime, gm, config, splits)
    )
    if splits is not None:
        apply_device_lengths(rewritten.graphs, splits, rewritten.graph_dir)
    if config.inner_compiler != "eager":
        for graph in rewritten.graphs.values():
            compile_inner(graph, config.inner_compiler)
    return CompiledArtifact(rewritten, runtime, config)


def _check_inner_compiler(config: CompileConfig, runtime: Runtime) -> None:
    """An inner compiler runs inside captured graphs whose kernels need no task updates (cuda)."""
    if config.inner_compiler != "eager" and (runtime.needs_task_updates or not runtime.supports_graphs):
        raise ValueError(
            f"inner_compiler: {config.inner_compiler!r} compiles the graphs that runtime 'cuda' captures; "
            f"runtime {runtime.name!r} {'needs task updates' if runtime.supports_graphs else 'has no graphs'}, "
            f"use inner_compiler='eager' there"
        )


def _device_length_splits(runtime: Runtime, config: CompileConfig) -> SplitsFn | None:
    """On CUDA (no task updates) the split rule of the device-length kernels; None elsewhere."""
    if runtime.name != "cuda" or config.max_model_len is None:
        return None
    return gpu_splits(runtime.num_sms, config.max_model_len)


def _workspace_need(runtime: Runtime, gm: fx.GraphModule, config: CompileConfig, splits: SplitsFn | None) -> NeedFn:
    """How workspaces are sized: torch_npu's queries on "npu", the fixed-split formula of the
    device-length kernels on "cuda", else the exact formula scan."""
    if runtime.name == "npu":
        return _npu_workspace_need(runtime, gm, config)
    return node_need if splits is None else fixed_split_need(splits)


def _npu_workspace_need(runtime: Runtime, gm: fx.GraphModule, config: CompileConfig) -> ProbedWorkspaceNeed:
    """On "npu" (no workspace formula) workspaces are sized by torch_npu's workspace queries,
    probed at compile time over `config.workspace_probe_lens`."""
    dtype = example_value(AttentionArgs.of(find_attention(gm)[0]).query).dtype
    return ProbedWorkspaceNeed(npu_ops.NpuWorkspaceQuery(runtime.kernels, dtype), config.workspace_probe_lens)


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
