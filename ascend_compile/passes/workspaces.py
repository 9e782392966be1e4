"""Plan attention workspaces for the worst case, and insert them into bucket graphs.

The attention nodes of one graph run one after another on one stream, so they share one
workspace slot; graphs of different buckets never replay at once, so by default one slot serves
every bucket too, sized to the largest need. Each need is the exact maximum of
`workspace_nbytes` over every call of the graph, its sequences of any lengths in
[0, max_model_len], mixed or not (`tiling.max_workspace`; or, pinned, every sequence at one
length), and the plan keeps what per-bucket and per-layer workspaces would reserve, so the saving
is visible.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import fx

from ..ops import tiling
from ..ops.features import PLAIN, AttentionFeatures
from .kernel_call import kernel_calls

#: fx.Node.meta key of a workspace node: the slot serving each graph key the node's graph serves.
WORKSPACE_META_KEY = "ascend_workspace"
WORKSPACE_BYTES_KEY = "ascend_workspace_bytes"  # the bytes of each of those slots, by graph key


@dataclasses.dataclass(frozen=True)
class GraphKey:
    """Which graph of a compiled artifact: a bucket, for decode-only or for mixed steps; or, with
    `piecewise`, the pieces of one token count (`lowering/piecewise.py`), serving any step."""

    bucket: int
    decode: bool
    piecewise: bool = False

    def __str__(self) -> str:
        if self.piecewise:
            return f"p{self.bucket}"
        return f"b{self.bucket}.{'decode' if self.decode else 'mixed'}"


@dataclasses.dataclass(frozen=True)
class KernelSite:
    """One kernel node of one bucket graph, as the planner sees it."""

    node: str
    kernel: str
    shape: tiling.AttentionShape
    features: AttentionFeatures = PLAIN
    max_query_len: int | None = None  # the most query tokens a sequence has in the graph (None: its tokens)


@dataclasses.dataclass(frozen=True)
class NodeNeed:
    """What one kernel node needs: the bytes planned and the length needing them, and the true worst
    case (`exact_*`); `exact_argmax_batch` is the KV lengths of a call needing it, where known."""

    node: str
    kernel: str
    nbytes: int
    argmax_len: int
    exact_nbytes: int
    exact_argmax_len: int
    exact_argmax_batch: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """One workspace slot: its bytes, the length that needs them, and whether it covers every length."""

    name: str
    nbytes: int
    argmax_len: int
    sized_for: str  # the graph key and node whose need sets the size
    exact_nbytes: int  # the true worst case over every call
    exact_argmax_len: int
    exact_argmax_batch: tuple[int, ...] = ()  # the KV lengths of a call needing it, where known

    @property
    def undersized(self) -> bool:
        return self.nbytes < self.exact_nbytes


@dataclasses.dataclass(frozen=True)
class WorkspacePlan:
    """Workspace slots of a compiled artifact and what other schemes would cost."""

    max_model_len: int
    pinned_seq_len: int | None
    shared: bool
    slots: dict[str, SlotPlan]
    graph_slot: dict[str, str]
    needs: dict[str, tuple[NodeNeed, ...]]
    schemes: dict[str, int]

    def slot_for(self, key: GraphKey) -> SlotPlan:
        return self.slots[self.graph_slot[str(key)]]

    def warnings(self) -> list[str]:
        """Why a pinned plan can fail at replay."""
        out = []
        for slot in self.slots.values():
            if slot.undersized:
                mixed = len(set(slot.exact_argmax_batch)) > 1
                worst = (f"a step of KV lengths {list(slot.exact_argmax_batch)} needs" if mixed
                         else f"length {slot.exact_argmax_len} needs")
                out.append(
                    f"{slot.name}: workspace_seq_len={self.pinned_seq_len} gives {slot.nbytes} bytes, but {worst} "
                    f"{slot.exact_nbytes}: steps near {'it' if mixed else 'that length'} overrun the workspace"
                )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "pinned_seq_len": self.pinned_seq_len,
            "shared": self.shared,
            "slots": {
                name: dataclasses.asdict(slot) | {"undersized": slot.undersized} for name, slot in self.slots.items()
            },
            "graph_slot": dict(self.graph_slot),
            "needs": {key: [dataclasses.asdict(n) for n in needs] for key, needs in self.needs.items()},
            "schemes_bytes": dict(self.schemes),
            "warnings": self.warnings(),
        }


def kernel_sites(gm: fx.GraphModule) -> list[KernelSite]:
    """The PA/FIA nodes of a graph rewritten by `select_kernels`."""
    return [KernelSite(c.node.name, c.meta.kernel, c.meta.shape, c.meta.features) for c in kernel_calls(gm)]


def longest_read(site: KernelSite, tokens: int, max_model_len: int) -> int:
    """The most keys a sequence of the node reads in a graph of `tokens` query tokens: every
    length up to `max_model_len`, or with a window its span (`features.py`), at most
    `window + q - 1` for `q` query tokens (`window` in a graph of decode steps only)."""
    return site.features.longest_span(max_model_len, site.max_query_len or tokens)


def node_need(site: KernelSite, tokens: int, max_model_len: int, pinned_seq_len: int | None) -> NodeNeed:
    """Bytes a kernel node needs in a graph of `tokens` query tokens: the exact maximum over every
    length the node's kernel may tile (`longest_read`)."""
    exact = tiling.max_workspace(site.kernel, site.shape, tokens, longest_read(site, tokens, max_model_len))
    if pinned_seq_len is None:
        nbytes, argmax = exact.nbytes, exact.argmax_len
    else:
        lens = torch.tensor([min(pinned_seq_len, longest_read(site, tokens, max_model_len))])
        nbytes = tokens * int(tiling.per_token_nbytes(site.kernel, site.shape, lens)[0])
        argmax = pinned_seq_len
    return NodeNeed(site.node, site.kernel, nbytes, argmax, exact.nbytes, exact.argmax_len, exact.argmax_batch)


