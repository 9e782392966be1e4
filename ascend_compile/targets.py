"""One target per device: everything the compiler asks of the device it compiles for.

A target bundles the runtime (what it can do is its type: `runtime/base.py`), how workspaces are
sized there, the kernel timer of the "auto" policy, how a bucket's graph is specialised from its
variant when it is captured (CUDA: device-length kernels and the inner compiler), and the two
lowering policies a capture follows (`UpdateSchedule`, `WorkspaceLifetime`). The backend asks the
target and never a runtime's name; a new device is a new target here and a runtime in `runtime/`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, ClassVar, Sequence

import torch
from torch import fx

from .config import CompileConfig
from .lowering.capture import UpdateSchedule, WorkspaceLifetime
from .ops import timing
from .ops.cuda_mla import check_mla_tiles
from .ops.kernel_policy import PA_MAX_BATCH, KernelPolicy, KernelTimer
from .ops.tiling import FIA, MLA, PA
from .passes.kernel_call import DEVICE_LENGTH_OPS
from .passes.fx_utils import clone_graph_module, example_value
from .passes.kernel_call import KernelCall, StepGuard, kernel_calls
from .passes.find_attention import attention_nodes, layer_name
from .passes.npu_checks import check_npu_graph, npu_step_guard
from .passes.workspaces import GraphKey, NeedFn, node_need
from .runtime import create_runtime, resolve_runtime
from .runtime.base import GraphRuntime, Runtime

#: Builds the target for a graph's device and config (`backend(target=...)` takes one).
TargetFactory = Callable[[torch.device, CompileConfig], "Target"]


@dataclasses.dataclass
class Target:
    """The simulator's and the eager runtime's target, and the base of the others: exact workspace
    formulas, kernels timed as torch ops on the device, graphs captured as their variant."""

    runtime: Runtime
    #: The kernels whose decode graph cannot serve mixed steps: a bucket with one of them gets a mixed
    #: graph of its own. PA is decode-only; the ascend FIA and MLA (FIA v2) take one branch for one
    #: query token per sequence and another for more by the docs (`_op_plugin_docs.py` L8056, L8580), so
    #: each graph is captured in the shape of its steps and the simulator refuses an update to the other
    #: branch (`SimRuntime.query_length_branches`). The kernel source routes a TND call by head dim, rope and
    #: quantisation, not by its query lengths (ops-transformer c29bc106 `fused_infer_attention_score_tiling.cpp`
    #: `IsUsingIFA` L687-734; bfbbec83 L1259-1374, L1789-1803): for FIA the split rests on the docs only; MLA's
    #: graphs also keep their capture's sparse mode (`npu_rules.mla_sparse_mode`).
    mixed_graph_kernels: ClassVar[frozenset[str]] = frozenset({PA, FIA, MLA})
    #: Whether kernels take host lengths, which the runner then reads from each step (one host copy
    #: of each length input); False where they read them on the device, so no step waits for it.
    host_lengths: ClassVar[bool] = True
    updates: UpdateSchedule = dataclasses.field(default_factory=UpdateSchedule)
    workspaces: WorkspaceLifetime = dataclasses.field(default_factory=WorkspaceLifetime)

    def check(self, config: CompileConfig) -> None:
        """Refuse options this target cannot honour."""
        if config.inner_compiler != "eager":
            raise ValueError(
                f"inner_compiler: {config.inner_compiler!r} compiles the graphs that runtime 'cuda' captures; "
                f"runtime {self.runtime.name!r} has no such graphs (its kernels need task updates, or it has no "
                f"graphs), use inner_compiler='eager' there"
            )

    def check_kernel(self, kernel: str, layer: str) -> None:
        """Refuse, at compile time and naming the layer, a kernel this target does not run: here
        the reference kernels run every one."""

    def kernel_timer(self, config: CompileConfig, dtype: torch.dtype) -> KernelTimer:
        device = self.runtime.device
        return lambda kernel, shape, bucket: timing.time_kernel(kernel, shape, bucket, config.auto_timing_seq_len,
                                                                dtype, device)

    def kernel_policy(self, config: CompileConfig, dtype: torch.dtype) -> KernelPolicy:
        """The policy of `config`; for "auto", timing this target's kernels (once per shape and bucket)."""
        timer = functools.lru_cache(maxsize=None)(self.kernel_timer(config, dtype)) \
            if config.kernel_policy == "auto" else None
        return KernelPolicy(kind=config.kernel_policy, pa_max_batch=config.pa_max_batch,
                            pa_batch_sizes=config.pa_batch_sizes, timer=timer,
                            timing_seq_len=config.auto_timing_seq_len)

    def workspace_need(self, config: CompileConfig, dtype: torch.dtype) -> NeedFn:
        """How a kernel node's workspace is sized: the exact formula scan."""
        return node_need

    def workspace_estimate(self, config: CompileConfig, dtype: torch.dtype) -> NeedFn:
        """How a kernel node's workspace is sized before anything is compiled or asked of the device
        (graph memory known before vLLM sizes its KV cache): as `workspace_need`."""
        return self.workspace_need(config, dtype)

    def specialize(self, gm: fx.GraphModule, key: GraphKey, config: CompileConfig) -> fx.GraphModule:
        """The graph `key` captures, from its variant `gm`: the variant itself."""
        return gm

    @property
    def captures_graphs(self) -> bool:
        """Whether steps are captured at all (else no piecewise graphs are planned either)."""
        return isinstance(self.runtime, GraphRuntime)

    def piecewise_graph(self, gm: fx.GraphModule, key: GraphKey, config: CompileConfig) -> fx.GraphModule:
        """The graph `key`'s pieces are split from, from the piecewise variant `gm`
        (`lowering/piecewise.py`): its kernels run eagerly between pieces as this device takes them."""
        return gm

    def check_graph(self, gm: fx.GraphModule, keys: Sequence[GraphKey]) -> dict[str, str]:
        """Refuse, at compile time, what this device cannot run in `gm` (a variant serving `keys`); the
        layers to serve eagerly instead (attention node name -> why; `refused_layers="eager"`): here none."""
        return {}

    def step_guard(self, gm: fx.GraphModule, key: GraphKey, config: CompileConfig) -> StepGuard | None:
        """Why a step may not run on `gm` captured as `key`'s graph (it then runs eagerly), or None when
        every step may."""
        return None

    def eager_reason(self, gm: fx.GraphModule, key: GraphKey) -> str | None:
        """Why `gm`, as `key`'s graph, serves every step eagerly and is never captured, or None: a full graph
        holding a layer served eagerly (an attention op no kernel replaced, `check_graph`) is not captured, its
        steps go to piecewise graphs, which run that op between pieces."""
        left = None if key.piecewise else next(iter(attention_nodes(gm)), None)
        return f"{key}: not captured, its layer {layer_name(left)} is served eagerly" if left is not None else None

    def describe_kernel(self, call: KernelCall) -> dict[str, str]:
        """What plan.json says of a kernel node beyond its meta: here nothing."""
        return {}


