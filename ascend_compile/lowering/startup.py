"""A compiled artifact's start-up (issue 48, items 1 and 3): its graph budget (`budget.py`) and ledger.

The ledger is the seconds of each compile phase (`ledger.PHASES`: dynamo's trace, the passes, the device
probes, kernel timing, the graph-memory estimate) and of each capture, full graph or piecewise size (read
from the graphs, which time their own captures); plan.json and `ascend-compile inspect` show it, and the
compile logs it as one INFO line. Captures run under a progress bar where tqdm is installed (the
`progress` extra).
"""
from __future__ import annotations

import collections
import logging
from typing import Any, Iterable

from .. import ledger
from .budget import GraphBudget

log = logging.getLogger("ascend_compile")


class Startup:
    """What a compiled artifact's start-up cost and planned: the compile's phases, the graph budget."""

    def __init__(self) -> None:
        self.phases: collections.Counter = collections.Counter()
        self.budget: GraphBudget | None = None
        self.plan: dict[str, Any] | None = None  # the persisted plan's file, answers reused and asked

    def compiled(self, phases: collections.Counter, budget: GraphBudget, plan: Any = None) -> None:
        """Record the compile's `phases`, `budget` and persisted plan (`plan_cache.PlanCache`, if any),
        and say so in one INFO line."""
        self.phases, self.budget = phases, budget
        self.plan = plan.describe() if plan is not None else None
        spent = ", ".join(f"{name} {phases[name]:.2f} s" for name in ledger.PHASES if name in phases)
        limit = f"a budget of {budget.budget}" if budget.budget is not None else "no budget known"
        log.info("ascend_compile: start-up: %s; %d graphs to capture (%d full, %d piecewise sizes x %d pieces), %s",
                 spent or "nothing timed", budget.graphs, budget.full, len(budget.sizes), budget.pieces, limit)

    def describe(self, art: Any) -> dict[str, Any]:
        """plan.json's `startup`: the compile's phases, each capture's seconds, and the graph budget."""
        captures = {g.name: round(g.capture_seconds, 4) for g in (*art.graphs.values(), *art.piecewise.values())
                    if g.capture_seconds}
        return {"seconds": {name: round(self.phases[name], 4) for name in ledger.PHASES if name in self.phases},
                "captures": captures, "capture_seconds": round(sum(captures.values()), 4),
                **({"graph_budget": self.budget.describe()} if self.budget is not None else {}),
                **({"plan": self.plan} if self.plan is not None else {})}


def progress(items: Iterable[Any], what: str) -> Iterable[Any]:
    """`items`, under a tqdm progress bar named `what` where tqdm is installed (an optional dependency)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=what, unit="graph", mininterval=1.0, delay=1.0)
