"""What a compiled artifact reports of itself: its plan (plan.json, `inspect`) and the memory it holds.

Read-only over the artifact (`runner.CompiledArtifact`): the runner calls these when it writes the
plan or is asked for its memory, so its own module stays the step's logic.
"""
from __future__ import annotations

from typing import Any, Callable

from ..passes.kernel_call import kernel_calls
from ..passes.roles import IN_PLACE_ROLES


def memory_report(art: Any) -> dict[str, Any]:
    """Bytes held by this artifact: workspace slots, static buffers and outputs per graph, pool."""
    report = {
        "workspace_bytes": {name: t.numel() for name, t in art.workspaces.items()},
        **({"workspace_group": art.group.describe()} if art.group is not None else {}),
        "graphs": {g.name: g.memory() for g in art.graphs.values() if g.graph is not None},
        "piecewise": {g.name: g.memory() for g in art.piecewise.values() if g.pieces},
    }
    stats: Callable[[], Any] | None = getattr(art.runtime, "memory_stats", None)
    if stats is not None:
        report["pool"] = stats()
    return report

def describe(art: Any) -> dict[str, Any]:
    """The plan.json content of a compiled artifact: the passes' plan, each in-place input's per-step
    address check, each kernel's decision, each captured graph's update table and first-replay check."""
    plan = {"model": art.config.model_name, **art.rewritten.describe()}
    plan["runtime"] = art.runtime.describe()
    if art.group is not None:  # the slot its models share, against a slot each (`workspace_group.py`)
        plan["workspace"]["group"] = art.group.describe()
    plan["config"] = {k: v for k, v in vars(art.config).items()}
    checked, in_place = set(art.checked), {role.value for role in IN_PLACE_ROLES}
    for spec in plan["inputs"]:
        if spec["role"] in in_place:
            spec["address_checked"] = spec["index"] in checked  # each step (False: a frozen parameter)
    for key, gm in art.specialized.items():
        for kernel, call in zip(plan["graphs"][str(key)]["kernels"], kernel_calls(gm)):
            kernel.update(call.meta.describe(), node=call.node.name, **art.target.describe_kernel(call))
    for (key, specialization), entry in art.graphs.items():
        if entry.graph is None:
            if entry.eager_reason:  # e.g. an op that cannot be captured: its steps run eagerly
                plan["graphs"][str(key)].setdefault("not_captured", {})[entry.name] = entry.eager_reason
            continue
        graph = plan["graphs"][str(key)]
        captured = {"update_table": entry.table.describe(), "capture_seconds": round(entry.capture_seconds, 4)}
        if entry.verified is not None:
            captured["verified"] = entry.verified
        if specialization:
            graph.setdefault("specializations", {})[entry.name] = captured
        if not specialization or "update_table" not in graph:
            graph.update(captured)
    plan["piecewise"] = _piecewise(art)
    plan["failed_captures"] = dict(art.failures.graphs)  # graphs the device refused (`capture_failures.py`)
    plan["startup"] = art.startup.describe(art)  # the compile's phases, each capture, the graph budget
    served: dict[str, dict[str, int]] = {}
    for (kind, path), count in sorted(art.served.items()):
        served.setdefault(kind, {})[path] = count
    plan["served"] = {"steps": served, "not_full": dict(art.not_full.most_common())}
    return plan


def _piecewise(art: Any) -> dict[str, Any]:
    """What plan.json says of piecewise graphs: the sizes, or why there are none; each captured key's
    pieces and eager nodes (and why each node runs eagerly, for the first one split)."""
    variant = art.rewritten.piecewise
    if variant is None:
        return {"enabled": False, "reason": art.rewritten.piecewise_reason}
    graphs = {g.name: g.describe() for g in art.piecewise.values()}
    first = next(iter(art.piecewise.values()), None)
    return {
        "enabled": True,
        "sizes": [k.bucket for k in variant.keys],
        "kernels": sorted(set(variant.kernels)),
        "workspace_slot": art.rewritten.plan.graph_slot[str(variant.keys[-1])],
        "graphs": graphs,
        **({"eager_nodes": {n.name: why for n, why in first.eager.items()}} if first is not None else {}),
        **({"uncapturable_ops": {str(op): why for op, why in art.uncapturable.items()}} if art.uncapturable else {}),
    }