@dataclasses.dataclass
class NpuTarget(Target):
    """Ascend through torch_npu: workspaces from torch_npu's own queries, asked at compile time
    (no formula), "auto" timing the torch_npu kernels the runtime binds, and the kernels' documented
    constraints refused at compile time (and FIA's and MLA's length rules at each step)."""

    #: What a FIA layer whose form the device's kernel refuses does (`CompileConfig.refused_layers`).
    refused_layers: str = "raise"

    #: As the simulator's (FIA's two branches); MLA runs as FIA v2's MLA form, whose sparse mode a call's
    #: query lengths decide too ("Q_S等于1时只支持sparse=0且不传mask，Q_S大于1时只支持sparse=3且传入mask",
    #: torch_npu 2.14 `_op_plugin_docs.py` L8697): each graph keeps its mode.

    def kernel_timer(self, config: CompileConfig, dtype: torch.dtype) -> KernelTimer:
        """Times torch_npu's PA and FIA; refused before any is timed where the installed torch_npu lacks the
        functions of either (`ops/npu/api.py`): "auto" compares the two."""
        from .ops.npu import kernels as npu_ops
        from .ops.npu import api as npu_api

        runtime = self.runtime
        npu_api.require(npu_api.PA_API + npu_api.FIA_API, runtime.api_absent, runtime.torch_npu_version,
                        "kernel_policy 'auto' (it times PA and FIA)")
        return lambda kernel, shape, bucket: npu_ops.time_kernel(
            runtime.kernels, runtime.synchronize, kernel, shape, bucket, config.auto_timing_seq_len, dtype)

    def workspace_estimate(self, config: CompileConfig, dtype: torch.dtype) -> NeedFn:
        """Before compiling (vLLM's profiling run, before it sizes its KV cache), the simulator's formula for PA
        and FIA (its tiling, `ops/tiling.py`: torch_npu's queries are asked when the graph compiles; the figure
        logged after the captures says how far the estimate was); for MLA the device's own answer, asked here:
        its probe tensors stay small where the answer reads no token count (`NpuWorkspaceQuery.mla_max`), and
        that answer, sized by the core count on the later kernel source, is what the compile will reserve,
        where the simulator's formula grows with the tokens (256 MiB at a piecewise 4096)."""
        probed = self.workspace_need(config, dtype)
        return lambda site, *args: (probed if site.kernel == MLA else node_need)(site, *args)

    def workspace_need(self, config: CompileConfig, dtype: torch.dtype) -> NeedFn:
        """torch_npu's workspace queries, asked as each answers (`passes/probe.py`)."""
        from .ops.npu.workspace_queries import NpuWorkspaceQuery
        from .passes.probe import ProbedWorkspaceNeed

        return ProbedWorkspaceNeed(NpuWorkspaceQuery(self.runtime.kernels, dtype), config.workspace_probe_lens)

    def check_graph(self, gm: fx.GraphModule, keys: Sequence[GraphKey]) -> dict[str, str]:
        """Every kernel and cache write held to the torch_npu kernels' documented constraints
        (`passes/npu_checks.py`), and to the functions the installed torch_npu offers (`ops/npu/api.py`),
        before torch_npu is asked anything; then each FIA layer's form asked of the device's kernel once
        (`ops/npu/form_probe.py`: a refused form refused, or under `refused_layers="eager"` returned, its
        layer then served eagerly), and a windowed layer's band probes (`ops/npu/band_probe.py`): asked here,
        at compile time, so that a persisted plan holds their answers (`plan_cache.py`)."""
        from .ops.npu import band_probe as npu_band_probe, form_probe as npu_form_probe
        from .passes.npu_checks import windowed_fia_layers

        eager = check_npu_graph(gm, keys, self.mixed_graph_kernels, self.runtime.api_absent,
                                self.runtime.torch_npu_version,
                                functools.partial(npu_form_probe.refusal, self.runtime.kernels),
                                self.refused_layers == "eager")
        served_eagerly = {call.node.name for call in kernel_calls(gm) if call.meta.attention in eager}
        for name, (_, form, _, _) in windowed_fia_layers(gm).items():
            if name in served_eagerly:
                continue
            npu_band_probe.band_edge(self.runtime.kernels, form)
            npu_band_probe.band_at_single_query(self.runtime.kernels, form)
        return eager

    def step_guard(self, gm: fx.GraphModule, key: GraphKey, config: CompileConfig) -> StepGuard | None:
        """FIA's and MLA's block count, MLA's query lengths and sparse mode, with `pa_workspace_check`
        PA's workspace need, on each step's padded lengths, and the windowed layers' decode steps where the
        device does not apply FIA's band at one query token per sequence (`passes/npu_checks.py`)."""
        from .ops.npu.workspace_queries import NpuWorkspaceQuery

        kernels = self.runtime.kernels
        return npu_step_guard(gm, key, (lambda dtype: NpuWorkspaceQuery(kernels, dtype)) if config.pa_workspace_check
                              else None, config.max_model_len, kernels.band_at_single_query)

    def eager_reason(self, gm: fx.GraphModule, key: GraphKey) -> str | None:
        """As the base target's; and where the device's band edge probe found no `pre_tokens` serving a window
        (`ops/npu/band_probe.py`), every graph with a windowed FIA layer runs its steps eagerly, through the
        model's own attention."""
        from .ops.npu import band_probe as npu_band_probe
        from .passes.npu_checks import windowed_fia_layers

        left = super().eager_reason(gm, key)
        if left:
            return left
        for name, (_, form, _, _) in windowed_fia_layers(gm).items():
            why = npu_band_probe.windowed_refusal(self.runtime.kernels, form)
            if why:
                return f"{key}: not captured, its windowed layer {name} runs eagerly: {why}"
        return None

    def describe_kernel(self, call: KernelCall) -> dict[str, str]:
        """How a windowed FIA layer's window is served: the band of the `pre_tokens` the device's edge probe
        found, in every step, or not in decode steps with a sequence longer than it, as the device's S=1 band
        probe answered, or not at all (`ops/npu/band_probe.py`)."""
        from .ops.npu import band_probe as npu_band_probe

        window = call.meta.features.window
        if call.meta.kernel != FIA or window is None:
            return {}
        kernels = self.runtime.kernels
        form = npu_band_probe.form(call.meta.shape, example_value(call.arg("query")).dtype, call.meta.features.sinks)
        if form not in npu_band_probe.known_edges(kernels):
            return {"window_served": "FIA band mode; the band edge probe not asked yet (it is at this layer's "
                                     "first graph)"}
        edge = npu_band_probe.known_edges(kernels)[form]
        if edge is None:
            return {"window_served": f"eagerly, not on FIA: {npu_band_probe.EDGE_REFUSAL}"}
        band = (f"FIA band mode (sparse_mode 4, pre_tokens {window - edge}, next_tokens 0: the band edge probe "
                f"found {npu_band_probe.READINGS[edge]})")
        answer = npu_band_probe.known(kernels).get(form)
        if answer is None:
            return {"window_served": f"{band}; the S=1 band probe not asked yet (it is at this layer's first graph)"}
        if answer:
            return {"window_served": f"{band} in every step: the S=1 band probe found the band applied at one "
                                     f"query token per sequence"}
        return {"window_served": f"{band} in steps with a sequence of several query tokens and in decode steps "
                                 f"within the window; decode steps with a sequence longer than {window} run "
                                 f"eagerly: the S=1 band probe found the band not applied at one query token per "
                                 f"sequence ('Q_S为1时该参数无效', _op_plugin_docs.py L8110)"}

    def specialize(self, gm: fx.GraphModule, key: GraphKey, config: CompileConfig) -> fx.GraphModule:
        """The variant, with each non-contiguous query copied contiguous before its kernel
        (`passes/contiguous_query.py`): torch_npu's kernels take contiguous queries."""
        from .passes.contiguous_query import contiguous_queries

        return contiguous_queries(gm)

    def piecewise_graph(self, gm: fx.GraphModule, key: GraphKey, config: CompileConfig) -> fx.GraphModule:
        """As `specialize`: torch_npu's kernels take contiguous queries, called eagerly too."""
        return self.specialize(gm, key, config)