#: Sizes one kernel node for a graph of `tokens` query tokens: (site, tokens, max_model_len, pinned).
NeedFn = Callable[[KernelSite, int, int, "int | None"], NodeNeed]


def plan_workspaces(
    graphs: Iterable[tuple[GraphKey, list[KernelSite]]],
    max_model_len: int,
    pinned_seq_len: int | None = None,
    shared: bool = True,
    need_fn: NeedFn = node_need,
) -> WorkspacePlan:
    """One slot per graph (or one for all graphs), each sized to the largest need it serves.

    `need_fn` sizes each node: by default the exact formula scan of `node_need`; a device whose
    kernels have no formula (Ascend) passes one that probes the device's workspace query.
    """
    needs: dict[str, tuple[NodeNeed, ...]] = {}
    for key, sites in graphs:
        needs[str(key)] = tuple(need_fn(s, key.bucket, max_model_len, pinned_seq_len) for s in sites)

    def slot_from(name: str, keys: list[str]) -> SlotPlan:
        candidates = [(key, need) for key in keys for need in needs[key]]
        if not candidates:
            return SlotPlan(name, 0, 0, "", 0, 0)
        key, top = max(candidates, key=lambda kn: kn[1].nbytes)
        _, worst = max(candidates, key=lambda kn: kn[1].exact_nbytes)
        return SlotPlan(name, top.nbytes, top.argmax_len, f"{key}:{top.node}", worst.exact_nbytes,
                        worst.exact_argmax_len, worst.exact_argmax_batch)

    if shared:
        slot = slot_from("attn_workspace", list(needs))
        slots = {slot.name: slot}
        graph_slot = {key: slot.name for key in needs}
    else:
        slots, graph_slot = {}, {}
        for key in needs:
            slot = slot_from(f"attn_workspace_{key}", [key])
            slots[slot.name] = slot
            graph_slot[key] = slot.name
    per_bucket = sum(max((n.nbytes for n in ns), default=0) for ns in needs.values())
    per_layer = sum(n.nbytes for ns in needs.values() for n in ns)
    shared_bytes = max((s.nbytes for s in slots.values()), default=0) if shared else per_bucket
    schemes = {"shared": shared_bytes, "per_bucket": per_bucket, "per_layer": per_layer}
    return WorkspacePlan(max_model_len, pinned_seq_len, shared, slots, graph_slot, needs, schemes)


def insert_workspaces(gm: fx.GraphModule, keys: Sequence[GraphKey], plan: WorkspacePlan) -> fx.Node | None:
    """Give every kernel node of `gm` one workspace node standing for the planned slot of each graph
    key `gm` serves (the runner binds the slot of the key it captures); sized for the largest. The
    caller recompiles `gm` once its passes are done."""
    graph = gm.graph
    calls = kernel_calls(gm)
    if not calls:
        return None
    slots = {str(key): plan.slot_for(key) for key in keys}
    largest = max(slots.values(), key=lambda slot: slot.nbytes)
    old = [call.workspace for call in calls]
    with graph.inserting_after(graph.find_nodes(op="placeholder")[-1]):
        workspace = graph.call_function(torch.ops.ascend.workspace.default, (largest.nbytes, old[0].args[1]))
    workspace.meta[WORKSPACE_META_KEY] = {key: slot.name for key, slot in slots.items()}
    workspace.meta[WORKSPACE_BYTES_KEY] = {key: slot.nbytes for key, slot in slots.items()}
    for call, previous in zip(calls, old):
        call.set_workspace(workspace)
        if not previous.users:
            graph.erase_node(previous)
    graph.lint()
    return workspace

