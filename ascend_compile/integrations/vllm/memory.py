"""The device memory our graphs take outside vLLM's KV-cache budget, reported as it grows.

vLLM sizes its KV cache from an eager profiling run, counting 0 bytes for graphs under
`cudagraph_mode=NONE`; the profiling run has no attention metadata and no caches, so nothing of
ours can be captured before that sizing. What the captures take (the workspace slots, each captured
bucket's static input buffers and outputs, the graph pool) is therefore reported instead, after
each new capture, as one figure to reserve: lower `gpu_memory_utilization` by it (as a fraction of
the device's memory), or set `kv_cache_memory_bytes` that much below what vLLM chose.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("ascend_compile")
MIB = 2 ** 20


def graph_memory(report: dict[str, Any]) -> dict[str, int]:
    """Bytes by kind from `CompiledArtifact.memory_report()`: workspaces, static buffers and outputs,
    and the graph pool where the runtime reports one."""
    buffers = sum(sum(graph.values()) for graph in report["graphs"].values())
    pool = report.get("pool", {}).get("graph", {}).get("reserved_bytes", 0)
    return {"workspaces": sum(report["workspace_bytes"].values()), "buffers": buffers, "pool": pool}


def log_graph_memory(artifact: Any) -> int:
    """Log the artifact's graph memory now (after a capture); the total in bytes."""
    parts = graph_memory(artifact.memory_report())
    total = sum(parts.values())
    log.info("ascend_compile: vLLM graphs take %.1f MiB outside vLLM's KV-cache budget after %d captures "
             "(workspaces %.1f, static buffers and outputs %.1f, graph pool %.1f MiB): reserve it by lowering "
             "gpu_memory_utilization or kv_cache_memory_bytes", total / MIB, artifact.stats["captures"],
             parts["workspaces"] / MIB, parts["buffers"] / MIB, parts["pool"] / MIB)
    return total