@dataclasses.dataclass
class CudaTarget(Target):
    """CUDA graphs: kernels read lengths on the device (no task updates), split a fixed number of
    times per bucket, which fixes their workspaces; an inner compiler (inductor) may compile each
    bucket's graph around them."""

    host_lengths: ClassVar[bool] = False
    #: Only PA is decode-only here: the Triton FIA and MLA kernels read their lengths on the device, one
    #: kernel for any query lengths, so a bucket's decode graph serves its mixed steps too.
    mixed_graph_kernels: ClassVar[frozenset[str]] = frozenset({PA})

    def check(self, config: CompileConfig) -> None:
        """Every option holds on CUDA, the inner compiler included."""

    def check_kernel(self, kernel: str, layer: str) -> None:
        """A kernel without a device-length form cannot be captured in a CUDA graph, whose kernels
        read their lengths on the device (PA, FIA and MLA have one: `kernel_call.DEVICE_LENGTH_OPS`)."""
        if kernel not in DEVICE_LENGTH_OPS:
            raise ValueError(
                f"{layer}: runtime 'cuda' has no {kernel} kernel reading its lengths on the device (CUDA graphs "
                f"cannot refresh host lengths): compile with runtime='eager' (or 'sim' on CPU tensors)"
            )

    def check_graph(self, gm: fx.GraphModule, keys: Sequence[GraphKey]) -> dict[str, str]:
        """Latent-attention layers of dims the Triton MLA kernels' tiles were not checked for on
        sm_90 (`ops/cuda_mla.py: check_mla_tiles`), refused naming the layer; none served eagerly."""
        for call in kernel_calls(gm):
            if call.meta.kernel == MLA:
                try:
                    check_mla_tiles(call.meta.shape)
                except ValueError as err:
                    raise ValueError(f"{layer_name(call.node)}: {err}") from None
        return {}

    def kernel_policy(self, config: CompileConfig, dtype: torch.dtype) -> KernelPolicy:
        """The decode kernel (PA) for every decode-only bucket under the default policy: its device
        schedule balances any batch, so `pa_max_batch` (an Ascend heuristic) does not apply here;
        an explicit policy, `auto` included, is kept."""
        policy = super().kernel_policy(config, dtype)
        if config.kernel_policy == "pa_max_batch" and config.pa_max_batch == PA_MAX_BATCH:
            return dataclasses.replace(policy, kind="pa", why_pa="decode-only bucket on CUDA, whose device schedule "
                                                                 "balances any batch")
        return policy

    def splits(self, config: CompileConfig):
        from .ops.cuda import gpu_splits

        return gpu_splits(self.runtime.num_sms, config.max_model_len)

    def workspace_need(self, config: CompileConfig, dtype: torch.dtype) -> NeedFn:
        from .passes.device_lengths import fixed_split_need

        return fixed_split_need(self.splits(config))

    def specialize(self, gm: fx.GraphModule, key: GraphKey, config: CompileConfig) -> fx.GraphModule:
        """A copy of the variant whose kernels read lengths on the device, split for `key`'s bucket,
        compiled by the inner compiler when one is configured."""
        from .passes.device_lengths import use_device_lengths
        from .passes.inner_compile import compile_inner

        gm = clone_graph_module(gm)
        use_device_lengths(gm, key.bucket, self.splits(config))
        if config.inner_compiler != "eager":
            compile_inner(gm, config.inner_compiler)
        return gm

    def piecewise_graph(self, gm: fx.GraphModule, key: GraphKey, config: CompileConfig) -> fx.GraphModule:
        """The variant's kernels reading lengths on the device, split for `key`'s token count (the
        slot's fixed-split workspace holds any step up to it); the pieces run op by op (no inner
        compiler: each piece is captured as traced)."""
        from .passes.device_lengths import use_device_lengths

        gm = clone_graph_module(gm)
        use_device_lengths(gm, key.bucket, self.splits(config))
        return gm


def default_target(device: torch.device, config: CompileConfig) -> Target:
    """The target `config.runtime` means for tensors on `device`."""
    name = resolve_runtime(config.runtime, device)
    runtime = create_runtime(name, device, config.sim_overflow)
    if name == "npu":
        return NpuTarget(runtime, refused_layers=config.refused_layers)
    if name == "cuda":
        return CudaTarget(runtime)
    return Target(runtime)
