"""A piecewise graph's capture run on the live values of the step it is captured for.

A piece reads what earlier segments made: earlier pieces' static outputs and the results of the nodes
run eagerly between pieces. Captured one after the other on nothing but buffers, a piece's capture
would read what an earlier piece's capture left in its outputs (on the simulator: poison, 0xFF, -1
as an index, as a device's graph memory holds whatever was there) and padding values where an eager
node's result goes. Ops that check their operands when they run then fail in the capture (vLLM's
grouped top-k routing: `group_mask.scatter_(1, group_idx, 1)` on an earlier piece's `group_idx`:
"index -1 is out of bounds"), and a capture that runs its ops (the simulator's, a device's warm-up)
computes on values no step has. So the capture walks the segments as a step does (vLLM captures its
pieces inside a forward of the model, on that forward's values): each piece's buffers get the step's
rows as a replay's copy-in gives them, the piece is captured, then replayed once so that its static
outputs hold the step's values; each node between pieces runs on them as the step runs it.

What runs twice (here and in the step that follows): the pieces (they write only their own outputs
and the padding-safe cache writes, which write the same rows again) and the eager nodes writing no
caller's tensor (attention kernels into a piece's `out`, cache writes at the step's slots, in-place
ops on values pieces made, all recomputed by the step). A node writing a caller's tensor other than a
KV cache (`split_pieces.EagerNode.writes_caller`: it writes graph input storage, or is a view such a
node writes through) is not run here, where running it twice could change what the step computes;
what it (or anything after it) makes keeps its padding values in the capture.

Not where the graph holds functional collectives: the ranks agree on a capture's outcome only once it
ends (`capture_failures.agreed_failure`), so a rank whose device refused a piece would stop there while
the others replayed theirs, issuing collectives no rank pairs. Their pieces are captured on their
buffers, as before (an op checking its operands there still reads what an earlier capture left).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import fx

from ..passes.fx_utils import example_value
from ..passes.split_pieces import EagerNode
from ..runtime.base import GraphRuntime
from .capture_failures import collective_groups
from .inputs import Step
from .piecewise import _narrow


class LiveCapture:
    """The step a piecewise graph is captured for, run segment by segment as its pieces are captured."""

    def __init__(self, graph: Any, runtime: GraphRuntime, step: Step, args: Sequence[Any], workspace: torch.Tensor
                 ) -> None:
        """`graph`: the `piecewise.PiecewiseGraph` being captured; `args`: the step's arguments."""
        self.graph = graph
        self.runtime = runtime
        self.step = step
        self.args = args
        self.workspace = workspace
        self.plan, self.use_kernels, refusal = graph.plan(step, args, counted=False)  # `serve` plans it again
        #: not run: the step cannot run on these pieces (a kernel the target refuses has no op to run
        #: instead), or the graph holds functional collectives (below)
        self.refused = refusal is not None or bool(collective_groups(graph.gm))
        self.env: dict[fx.Node, Any] = dict.fromkeys(graph.workspace_nodes, workspace)
        #: nodes not run here (they write a caller's tensor), and every node reading one
        self.skipped: set[fx.Node] = set()

    def value(self, node: fx.Node) -> Any:
        """`node`'s value in this step: an eager node's result, a piece's static output cut to the step's
        sizes, a host list of the step's plan, or the step's argument."""
        if node in self.env:
            return self.env[node]
        produced = self.graph.produced.get(node)
        if produced is not None:
            captured, i = produced
            return _narrow(captured.outputs[i], example_value(node), self.step.symbols)
        host = self.graph.host.get(node)
        if host is not None:
            return self.plan.host[host]
        return self.args[self.graph.index[node]]

    def copy_in(self, captured: Any) -> None:
        """Before `captured` (a `_CapturedPiece`, its buffers made) is captured: the step's rows into its
        buffers, and their padding, as a replay's copy-in puts them."""
        dests, padding = self.graph.piece_copies(captured, self.step.symbols)
        pairs = [(dest, self.value(node)) for dest, (node, _) in zip(dests, captured.copied)
                 if node not in self.skipped]
        pairs += [(dest, constant) for dest, constant in padding]
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [v for _, v in pairs])

    def replay(self, captured: Any) -> None:
        """After `captured`'s capture: one replay, so that its static outputs hold this step's values."""
        captured.graph.replay()
        self.runtime.after_piece()

    def run(self, segment: EagerNode) -> None:
        """The node between pieces, run as the step runs it (unless it writes a caller's tensor, or reads
        what such a node made)."""
        node = segment.node
        if segment.writes_caller or any(a in self.skipped for a in node.all_input_nodes):
            self.skipped.add(node)
            return
        self.env[node] = self.graph.run_eager(self.runtime, node, self.value, self.workspace, self.use_kernels)

    def end(self) -> None:
        """After the last segment: what a piecewise step's end asks of the runtime."""
        self.runtime.after_piecewise_step()
