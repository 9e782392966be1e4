"""The graph budget (issue 48, item 1): how many graphs a compile will capture, against the device's.

An ACL graph holds one of the device's streams from its capture on, and a device past its budget
refuses `capture_begin` (ACL error 207008). vLLM-Ascend sizes its PIECEWISE captures with
`resources_per_graph = num_hidden_layers + 1` (one graph per piece) against `MAX_CAPTURE_SIZE = 1800`
(`vllm_ascend/utils.py`, `update_aclgraph_sizes`), sampling its capture sizes uniformly, first and
last kept, when they do not fit. Here the count is exact for the compiled graph: every full graph key
(a bucket's decode and mixed graphs), plus each piecewise size times the pieces the piecewise variant
splits into (`lowering/piecewise.py`: attention and the other eager nodes between them). Over budget,
piecewise sizes are dropped the same way, the largest always kept (a step pads to the next size kept),
with one WARNING naming them; never a failure. A capture the device still refuses costs only that
graph (`capture_failures.py`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..config import CompileConfig
from ..passes.find_attention import attention_nodes
from ..passes.pipeline import RewrittenGraphs
from ..passes.split_pieces import Piece
from ..runtime.base import GraphRuntime, Runtime
from .piecewise import PiecewiseGraph

log = logging.getLogger("ascend_compile")


@dataclasses.dataclass
class GraphBudget:
    """The graphs a compile plans to capture and the budget they must fit."""

    full: int  # full graph keys (a bucket's decode, and mixed, graphs)
    pieces: int  # graphs per piecewise size
    sizes: list[int]  # the piecewise sizes kept
    dropped: list[int]  # the piecewise sizes dropped to fit the budget
    budget: int | None  # None: no limit known
    source: str  # where the budget comes from

    @property
    def graphs(self) -> int:
        return self.full + self.pieces * len(self.sizes)

    def describe(self) -> dict[str, Any]:
        return {"graphs": self.graphs, "full_graphs": self.full, "piecewise_sizes": len(self.sizes),
                "graphs_per_piecewise_size": self.pieces, "budget": self.budget, "budget_source": self.source,
                **({"dropped_piecewise_sizes": self.dropped} if self.dropped else {})}


def pieces_per_size(rewritten: RewrittenGraphs) -> int:
    """The graphs one piecewise size captures: the pieces its variant splits into (none: no variant)."""
    variant = rewritten.piecewise
    if variant is None:
        return 0
    safe = {w.node for w in rewritten.mutations.writes if w.padding_safe}
    graph = PiecewiseGraph(variant.keys[-1], (), variant, variant.gm, rewritten.signature, {}, set(), None, None, safe)
    return sum(isinstance(s, Piece) for s in graph.segments)


def sample(sizes: list[int], keep: int) -> list[int]:
    """`keep` of `sizes` (sorted), spread evenly, the largest always kept (and the smallest from 2 on)."""
    if keep >= len(sizes):
        return list(sizes)
    if keep <= 1:
        return sizes[-1:] if keep == 1 else []
    step = (len(sizes) - 1) / (keep - 1)
    return sorted({sizes[round(i * step)] for i in range(keep)})


def fit(rewritten: RewrittenGraphs, runtime: Runtime, config: CompileConfig, taken: int = 0) -> GraphBudget:
    """Count the graphs the compile will capture and drop piecewise sizes (from `rewritten.piecewise.keys`)
    until they fit the budget: `config.graph_budget`, else the runtime's (`GraphRuntime.graph_budget`) less
    the `taken` graphs other models planned on the same runtime (a workspace group's, `workspace_group.py`)."""
    if config.graph_budget is not None:
        budget, source = config.graph_budget, "the graph_budget option"
    elif isinstance(runtime, GraphRuntime):
        budget, source = runtime.graph_budget()
        if budget is not None and taken:
            budget, source = max(0, budget - taken), f"{source}, less {taken} graphs of the other models sharing it"
    else:
        budget, source = None, f"runtime {runtime.name!r} captures no graphs"
    variant = rewritten.piecewise
    sizes = [key.bucket for key in variant.keys] if variant is not None else []
    pieces = pieces_per_size(rewritten)
    # a full graph holding a layer served eagerly is never captured (`Target.eager_reason`)
    full = sum(1 for key in rewritten.choices if not attention_nodes(rewritten.variant_for(key).gm))
    kept = sizes
    if budget is not None and pieces and full + pieces * len(sizes) > budget:
        kept = sample(sizes, max(0, budget - full) // pieces)
        dropped = [s for s in sizes if s not in kept]
        log.warning("ascend_compile: %d graphs (%d full, %d piecewise sizes x %d pieces) exceed the budget of %d "
                    "(%s): piecewise sizes %s dropped, %s kept", full + pieces * len(sizes), full, len(sizes), pieces,
                    budget, source, dropped, kept or "none (steps no full graph serves run eagerly)")
        if kept:
            variant.keys[:] = [key for key in variant.keys if key.bucket in kept]
        else:
            rewritten.piecewise = None
            rewritten.piecewise_reason = f"no piecewise size fits the graph budget ({budget}, {source})"
    return GraphBudget(full, pieces, list(kept), [s for s in sizes if s not in kept], budget, source)
