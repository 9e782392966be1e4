"""The device memory our graphs take outside vLLM's KV-cache budget: estimated before vLLM sizes
its KV cache, and measured after each capture.

vLLM sizes its KV cache from an eager profiling run, counting 0 bytes for graphs under
`cudagraph_mode=NONE`; the profiling run has no attention metadata and no caches, so nothing of
ours can be compiled, let alone captured, before that sizing. What the captures will take is
therefore estimated from what is known then (`estimate`), by host arithmetic only, nothing run on
the device, no throwaway capture (vLLM-Ascend reverted an estimator that captured before the KV
cache existed, #11562: its extra warm-up and capture hung an HCCL collective):

- the workspace slots: the same workspace plan the compile makes (`passes.pipeline.workspace_plan`),
  over the kernels the policy picks per bucket for the layers vLLM's forward context holds
  (their heads, head size, features), vLLM's block size and `max_model_len`;
- each graph's static input buffers: the graph's step-sized inputs and each metadata group's
  provided inputs (`metadata.staged_bytes`), at its bucket;
- the graph pool: the graph's allocations traced on fake tensors (`passes/memory_estimate.py`) and
  replayed, in capture order (decode graphs largest first as `capture_all` does, then mixed ones),
  over a model of the runtime's pool allocator (`runtime/pool_model.py`); each capture frees all it
  allocated when it ends, its outputs too (a captured graph keeps weak aliases of them, read right
  after each replay: `lowering/graph_entry.py`), so later captures reuse the pool's blocks.

It covers every graph the compile can capture (each bucket's decode graph and, where its decode
kernel is PA, its mixed graph): what serving reaches, not just `capture_all`. `kv_budget.py` takes
it out of vLLM's KV-cache budget; `ASCEND_COMPILE_GRAPH_MEMORY` overrides it (bytes; 0 reserves
nothing). After each new capture the measured figure is logged beside the reserved one.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from typing import Any

import torch

from ...ops.tiling import AttentionShape
from ...passes.fx_utils import example_value
from ...passes.memory_estimate import trace_allocations
from ...passes.pipeline import bucket_choices, workspace_plan
from ...passes.select_kernels import AttentionLayer
from ...passes.workspaces import KernelSite
from ...ops.features import PLAIN
from ...runtime.pool_model import one_kernel, pool_model
from .layers import layer_features
from .metadata import staged_bytes

log = logging.getLogger("ascend_compile")
MIB = 2 ** 20
#: Bytes to reserve instead of the estimate (0: reserve nothing); unset or "auto": the estimate.
ENV = "ASCEND_COMPILE_GRAPH_MEMORY"

#: The vLLM graphs of this process (`DeferredCompile`s), each with the order it was handed over in.
_TRACKED: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_HANDED_OVER = [0]


def track(graph: Any) -> None:
    """Count `graph` (a `DeferredCompile`) among the graphs handed over from now on."""
    _HANDED_OVER[0] += 1
    _TRACKED[graph] = _HANDED_OVER[0]


def handed_over() -> int:
    """How many graphs were handed over so far (`tracked(since=...)`)."""
    return _HANDED_OVER[0]


def tracked(since: int = 0) -> list[Any]:
    """The graphs handed over after the first `since` and not compiled yet (what one profiling
    run handed over, for `since` taken before it)."""
    return [g for g, n in list(_TRACKED.items()) if n > since and g.compiled is None]


@dataclasses.dataclass(frozen=True)
class GraphMemoryEstimate:
    """What a vLLM graph's captures will take, by kind (see the module docstring), in bytes."""

    workspaces: int
    buffers: int
    pool: int
    graphs: int  # the graphs it covers

    @property
    def total(self) -> int:
        return self.workspaces + self.buffers + self.pool

    def describe(self) -> str:
        return (f"{self.total / MIB:.1f} MiB (workspaces {self.workspaces / MIB:.1f}, static buffers "
                f"{self.buffers / MIB:.1f}, graph pool {self.pool / MIB:.1f} MiB, over {self.graphs} graphs)")


def graph_memory(report: dict[str, Any]) -> dict[str, int]:
    """Bytes by kind from `CompiledArtifact.memory_report()`: workspaces, static input buffers, and
    the graph pool where the runtime reports one (the graphs' outputs live in it)."""
    buffers = sum(graph["static_inputs_bytes"] for graph in report["graphs"].values())
    pool = report.get("pool", {}).get("graph", {}).get("reserved_bytes", 0)
    return {"workspaces": sum(report["workspace_bytes"].values()), "buffers": buffers, "pool": pool}


def log_graph_memory(artifact: Any, reserved: int | None = None) -> int:
    """Log the artifact's graph memory now (after a capture) beside what was `reserved` before the
    KV cache was sized (None: nothing was); the total in bytes."""
    parts = graph_memory(artifact.memory_report())
    total = sum(parts.values())
    detail = (f"(workspaces {parts['workspaces'] / MIB:.1f}, static buffers {parts['buffers'] / MIB:.1f}, "
              f"graph pool {parts['pool'] / MIB:.1f} MiB)")
    if reserved is None:
        log.info("ascend_compile: vLLM graphs take %.1f MiB outside vLLM's KV-cache budget after %d captures %s: "
                 "reserve it by lowering gpu_memory_utilization or kv_cache_memory_bytes", total / MIB,
                 artifact.stats["captures"], detail)
    elif total > reserved:
        log.warning("ascend_compile: vLLM graphs take %.1f MiB after %d captures %s, more than the %.1f MiB "
                    "reserved before the KV cache was sized: set %s to at least %d", total / MIB,
                    artifact.stats["captures"], detail, reserved / MIB, ENV, total)
    else:
        log.info("ascend_compile: vLLM graphs take %.1f MiB after %d captures %s, of the %.1f MiB reserved "
                 "before the KV cache was sized", total / MIB, artifact.stats["captures"], detail, reserved / MIB)
    return total


def override() -> int | None:
    """The bytes `ASCEND_COMPILE_GRAPH_MEMORY` sets (None: estimate)."""
    value = os.environ.get(ENV, "auto").strip()
    if value == "auto":
        return None
    try:
        nbytes = int(value)
    except ValueError:
        nbytes = -1
    if nbytes < 0:
        raise ValueError(f"{ENV}: expected 'auto' or a number of bytes >= 0, got {value!r}")
    return nbytes


def attention_layer(name: str, layer: Any, block_size: int) -> AttentionLayer:
    """A vLLM attention layer's shape and features, as the rewrite will see them: MLA's latent
    (`kv_lora_rank`, `qk_rope_head_dim`, one KV head) or heads and head size."""
    if hasattr(layer, "kv_lora_rank"):
        return AttentionLayer(AttentionShape(int(layer.num_heads), 1, int(layer.kv_lora_rank), block_size,
                                             rope_dim=int(layer.qk_rope_head_dim)), PLAIN)
    return AttentionLayer(AttentionShape(int(layer.num_heads), int(layer.num_kv_heads), int(layer.head_size),
                                         block_size), layer_features(name, layer))


def metadata_groups(layers: dict[str, Any], vllm_config: Any) -> int:
    """How many metadata objects (KV-cache groups) the layers' steps will carry: one per distinct
    KV-cache spec, as vLLM groups them."""
    specs = set()
    for layer in layers.values():
        try:
            specs.add(layer.get_kv_cache_spec(vllm_config))
        except Exception:  # noqa: BLE001 - a layer without a (hashable) spec: a group of its own
            specs.add(id(layer))
    return max(1, len(specs))


def estimate(graph: Any, vllm_config: Any) -> GraphMemoryEstimate | None:
    """The memory `graph`'s captures will take (see the module docstring), or None where its
    allocations cannot be traced (said why)."""
    gm, config = graph.gm, graph.config
    tensors = [v for v in map(example_value, gm.graph.find_nodes(op="placeholder")) if isinstance(v, torch.Tensor)]
    target = graph.target(tensors[0].device, config)
    runtime = target.runtime
    block_size = int(vllm_config.cache_config.block_size)
    context = vllm_config.compilation_config.static_forward_context
    layers = {name: context[name] for name in graph.layers}
    attention = [attention_layer(name, layer, block_size) for name, layer in layers.items()]
    dtype = vllm_config.model_config.dtype
    policy = target.kernel_policy(config, dtype) if config.kernel_policy != "auto" else None
    # "auto" times kernels on the device: sized for both of its choices instead
    policies = [policy] if policy is not None else [target.kernel_policy(dataclasses.replace(config, kernel_policy=k),
                                                                         dtype) for k in ("pa", "fia")]
    graphs = pool_model(runtime) is not None
    trace = trace_allocations(gm, one_kernel(runtime)) if graphs else None
    if graphs and trace is None:
        return None
    groups = metadata_groups(layers, vllm_config)
    max_blocks = -(-config.max_model_len // block_size)
    estimates = []
    for policy in policies:
        choices = bucket_choices(attention, config.capture_sizes, policy, target.mixed_graph_kernels)
        names = list(layers)

        def sites_of(key: Any, choices: Any = choices) -> list[KernelSite]:
            return [KernelSite(name, choice.kernel, layer.shape, layer.features)
                    for name, layer, choice in zip(names, attention, choices[key])]

        plan = workspace_plan(choices, sites_of, config, target.workspace_estimate(config, dtype))
        workspaces = sum(slot.nbytes for slot in plan.slots.values())
        if trace is None:  # no graphs: the slots only
            estimates.append(GraphMemoryEstimate(workspaces, 0, 0, 0))
            continue
        keys = sorted(choices, key=lambda k: (not k.decode, -k.bucket))  # capture order
        pool = trace.pool_reserved(pool_model(runtime), [key.bucket for key in keys])
        buffers = sum(trace.staged_bytes(k.bucket) + groups * staged_bytes(k.bucket, k.bucket, max_blocks)
                      for k in keys)
        estimates.append(GraphMemoryEstimate(workspaces, buffers, pool, len(keys)))
    return max(estimates, key=lambda e: e.total)
